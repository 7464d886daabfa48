"""How runs end when something goes wrong: the cases of the README's "If it hangs or fails", each provoked for
real: real processes, real signals, a really taken port, a listener that never answers.

Time limits here tell "bounded" from "hangs", each at least twice the slowest seen while two copies of the
suite ran side by side on two cores; "at once" is also well under --timeout, so that a rank that only noticed
at its timeout fails."""
import os
import re
import signal
import socket
import time
from pathlib import Path

import pytest
import torch

from conftest import (LIVE, Run, assert_no_traceback, changed_copy, error_lines, free_port, listening, named_case,
                      one_error_line, side_by_side, stop_all, when)

TIMEOUT = 120  # --timeout of the runs that fail: a dead peer is noticed at once, a busy machine is no failure
HANG = TIMEOUT + 60  # a test's own limit: far above what the scripts promise
# Bounds, each at least twice the slowest seen while two copies of the suite ran side by side on 2 cores: a
# survivor of a dead peer, or a one-command run stopped under way, is gone within AT_ONCE (seen: 2.2 s alone,
# 29.5 s side by side); a rank that cannot meet within LONE_BOUND of its start, torch's import and its 5 * LONE s
# wait included (10.8 s alone, 52.6 s side by side).
AT_ONCE = 60
LONE = 1  # --timeout of the ranks whose peers never answer: they wait 5 s to meet
LOST = 10  # --timeout of the ranks of a run whose trainer is lost in rpc.shutdown(): room to meet, then a bound
GIVE_UP = 8  # --timeout of a rank 0 that gives up waiting after 5 * GIVE_UP s, once its peer, started later, meets
LONE_BOUND = 5 * LONE + 115


def assert_one_line(proc, *phrases, code=1):
    """Exit status `code`, no traceback, and exactly one error line, naming the problem."""
    line = one_error_line(proc, code)
    assert_no_traceback(proc.err)  # nor torch's
    for phrase in phrases:
        assert phrase in line, proc
    return line


def gone(proc, since):
    """Seconds from `since` until no process of the run was left, or HANG if some still were then."""
    while proc.processes_left() and time.monotonic() - since < HANG:
        time.sleep(0.05)
    return time.monotonic() - since


STOPS = ("Ctrl-C as the ranks start", "kill while the ranks start", "a trainer raises")


def launched_ranks(launcher):
    """The rank processes a one-command run has forked so far: the launcher's children with its command line (as it
    imports torch, the launcher also runs programs, each for a moment a fork of it)."""
    def command(pid):
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return None
    try:
        children = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split()
    except OSError:
        return []
    return [child for child in children if command(child) == command(launcher.pid)]


