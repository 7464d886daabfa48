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
    # Until then, DDP trains across the two machines, each rank given its host's --ifname, as the README says:
    # rank 0's host resolves its hostname to 127.0.0.1, as many cloud images do; and rank 0's host says it has
    # GPUs, the other none, so the trainers must agree on the CPU (conftest.gpu_host). Rank 0's own link goes
    # down, so that every new connection from it fails at once: TensorPipe aborted trainer 0 when that was its
    # first connection to a peer. Every rank names a rank on the other machine: rank 0 a peer, the others rank 0.
    assert hosts["down"] < VANISHED, hosts["down"]
    for script, ranks in hosts["vanished"].items():
        for rank, proc in enumerate(ranks):
            assert "terminate called" not in proc.err, proc
            lost = re.search(r"cannot reach rank (\d+) \(\w+\)( at [\d.]+:\d+)?$", one_error_line(proc))
            assert lost and (int(lost[1]) == 0) != (rank == 0), f"{script} rank {rank}: {proc}"


def test_a_run_on_one_machine_listens_on_loopback_only(hosts):
    # The RNN's one command on a host whose hostname resolves to its network address (as on many desktops and
    # cloud machines): RPC runs whatever any peer sends it, so its ranks listen on loopback, whatever the hostname
    # says. torch's store, with no address to bind, listens on every interface (*).
    listening = hosts["rnn listening"]
    assert any(addr == "127.0.0.1" for addr in listening), listening
    assert all(addr == "*" or ipaddress.ip_address(addr.strip("[]")).is_loopback for addr in listening), listening


def test_torchrun_across_two_machines(hosts):
    # The README's multi-node command, here on the RNN, one process per machine, each with its --ifname.
    for agent in hosts["torchrun"]:
        assert agent.returncode == 0, agent
    assert "".join(agent.out for agent in hosts["torchrun"]).count("Summary: epochs=2 ") == 1, hosts["torchrun"]


def test_ranks_started_by_hand_meet(shared_runs):
    # The RNN's ranks with the README's flags, at this host's own address, rank 1 started after rank 0 listens:
    # they meet and train.
    ranks = shared_runs["rnn ranks"]
    assert_succeeded(*ranks)
    assert "Summary: epochs=" in ranks[1].out, ranks[1]


def test_ranks_of_two_scripts_on_one_port_both_stop(shared_runs):
    # The RNN's rank 0 and CartPole's rank 1 meet (the names that one expects are not the other's): each ends
    # non-zero with one line, never 0 (at 82708e3 both ended 0, each answering the other's RPCs).
    for proc in shared_runs["scripts"]:
        one_error_line(proc)


def test_ranks_of_two_world_sizes_all_stop(shared_runs):
    # CartPole's rank 0 at --world_size 2 and rank 1 at 3; the parameter server's ranks 0 and 2 at 3 and rank 1
    # at the default 4, as when one terminal forgot the flag. Every rank ends non-zero with one line within the
    # meeting's 5 * --timeout (with room for a loaded machine), never 0.
    for name in ("sizes", "ps sizes"):
        for proc in shared_runs[name]:
            one_error_line(proc)
            assert proc.seconds < 5 * SIZES_TIMEOUT + 60, proc
