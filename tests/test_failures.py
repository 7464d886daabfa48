"""The README's "If it hangs or fails", each case for real. "At once" is far under --timeout."""
import contextlib
import os
import re
import signal
import socket
import time

import psutil
import pytest

from conftest import (AT_ONCE, IN_PROCESS, LIVE, assert_succeeded, changed_copy, ends_with,
                      free_port, listening, one_error_line, terminals)

TIMEOUT = ["--timeout", 120]  # of runs that fail: a dead peer is noticed long before


def test_a_peer_lost_in_rpc_shutdown_ends_rank_0(run, tmp_path):
    # rpc.shutdown() alone would wait for the dead trainer forever.
    lost = changed_copy(tmp_path, "rpc_rnn_model_parallel.py", "    rpc.shutdown()\n",
                        "    if rank == 1:\n        time.sleep(1)\n"
                        "        os.kill(os.getpid(), signal.SIGKILL)\n    rpc.shutdown()\n")
    ps, trainer = terminals(run, lost, 2, "--timeout=10")
    assert trainer.wait().returncode == -signal.SIGKILL, trainer
    ends_with(ps, "Error on rank 0 (ps): lost a peer in rpc.shutdown()", 10 + AT_ONCE)


def test_a_rank_whose_work_is_done_says_nothing_more(run, tmp_path):
    # The trainer lingers as it exits, after rank 0 has gone.
    linger = changed_copy(tmp_path, "rpc_rnn_model_parallel.py", "    rpc.shutdown()\n",
                          "    rpc.shutdown()\n    if rank == 1:\n        import atexit\n"
                          "        atexit.register(time.sleep, 4)\n")
    ps, trainer = terminals(run, linger, 2)
    assert_succeeded(ps.wait(), trainer.wait())
    assert "Summary:" in trainer.out, trainer


def test_ranks_of_two_world_sizes_all_end_not_0(run):
    # Rank 1 forgot --world_size=3 (the default is 4).
    common = ["rpc_parameter_server.py", "--master_port", free_port(), "--timeout=4"]
    ranks = [run(*common, "--rank=0", "--world_size=3")]
    listening(ranks[0])
    for rank in ranks + [run(*common, "--rank=1"), run(*common, "--rank=2", "--world_size=3")]:
        one_error_line(rank.wait(5 * 4 + AT_ONCE))


def test_a_rank_that_never_arrives_makes_rank_0_give_up_and_the_others_name_it(run):
    # Rank 2 never starts; rank 1 would have waited 5 * 120 s.
    common = ["rpc_rl_cartpole.py", "--world_size=3", "--master_port", free_port()]
    agent = run(*common, "--rank=0", "--timeout=4")
    listening(agent)
    observer = run(*common, "--rank=1", *TIMEOUT)
    ends_with(agent, "Error on rank 0 (agent): not all ranks met", 5 * 4 + AT_ONCE)
    ends_with(observer, "Error on rank 1 (obs1): cannot reach rank 0 (agent)")


def test_a_killed_observer_is_named_by_rank_0_and_the_others_follow(run):
    agent, observer, doomed = terminals(run, "rpc_rl_cartpole.py", 3, "--max_episodes", 10 ** 5,
                                        "--log_interval=1", *TIMEOUT,
                                        env={"OMP_NUM_THREADS": "1", **LIVE})
    agent.wait_for("Episode 2\t")
    doomed.kill()
    ends_with(agent, "Error on rank 0 (agent): cannot reach rank 2 (obs2)")
    ends_with(observer, "Error on rank 1 (obs1): cannot reach rank 0 (agent)")  # only waited


def test_a_port_whose_listener_never_answers(run):
    # torch's meeting alone would wait forever.
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = ["--master_port", listener.getsockname()[1]]
        ps = run("rpc_rnn_model_parallel.py", "--rank=0", *port, *TIMEOUT)
        trainer = run("rpc_rnn_model_parallel.py", "--rank=1", *port, "--timeout=1")
        line = one_error_line(ps.wait(AT_ONCE))  # ours, then torch's words
        assert line.startswith("Error on rank 0 (ps): ") and str(port[1]) in line, ps
        ends_with(trainer, "Error on rank 1 (trainer): not all ranks met", 5 * 1 + AT_ONCE)


@pytest.mark.parametrize("rank", [["--rank=0"], []], ids=["rank 0", "one command"])
def test_an_address_that_does_not_resolve_is_named_at_once(run, rank):
    proc = run("rpc_rnn_model_parallel.py", *rank, "--master_addr", "nosuch.host.invalid",
               *TIMEOUT).wait(AT_ONCE)
    assert proc.returncode == 1, proc
    assert "): cannot resolve --master_addr nosuch.host.invalid\n" in proc.err, proc


