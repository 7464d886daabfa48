"""Several machines, and who can reach a run on one: a machine that vanishes, ranks that a person starts one by
one, ranks that are not of one run, torchrun across two machines, and the addresses a run on one machine
listens on. The machines are network namespaces (conftest's two_hosts), among conftest's shared runs; their
tests skip, saying why, where namespaces cannot be made.

Time limits here tell "bounded" from "hangs" only, each far above the slowest seen on two shared cores."""
import ipaddress
import re

import pytest

from conftest import SIZES_TIMEOUT, VANISH_TIMEOUT, assert_succeeded, one_error_line

# Every process is gone within VANISHED of the link going down (seen at --timeout 10: 10.1-10.4 s).
VANISHED = 3 * (VANISH_TIMEOUT + 5)


@pytest.fixture
def hosts(shared_runs):
    if isinstance(shared_runs["hosts"], str):
        pytest.skip(shared_runs["hosts"])
    return shared_runs


def test_a_vanished_machine_ends_every_process_on_both(hosts):
    # A power loss or a pulled cable closes no connection: only a timeout can notice, whatever a rank is doing.
    # Until then, DDP trains across the two machines with --master_addr only: rank 0's host resolves its hostname
    # to 127.0.0.1, as many cloud images do, so each rank must pick the interface that reaches it; and rank 0's
    # host says it has GPUs, the other none, so the trainers must agree on the CPU (conftest.gpu_host). Rank 0's
    # own link goes down, so that every new connection from it fails at once: TensorPipe aborted trainer 0 when
    # that was its first connection to a peer. Every rank names a rank on the other machine.
    assert hosts["down"] < VANISHED, hosts["down"]
    for script, ranks in hosts["vanished"].items():
        for rank, proc in enumerate(ranks):
            assert "terminate called" not in proc.err, proc
            lost = re.search(r"lost contact with rank (\d+) \(\w+\)$", one_error_line(proc))
            assert lost and (int(lost[1]) == 0) != (rank == 0), f"{script} rank {rank}: {proc}"


def test_a_run_on_one_machine_listens_on_loopback_only(hosts):
    # The RNN's one command on a host whose hostname resolves to its network address (as on many desktops and
    # cloud machines): RPC runs whatever any peer sends it, so its ranks listen on loopback, whatever the hostname
    # says. torch's store, with no address to bind, listens on every interface (*).
    listening = hosts["rnn listening"]
    assert any(addr == "127.0.0.1" for addr in listening), listening
    assert all(addr == "*" or ipaddress.ip_address(addr.strip("[]")).is_loopback for addr in listening), listening


def test_torchrun_across_two_machines(hosts):
    # The README's multi-node command, here on the RNN, one process per machine.
    for agent in hosts["torchrun"]:
        assert agent.returncode == 0, agent
    assert "".join(agent.out for agent in hosts["torchrun"]).count("Summary: epochs=2 ") == 1, hosts["torchrun"]


def test_ranks_started_by_hand_say_what_they_wait_for_and_meet(shared_runs):
    # The RNN's ranks with the README's flags, rank 1 started after rank 0 said that it waits. Each says once
    # for how long (without --timeout, 5 minutes, which the README states), for how many ranks and where; they
    # meet and train.
    ranks = shared_runs["rnn ranks"]
    flags = ranks[0].proc.args
    where = f"{flags[flags.index('--master_addr') + 1]}:{flags[flags.index('--master_port') + 1]}"
    for rank, proc in enumerate(ranks):
        assert_succeeded(proc)
        assert re.findall(r"^Rank \d+ waits .*$", proc.err, re.M) == [
            f"Rank {rank} waits 300 s for all 2 ranks at {where}"], proc
    assert "Summary: epochs=" in ranks[1].out, ranks[1]


def test_ranks_of_two_scripts_on_one_port_both_stop(shared_runs):
    # Without a check both would exit 0 without training: each script's done-RPC would answer the other's.
    for proc in shared_runs["scripts"]:
        port = proc.proc.args[proc.proc.args.index("--master_port") + 1]
        assert one_error_line(proc).endswith(f"): ranks of two scripts met at port {port}"), proc


def test_ranks_of_two_world_sizes_all_name_them(shared_runs):
    # CartPole's rank 0 at --world_size 2 and rank 1 at 3; the parameter server's ranks 0 and 2 at 3 and rank 1
    # at the default 4, as when one terminal forgot the flag. Every rank, rank 2 too (it agrees with rank 0),
    # names the two world sizes, as soon as they meet: long before their 5 * --timeout.
    for name, sizes in (("sizes", "2 and 3"), ("ps sizes", "3 and 4")):
        for proc in shared_runs[name]:
            assert one_error_line(proc).endswith(f"): ranks of --world_size {sizes} met"), proc
            assert proc.seconds < 5 * SIZES_TIMEOUT, proc
