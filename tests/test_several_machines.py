"""Several machines, and who can reach a run on one: a machine that vanishes, ranks that a person starts one by
one, ranks that are not of one run, torchrun across two machines, and the addresses a run on one machine
listens on. The machines are network namespaces (conftest's two_hosts), among conftest's shared runs; their
tests skip, saying why, where namespaces cannot be made.

Time limits here tell "bounded" from "hangs" only, each far above the slowest seen on two shared cores."""
import ipaddress
import re

import pytest

from conftest import VANISH_TIMEOUT, assert_succeeded, one_error_line

# Every process is gone within VANISHED of the link going down (seen while the whole suite ran: 10.3 s).
VANISHED = 3 * (VANISH_TIMEOUT + 5)
ONLY_WAIT = {("ddp_rpc_hybrid.py", 2), ("ddp_rpc_hybrid.py", 3)}  # the master and the parameter server
TIMED_OUT = ("RPC ran for more than set timeout", "Timed out waiting")  # an RPC's timeout, a Gloo collective's


@pytest.fixture
def hosts(shared_runs):
    if isinstance(shared_runs["hosts"], str):
        pytest.skip(shared_runs["hosts"])
    return shared_runs


def test_a_vanished_machine_ends_every_process_on_both(hosts):
    # A power loss or a pulled cable closes no connection: only a timeout can notice, whatever a rank is doing.
    # Until then, DDP trains across the two machines with --master_addr only: rank 0's host resolves its hostname
    # to 127.0.0.1, as many cloud images do, so each rank must pick the interface that reaches it. Rank 0's own
    # link goes down, so that every new connection from it fails at once: TensorPipe aborted trainer 0 when
    # that was its first connection to a peer.
    assert hosts["down"] < VANISHED, hosts["down"]
    for script, ranks in hosts["vanished"].items():
        for rank, proc in enumerate(ranks):
            assert "terminate called" not in proc.err, proc
            line = one_error_line(proc)
            lost = re.search(r"lost contact with rank (\d+) \(\w+\)$", line)
            if (script, rank) in ONLY_WAIT or not any(phrase in line for phrase in TIMED_OUT):
                # ... and it names a rank on the other machine
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


def test_ranks_started_by_hand_wait_minutes_for_each_other(shared_runs):
    # The RNN's ranks with the README's flags, rank 1 started after rank 0 said that it waits. Each says it once:
    # without --timeout, minutes (a lone one still ends after that, the README says); they meet and train.
    ranks = shared_runs["rnn ranks"]
    for rank, proc in enumerate(ranks):
        assert_succeeded(proc)
        assert re.findall(r"^Rank \d+ waits .*$", proc.err, re.M) == [f"Rank {rank} waits 300 s for all"], proc
    assert "Summary: epochs=" in ranks[1].out, ranks[1]


def test_ranks_of_two_scripts_on_one_port_both_stop(shared_runs):
    # Without a check both would exit 0 without training: each script's done-RPC would answer the other's.
    rnn, cartpole = shared_runs["scripts"]
    assert one_error_line(rnn).endswith("could not find destination name trainer"), rnn
    assert one_error_line(cartpole).endswith("could not find destination name agent"), cartpole


def test_ranks_of_two_world_sizes_on_one_port_both_stop(shared_runs):
    # Rank 0, which hosts the meeting, names the world size it waited for; rank 1 that, or the host gone.
    first, second = shared_runs["sizes"]
    assert "Error on rank 0 (agent): not all 2 ranks met at port " in one_error_line(first), first
    assert re.search(r"not all 3 ranks met at port|Connection was likely closed", one_error_line(second)), second