@pytest.fixture(scope="module")
def failure_runs(tmp_path_factory):
    """The failure cases, started side by side (conftest.side_by_side), all ended before any test reads them: a dict
    by case of runs, or of a run's ranks. One terminal per rank (--rank): a listener that never answers on the
    port, the port in use, an address that does not resolve, MNIST that cannot be downloaded (in a folder of its
    own), an exception inside an RPC, an observer killed, a peer lost in rpc.shutdown(), a rank 0 alone that fails
    before the ranks meet. One command: a bad flag value, a GPU that is not there, and the cases of STOPS, each run with .stopped (when the test acted, or the
    trainer raised) and .gone (seconds from then until no process of the run was left)."""
    folder, started, runs = tmp_path_factory.mktemp("failures"), [], {}

    def run(script, *args, env=None, cwd=folder):
        started.append(Run(script, args, cwd=cwd, env=env))
        return started[-1]

    def case(name, begin, act=None):
        return named_case(runs, name, begin, act, HANG)

    holder = socket.socket()  # a plain program that listens on a port and never answers
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    taken = runs["taken"] = holder.getsockname()[1]
    # A bug in code that runs on another rank, as in a copy of the script someone changed: the decoder, built on
    # the parameter server, raises, which the trainer meets nested in two of torch's reports.
    buggy = changed_copy(tmp_path_factory.mktemp("buggy"), "rpc_rnn_model_parallel.py",
                         "self.drop = nn.Dropout(dropout)\n        self.decoder",
                         "raise ValueError('decoder bug')\n        self.decoder")
    line = '        print(f"Training done for epoch {epoch} loss {epoch_losses[-1]:.4f} (trainer{rank})")\n'
    raising = changed_copy(tmp_path_factory.mktemp("raising"), "ddp_rpc_hybrid.py", line,
                           line + '        if rank == 0 and epoch == 1:\n            raise ValueError("trainer bug")\n')
    # The trainer is lost as it enters rpc.shutdown(), once it has said that it is done: rank 0 ("ps", which leads
    # rpc.shutdown()) has waited there for it since the start.
    lost = changed_copy(tmp_path_factory.mktemp("lost"), "rpc_rnn_model_parallel.py", "    rpc.shutdown()\n",
                        "    if rank == 1:\n        time.sleep(1)\n        os.kill(os.getpid(), signal.SIGKILL)\n"
                        "    rpc.shutdown()\n")
    common = ["--master_port", free_port(), "--timeout", TIMEOUT]
    gpus = torch.cuda.device_count() + 1  # one GPU more than this host has
    # No network: proxies that refuse, for every host (a user's no_proxy would let a download past them).
    refused = f"http://127.0.0.1:{free_port()}"
    no_network = {name: refused for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY")}
    no_network.update(no_proxy="", NO_PROXY="")
    no_mnist, no_mnist_port = tmp_path_factory.mktemp("no_mnist"), free_port()
    (no_mnist / "mine").mkdir()  # a folder of the user's, empty, given as --data_dir
    cartpole = ["rpc_rl_cartpole.py", "--world_size=3", "--master_port", free_port(), "--timeout", TIMEOUT,
                "--max_episodes", 100000, "--log_interval", 1]
    stopping = ["rpc_rnn_model_parallel.py", "--epochs", 100000, "--timeout", TIMEOUT]
    lost_port = free_port()
    give_up = ["--master_port", free_port()]

    def stopped(launcher):
        launcher.stopped = time.monotonic()
        launcher.gone = gone(launcher, launcher.stopped)

    def interrupt(launcher):  # a Ctrl-C in the terminal reaches the whole foreground group
        when([launcher], lambda: len(launched_ranks(launcher)) >= 2)  # both ranks forked, starting
        os.killpg(launcher.pid, signal.SIGINT)
        stopped(launcher)

    def kill_launcher(launcher):  # `kill`, to the launcher alone, while its ranks have just started
        when([launcher], lambda: len(launched_ranks(launcher)) >= 2)
        time.sleep(0.3)
        os.kill(launcher.pid, signal.SIGTERM)
        stopped(launcher)

    def trainer_raised(launcher):  # its lines come as printed (LIVE)
        when([launcher], lambda: "Training done for epoch 1 loss" in launcher.out)
        stopped(launcher)

    def by_hand(first, *later):
        """One terminal per rank, as a person starts them: rank 0, then the others once it listens."""
        def begin():
            ranks = [run(*first)]
            listening(ranks[0])
            return ranks + [run(*args) for args in later]
        return begin

    def kill_observer(ranks):  # the agent's lines come as printed (LIVE)
        when(ranks, lambda: "Episode 2\t" in ranks[0].out)
        os.kill(ranks[2].pid, signal.SIGKILL)
        runs["killed"] = time.monotonic()

    cases = [  # the longest first
        (2, case("rank 0 gives up", by_hand(  # rank 2 never comes
            ["rpc_rl_cartpole.py", "--world_size=3", "--rank=0", "--timeout", GIVE_UP, *give_up],
            ["rpc_rl_cartpole.py", "--world_size=3", "--rank=1", "--timeout", TIMEOUT, *give_up]))),
        (3, case(STOPS[0], lambda: run(*stopping), interrupt)),
        (3, case(STOPS[1], lambda: run(*stopping), kill_launcher)),
        (5, case(STOPS[2], lambda: run(raising, "--epochs", 100000, "--timeout", TIMEOUT, env=LIVE),
                 trainer_raised)),
        # one intra-op thread each: these runs share two cores and only need to be under way
        (3, case("an observer killed", lambda: [run(*cartpole, f"--rank={rank}", env={"OMP_NUM_THREADS": "1", **LIVE})
                                                for rank in range(3)], kill_observer)),
        (2, case("a peer lost in rpc.shutdown()", lambda: [
            run(lost, f"--rank={rank}", "--master_port", lost_port, "--timeout", LOST) for rank in (0, 1)])),
        (1, case("a listener that never answers", lambda: run(
            "rpc_rnn_model_parallel.py", "--rank=1", "--master_port", taken, "--timeout", LONE))),
        (1, case("a port in use", lambda: run(
            "rpc_rnn_model_parallel.py", "--rank=0", "--master_port", taken, "--timeout", TIMEOUT))),
        (1, case("an address that does not resolve", lambda: run(
            "rpc_rnn_model_parallel.py", "--rank=1", "--master_addr", "nosuch.host.invalid", "--master_port",
            free_port()))),
        (2, case("MNIST that cannot be downloaded", lambda: [
            run("rpc_parameter_server.py", "--world_size=2", f"--rank={rank}", "--master_port", no_mnist_port,
                "--data_dir", "mine", env=no_network, cwd=no_mnist) for rank in (0, 1)])),
        (1, case("a bad flag value", lambda: run("rpc_rnn_model_parallel.py", "--epochs=0"))),
        (2, case("an exception inside an RPC", lambda: [run(buggy, *common, f"--rank={rank}") for rank in (0, 1)])),
    ]
    if gpus <= 2:  # --num_gpus allows at most 2
        cases.append((3, case("a GPU that is not there", lambda: run(
            "rpc_parameter_server.py", "--world_size=2", f"--num_gpus={gpus}", "--master_port", free_port()))))
        cases.append((1, case("rank 0 fails before the ranks meet", lambda: run(
            "rpc_parameter_server.py", "--world_size=2", "--rank=0", f"--num_gpus={gpus}", "--master_port",
            free_port(), "--timeout", TIMEOUT))))
    try:
        side_by_side(cases)
        yield runs
    finally:
        holder.close()
        stop_all(started)


def test_a_listener_that_never_answers(failure_runs):
    # torch's own rendezvous waits forever on a listener that never answers.
    proc = failure_runs["a listener that never answers"]
    assert_one_line(proc, "Error on rank 1 (trainer): not all ranks met")
    assert proc.seconds < LONE_BOUND, proc


def test_a_port_in_use(failure_runs):
    # At once, in torch's words after ours, which name the port.
    proc = failure_runs["a port in use"]
    line = assert_one_line(proc, "Error on rank 0 (ps): ")
    assert str(failure_runs["taken"]) in line and proc.seconds < LONE_BOUND, proc


def test_an_address_that_does_not_resolve(failure_runs):
    # At once, with the address, not a traceback of the name lookup.
    proc = failure_runs["an address that does not resolve"]
    port = proc.proc.args[proc.proc.args.index("--master_port") + 1]
    assert_one_line(proc, f"Error on rank 1 (trainer): cannot reach rank 0 (ps) at nosuch.host.invalid:{port}")
    assert proc.seconds < LONE_BOUND, proc


def test_a_gpu_that_is_not_there(failure_runs):
    # The parameter server alone knows its GPUs: it says so at once, not after waiting for its trainer, and the
    # launcher names it. The trainer, still waiting to meet, may say that it cannot reach rank 0 before the launcher
    # stops it, with no line of torch's logger.
    proc = failure_runs.get("a GPU that is not there")
    if proc is None:
        pytest.skip("this host has 2 GPUs or more: --num_gpus allows at most 2")
    gpus = torch.cuda.device_count()
    lines = proc.err.strip().splitlines()
    assert proc.returncode == 1 and lines[-1] == "Rank 0 ended (exit code 1).", proc
    assert lines[0] == (f"Error on rank 0 (parameter_server): ValueError: --num_gpus {gpus + 1} is more GPUs "
                        f"than the parameter server has ({gpus})"), proc
    port = proc.proc.args[proc.proc.args.index("--master_port") + 1]
    lost = f"Error on rank 1 (trainer_1): cannot reach rank 0 (parameter_server) at localhost:{port}"
    assert lines[1:-1] in ([], [lost]) and proc.out == "" and proc.seconds < LONE_BOUND, proc


def test_mnist_that_cannot_be_downloaded(failure_runs):
    # No network (a proxy that refuses): the trainer says why and what to do, and removes the folders it made in
    # the user's --data_dir, never that folder; the parameter server, one terminal each, loses its trainer.
    server, trainer = failure_runs["MNIST that cannot be downloaded"]
    # The cause in brackets is torchvision's and the system's words, which vary by release and host.
    assert re.fullmatch(r"Error on rank 1 \(trainer_1\): RuntimeError: cannot download MNIST into mine \(.+\); "
                        r"give --data_dir a folder that holds MNIST/raw/", one_error_line(trainer)), trainer
    assert one_error_line(server) == "Error on rank 0 (parameter_server): cannot reach rank 1 (trainer_1)"
    assert list(trainer.cwd.iterdir()) == [trainer.cwd / "mine"] and not any((trainer.cwd / "mine").iterdir())


def test_a_rank_0_that_fails_before_the_ranks_meet_ends_at_once(failure_runs):
    # Rank 0, alone in its terminal, fails before any peer came: it says why and ends, long before its meeting's
    # 5 * --timeout; it does not wait for peers to tell them.
    proc = failure_runs.get("rank 0 fails before the ranks meet")
    if proc is None:
        pytest.skip("this host has 2 GPUs or more: --num_gpus allows at most 2")
    gpus = torch.cuda.device_count()
    cause = f"ValueError: --num_gpus {gpus + 1} is more GPUs than the parameter server has ({gpus})"
    assert one_error_line(proc) == f"Error on rank 0 (parameter_server): {cause}", proc
    assert proc.seconds < AT_ONCE, proc


def test_a_rank_whose_rank_0_gave_up_names_it(failure_runs):
    # Rank 0 gives up waiting for rank 2 while rank 1, started later, meets: rank 1 names rank 0 in a line of
    # ours, long before its own 5 * --timeout.
    agent, observer = failure_runs["rank 0 gives up"]
    port = agent.proc.args[agent.proc.args.index("--master_port") + 1]
    assert one_error_line(agent) == "Error on rank 0 (agent): not all ranks met", agent
    assert one_error_line(observer) == f"Error on rank 1 (obs1): cannot reach rank 0 (agent) at localhost:{port}"
    assert observer.ended - agent.ended < AT_ONCE, (agent, observer)


def test_a_bad_flag_value_stops_the_command_before_anything_starts(failure_runs):
    # The whole command as a user types it: refused by argparse, no rank started, no traceback.
    proc = failure_runs["a bad flag value"]
    assert proc.returncode == 2 and proc.out == "", proc
    assert proc.err.startswith("usage: ") and "Traceback" not in proc.err, proc
    assert proc.err.strip().splitlines()[-1].endswith("error: argument --epochs: 0 is not in [1, inf]"), proc


def test_an_exception_inside_an_rpc_names_its_rank_and_cause(failure_runs):
    ps, trainer = failure_runs["an exception inside an RPC"]
    # The innermost of torch's nested reports: the rank where it was raised, and the error.
    assert_one_line(trainer, "Error on rank 1 (trainer): rank 0 (ps): ValueError('decoder bug')")
    # Where the bug is, torch prints the remote traceback itself; the parameter server then loses its trainer.
    assert one_error_line(ps) == "Error on rank 0 (ps): cannot reach rank 1 (trainer)", ps


def test_a_killed_observer_is_named_by_rank_0(failure_runs):
    # The agent, rank 0, was waiting on the episodes: it names the killed observer. The other observer only waits,
    # checking on rank 0: it names rank 0 once that has stopped. Both are gone at once.
    agent, observer, _ = failure_runs["an observer killed"]
    port = agent.proc.args[agent.proc.args.index("--master_port") + 1]
    assert one_error_line(agent) == "Error on rank 0 (agent): cannot reach rank 2 (obs2)", agent
    assert one_error_line(observer) == f"Error on rank 1 (obs1): cannot reach rank 0 (agent) at localhost:{port}"
    for proc in (agent, observer):
        assert proc.ended - failure_runs["killed"] < AT_ONCE, proc


def test_ctrl_c_as_the_ranks_start_stops_every_rank(failure_runs):
    # The Ctrl-C ends the launcher and each rank at once, as it ends any program (the shell sees 130), or a rank
    # forked meanwhile by torch's parent-death signal: nothing is printed.
    launcher = failure_runs["Ctrl-C as the ranks start"]
    assert launcher.returncode == -signal.SIGINT and launcher.gone < AT_ONCE, launcher
    assert launcher.err == "", launcher


def test_kill_while_the_ranks_start_stops_every_rank(failure_runs):
    # The ranks end by torch's parent-death signal.
    launcher = failure_runs["kill while the ranks start"]
    assert launcher.returncode == -signal.SIGTERM and launcher.gone < AT_ONCE, launcher
    assert_no_traceback(launcher.err)


def test_a_trainer_that_raises_ends_the_ddp_run(failure_runs):
    # The master names the trainer and its error at once; trainer1, in an allreduce with the failed trainer, and
    # the others end as they lose the master; the launcher says which rank ended first.
    launcher = failure_runs["a trainer raises"]
    assert launcher.returncode == 1 and launcher.gone < AT_ONCE, launcher
    assert "Error on rank 2 (master): rank 0 (trainer0): ValueError('trainer bug')\n" in launcher.err, launcher
    # At most one line per rank: each that ends on its own within the launcher's grace says why.
    ranks = [line.split()[3] for line in error_lines(launcher)]
    assert len(ranks) == len(set(ranks)), launcher
    assert launcher.err.strip().splitlines()[-1] == "Rank 2 ended (exit code 1).", launcher


def test_a_peer_lost_in_rpc_shutdown_ends_the_other(failure_runs):
    # The trainer is killed once it has said that it is done, before its rpc.shutdown(): rank 0, waiting for it in
    # rpc.shutdown() (which alone would wait forever), ends on its own with one line, --timeout and 2 s later.
    ps, trainer = failure_runs["a peer lost in rpc.shutdown()"]
    assert trainer.returncode == -signal.SIGKILL, trainer
    assert one_error_line(ps) == "Error on rank 0 (ps): lost a peer in rpc.shutdown()", ps
    assert ps.ended - trainer.ended < LOST + AT_ONCE, (ps, trainer)
