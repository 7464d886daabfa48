"""The README's "If it hangs or fails", each case for real: processes, signals, a port taken, a
listener that never answers. A bound tells "bounded" from "hangs"; "at once" (AT_ONCE) is also far
under the --timeout that a rank noticing late would take."""
import contextlib
import os
import re
import signal
import socket
import time
from pathlib import Path

import pytest

from conftest import AT_ONCE, IN_PROCESS, LIVE, changed_copy, free_port, listening, one_error_line, terminals

TIMEOUT = ["--timeout", 120]  # of runs that fail: a dead peer is noticed long before


def by_hand(run, rank_0, *others):
    """Rank 0's command, then, once it listens, the others' (run's arguments, each a list)."""
    ranks = [run(*rank_0)]
    listening(ranks[0])
    return ranks + [run(*command) for command in others]


def test_a_peer_lost_in_rpc_shutdown_ends_rank_0(run, tmp_path):
    # The trainer dies once it has said that it is done: rank 0, which waits for it in
    # rpc.shutdown() (forever, alone), ends --timeout and 2 s later.
    lost = changed_copy(tmp_path, "rpc_rnn_model_parallel.py", "    rpc.shutdown()\n",
                        "    if rank == 1:\n        time.sleep(1)\n"
                        "        os.kill(os.getpid(), signal.SIGKILL)\n    rpc.shutdown()\n")
    ps, trainer = terminals(run, lost, 2, "--timeout=10")
    assert trainer.wait().returncode == -signal.SIGKILL, trainer
    assert one_error_line(ps.wait()) == "Error on rank 0 (ps): lost a peer in rpc.shutdown()"
    assert ps.ended - trainer.ended < 10 + AT_ONCE, ps


def test_ranks_of_two_world_sizes_all_end_not_0(run):
    # The parameter server's ranks 0 and 2 at --world_size 3, rank 1 at the default 4 (its terminal
    # forgot the flag): they never meet, and each ends within its meeting's 5 * --timeout.
    common = ["rpc_parameter_server.py", "--master_port", free_port(), "--timeout=4"]
    for rank in by_hand(run, [*common, "--rank=0", "--world_size=3"], [*common, "--rank=1"],
                        [*common, "--rank=2", "--world_size=3"]):
        one_error_line(rank.wait(5 * 4 + AT_ONCE))


def test_a_rank_that_never_arrives_makes_rank_0_give_up_and_its_peers_name_it(run):
    # CartPole at world size 3, rank 2 never started: rank 0 gives up after 5 * --timeout, and
    # rank 1 names rank 0 at once, long before its own 5 * 120 s.
    common = ["rpc_rl_cartpole.py", "--world_size=3", "--master_port", free_port()]
    agent, observer = by_hand(run, [*common, "--rank=0", "--timeout=4"],
                              [*common, "--rank=1", *TIMEOUT])
    assert one_error_line(agent.wait(5 * 4 + AT_ONCE)) == "Error on rank 0 (agent): not all ranks met"
    assert one_error_line(observer.wait()) == "Error on rank 1 (obs1): cannot reach rank 0 (agent)"
    assert observer.ended - agent.ended < AT_ONCE, observer


def test_a_killed_observer_is_named_by_rank_0_and_the_others_follow(run):
    # The agent, waiting on episodes, names the observer; the other observer, which only waits,
    # names rank 0 once that has ended.
    agent, observer, doomed = terminals(run, "rpc_rl_cartpole.py", 3, "--max_episodes", 10 ** 5,
                                        "--log_interval=1", *TIMEOUT,
                                        env={"OMP_NUM_THREADS": "1", **LIVE})
    agent.wait_for("Episode 2\t")
    doomed.kill()
    killed = time.monotonic()
    assert one_error_line(agent.wait()) == "Error on rank 0 (agent): cannot reach rank 2 (obs2)"
    assert one_error_line(observer.wait()) == "Error on rank 1 (obs1): cannot reach rank 0 (agent)"
    assert max(agent.ended, observer.ended) - killed < AT_ONCE, (agent, observer)