@IN_PROCESS
def test_a_gpu_that_is_not_there_ends_rank_0_at_once_and_its_peers_wait(run, gpus):
    # Rank 1 cannot tell a rank 0 that failed from one not started yet.
    if gpus >= 2:
        pytest.skip("this host has 2 GPUs or more: --num_gpus allows at most 2")
    common, gpu = ["rpc_parameter_server.py", "--world_size=2"], f"--num_gpus={gpus + 1}"
    one_command = run(*common, gpu, *TIMEOUT)
    common += ["--master_port", free_port()]
    ps, trainer = run(*common, "--rank=0", gpu, *TIMEOUT), run(*common, "--rank=1", "--timeout=2")
    line = (f"Error on rank 0 (parameter_server): ValueError: --num_gpus {gpus + 1} is more GPUs "
            f"than the parameter server has ({gpus})")
    ends_with(ps, line)
    # In one command, the trainer may say that it lost rank 0 before the launcher stops it.
    lost = "Error on rank 1 (trainer_1): cannot reach rank 0 (parameter_server)\n"
    err = one_command.wait(AT_ONCE).err.replace(lost, "")
    assert (one_command.returncode, one_command.out, err) == (
        1, "", f"{line}\nRank 0 ended (exit code 1).\n"), one_command
    ends_with(trainer, "Error on rank 1 (trainer_1): not all ranks met", 5 * 2 + AT_ONCE)


def test_ranks_of_two_scripts_on_one_port_both_end_not_0(run):
    # They meet, then fail on the names each expects.
    port = ["--master_port", free_port(), *TIMEOUT]
    rnn = run("rpc_rnn_model_parallel.py", "--rank=0", *port)
    listening(rnn)
    for proc in (rnn, run("rpc_rl_cartpole.py", "--rank=1", *port)):
        one_error_line(proc.wait(AT_ONCE))


def test_an_exception_inside_an_rpc_names_its_rank_and_cause(run, tmp_path):
    # The decoder raises as the parameter server builds it: the innermost of torch's reports.
    buggy = changed_copy(tmp_path, "rpc_rnn_model_parallel.py", "self.decoder = nn.Linear(",
                         "raise ValueError('decoder bug')\n        self.decoder = nn.Linear(")
    ps, trainer = terminals(run, buggy, 2, *TIMEOUT)
    ends_with(trainer, "Error on rank 1 (trainer): rank 0 (ps): ValueError('decoder bug')")
    ends_with(ps, "Error on rank 0 (ps): cannot reach rank 1 (trainer)")


def all_gone(launcher):
    while launcher.left() and time.monotonic() < launcher.ended + AT_ONCE:
        time.sleep(0.1)
    return not launcher.left()


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["Ctrl-C", "kill"])
def test_ctrl_c_or_kill_as_the_ranks_start_ends_every_process(run, stop):
    # Ctrl-C reaches the terminal's whole group; `kill` the launcher, whose ranks torch's parent-
    # death signal ends. It ends as any program does: the shell sees 130 for Ctrl-C.
    launcher = run("rpc_rnn_model_parallel.py", "--epochs", 10 ** 5, *TIMEOUT)

    def forked_ranks():  # its children with its command line, not the programs it runs
        with contextlib.suppress(psutil.Error):
            me = psutil.Process(launcher.pid)
            return [child for child in me.children() if child.cmdline() == me.cmdline()]
    launcher.wait_until(lambda: len(forked_ranks() or []) >= 2)
    (os.killpg if stop == signal.SIGINT else os.kill)(launcher.pid, stop)
    assert launcher.wait(AT_ONCE).returncode == -stop and all_gone(launcher), launcher
    assert "Traceback" not in launcher.err and (stop == signal.SIGTERM or launcher.err == "")


@pytest.mark.parametrize("bug, timeout, cause", [  # while the other trainer waits on it in DDP
    ("raise ValueError('trainer bug')", 120, "rank 1 (trainer1): ValueError('trainer bug')\n"),
    # Alive, it answers the watch: trainer 0's all-reduce gives up after 5 * --timeout.
    ("time.sleep(10 ** 6)", 4, "rank 0 (trainer0): RuntimeError(")], ids=["raises", "stalls"])
def test_a_trainer_that_raises_or_stalls_ends_the_one_command_naming_it(run, tmp_path, bug,
                                                                         timeout, cause):
    line = '        print(f"Training done for epoch {epoch} loss'
    faulty = changed_copy(tmp_path, "ddp_rpc_hybrid.py", line,
                          f"        if (rank, epoch) == (1, 1):\n            {bug}\n{line}")
    launcher = run(faulty, "--epochs", 10 ** 5, "--timeout", timeout).wait(2 * AT_ONCE)
    assert launcher.returncode == 1 and all_gone(launcher), launcher
    assert f"rank 2 (master): {cause}" in launcher.err, launcher
    ranks = re.findall(r"^Error on rank (\d)", launcher.err, re.M)
    assert len(ranks) == len(set(ranks)), launcher  # at most one line each
    assert launcher.err.strip().splitlines()[-1] == "Rank 2 ended (exit code 1).", launcher