@pytest.fixture
def silent_port():
    """A port whose listener never answers: torch's rendezvous alone would wait there forever."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        yield listener.getsockname()[1]


def test_a_listener_that_never_answers_ends_the_meeting(run, silent_port):
    proc = run("rpc_rnn_model_parallel.py", "--rank=1", "--master_port", silent_port, "--timeout=1")
    assert one_error_line(proc.wait(5 * 1 + AT_ONCE)) == "Error on rank 1 (trainer): not all ranks met"


def test_a_port_in_use_is_named_at_once(run, silent_port):
    proc = run("rpc_rnn_model_parallel.py", "--rank=0", "--master_port", silent_port, *TIMEOUT)
    line = one_error_line(proc.wait(AT_ONCE))  # ours, then torch's words, which name the port
    assert line.startswith("Error on rank 0 (ps): ") and str(silent_port) in line, proc


@pytest.mark.parametrize("rank", [["--rank=0"], ["--rank=1"], []], ids=["rank 0", "rank 1", "one command"])
def test_an_address_that_does_not_resolve_is_named_at_once(run, rank):
    proc = run("rpc_rnn_model_parallel.py", *rank, "--master_addr", "nosuch.host.invalid",
               *TIMEOUT).wait(AT_ONCE)
    line = "cannot resolve --master_addr nosuch.host.invalid"
    assert proc.returncode == 1 and f"): {line}\n" in proc.err, proc
    if rank:
        assert one_error_line(proc).endswith(line), proc


def test_a_bad_flag_value_stops_the_command_before_anything_starts(run):
    proc = run("rpc_rnn_model_parallel.py", "--epochs=0").wait(AT_ONCE)
    assert proc.returncode == 2 and proc.out == "" and proc.err.startswith("usage: "), proc
    assert proc.err.endswith("error: argument --epochs: 0 is not in [1, inf]\n"), proc


@pytest.fixture
def no_gpu(gpus):
    """--num_gpus one more than this host has, and the parameter server's words for it."""
    if gpus >= 2:
        pytest.skip("this host has 2 GPUs or more: --num_gpus allows at most 2")
    return gpus + 1, f"--num_gpus {gpus + 1} is more GPUs than the parameter server has ({gpus})"


@IN_PROCESS
def test_a_gpu_that_is_not_there_ends_the_one_command_at_once(run, no_gpu):
    # The parameter server alone knows its GPUs: it says so, and the launcher names it; the
    # trainer, still meeting, may say that it lost rank 0 before the launcher stops it.
    proc = run("rpc_parameter_server.py", "--world_size=2", f"--num_gpus={no_gpu[0]}",
               "--master_port", free_port(), *TIMEOUT).wait(AT_ONCE)
    lost = "Error on rank 1 (trainer_1): cannot reach rank 0 (parameter_server)"
    assert proc.returncode == 1 and proc.out == "", proc
    assert proc.err.strip().splitlines() in (
        [f"Error on rank 0 (parameter_server): ValueError: {no_gpu[1]}", *lost_line,
         "Rank 0 ended (exit code 1)."] for lost_line in ([], [lost])), proc


@IN_PROCESS
def test_a_rank_0_that_fails_before_the_ranks_meet_ends_at_once_and_its_peers_wait(run, no_gpu):
    # One terminal per rank: rank 0 does not wait 5 * --timeout for peers to tell them; rank 1
    # cannot tell a rank 0 that failed from one not started yet, and waits 5 * --timeout for it.
    common = ["rpc_parameter_server.py", "--world_size=2", "--master_port", free_port()]
    ps = run(*common, "--rank=0", f"--num_gpus={no_gpu[0]}", *TIMEOUT)
    trainer = run(*common, "--rank=1", "--timeout=2")
    assert one_error_line(ps.wait(AT_ONCE)) == ("Error on rank 0 (parameter_server): ValueError: "
                                                f"{no_gpu[1]}")
    assert one_error_line(trainer.wait(5 * 2 + AT_ONCE)) == ("Error on rank 1 (trainer_1): not all "
                                                            "ranks met")


def test_ranks_of_two_scripts_on_one_port_both_end_not_0(run):
    # The RNN's rank 0 and CartPole's rank 1 meet, then fail on the names each expects (at 82708e3
    # both ended 0, each answering the other's RPCs).
    port = ["--master_port", free_port(), *TIMEOUT]
    for proc in by_hand(run, ["rpc_rnn_model_parallel.py", "--rank=0", *port],
                        ["rpc_rl_cartpole.py", "--rank=1", *port]):
        one_error_line(proc.wait(AT_ONCE))


def test_an_exception_inside_an_rpc_names_its_rank_and_cause(run, tmp_path):
    # A copy whose decoder, built on the parameter server, raises: the trainer gets it nested in
    # two of torch's reports and names the innermost; torch prints the traceback on the server,
    # which then loses its trainer.
    buggy = changed_copy(tmp_path, "rpc_rnn_model_parallel.py", "self.decoder = nn.Linear(",
                         "raise ValueError('decoder bug')\n        self.decoder = nn.Linear(")
    ps, trainer = terminals(run, buggy, 2, *TIMEOUT)
    assert one_error_line(trainer.wait(AT_ONCE)) == ("Error on rank 1 (trainer): rank 0 (ps): "
                                                     "ValueError('decoder bug')")
    assert one_error_line(ps.wait(AT_ONCE)) == "Error on rank 0 (ps): cannot reach rank 1 (trainer)"


def forked_ranks(launcher):
    """The ranks a one-command run forked: its children with its command line (as it imports torch,
    it also runs programs, each a fork of it for a moment)."""
    def read(path):
        with contextlib.suppress(OSError):
            return Path(f"/proc/{launcher.pid}/{path}").read_bytes()
    children = (read(f"task/{launcher.pid}/children") or b"").split()
    return [pid for pid in children if read(f"../{pid.decode()}/cmdline") == read("cmdline")]


def all_gone(launcher):
    """No process of the run is left AT_ONCE s after the launcher ended."""
    while launcher.left() and time.monotonic() < launcher.ended + AT_ONCE:
        time.sleep(0.1)
    return not launcher.left()


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["Ctrl-C", "kill"])
def test_ctrl_c_or_kill_as_the_ranks_start_ends_every_process(run, stop):
    # Ctrl-C reaches the terminal's whole foreground group; `kill` the launcher alone, whose ranks
    # end by torch's parent-death signal. The launcher ends as any program does (the shell sees 130
    # for Ctrl-C) and every rank with it, at once, with no traceback.
    launcher = run("rpc_rnn_model_parallel.py", "--epochs", 10 ** 5, *TIMEOUT)
    launcher.wait_until(lambda: len(forked_ranks(launcher)) >= 2)
    (os.killpg if stop == signal.SIGINT else os.kill)(launcher.pid, stop)
    assert launcher.wait(time.monotonic() - launcher.started + AT_ONCE).returncode == -stop
    assert all_gone(launcher) and "Traceback" not in launcher.err, launcher
    assert stop == signal.SIGTERM or launcher.err == "", launcher


def test_a_trainer_that_raises_ends_the_one_command_naming_it(run, tmp_path):
    # DDP: the master names the trainer and its error at once; trainer 1, in an allreduce with it,
    # and the others end as they lose the master; the launcher names the rank that ended first.
    line = '        print(f"Training done for epoch {epoch} loss'
    raising = changed_copy(tmp_path, "ddp_rpc_hybrid.py", line, '        if rank == 0 and epoch == 1:'
                           '\n            raise ValueError("trainer bug")\n' + line)
    launcher = run(raising, "--epochs", 10 ** 5, *TIMEOUT).wait(2 * AT_ONCE)
    assert launcher.returncode == 1 and all_gone(launcher), launcher
    assert "Error on rank 2 (master): rank 0 (trainer0): ValueError('trainer bug')\n" in launcher.err
    ranks = re.findall(r"^Error on rank (\d)", launcher.err, re.M)
    assert len(ranks) == len(set(ranks)), launcher  # at most one line each
    assert launcher.err.strip().splitlines()[-1] == "Rank 2 ended (exit code 1).", launcher
