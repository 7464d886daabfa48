"""How runs end when something goes wrong: the cases of the README's "If it hangs or fails" and of
docs/design.md's fault table, each provoked for real: real processes, real signals, a really taken
port, a listener that never answers.

The plumbing is the same text in all four scripts, so these cases run on the RNN example, the
quickest to start (two ranks, no torchvision).

Time limits here tell "bounded" from "hangs", each at least three times the slowest seen while the
whole suite runs on two cores; "at once" is also well under --timeout, so that a rank that only
noticed at its timeout fails."""
import os
import re
import signal
import socket
import threading
import time
from pathlib import Path
from typing import NamedTuple

import pytest

from conftest import ROOT, Run, assert_no_traceback, free_port, stop_all, wait_all

SCRIPT = "rpc_rnn_model_parallel.py"
TIMEOUT = 60  # --timeout of the runs that are killed: a killed peer is noticed at once, a busy machine is no failure
HANG = TIMEOUT + 60  # a test's own limit: far above what the scripts promise
# Bounds, each at least three times the slowest seen while the whole suite ran on 2 cores, and above the slowest
# seen beside a second copy of the suite: a survivor of a killed peer, or a one-command run stopped under way, is
# gone within AT_ONCE (seen: 2.2 s; beside: 3.3 s); a lone rank within LONE_BOUND of its start, torch's import
# and its 5 * LONE s wait included (10.8 s; 20.7 s); a one-command run stopped while its ranks load torch within
# STARTING, each rank ending once loaded (10.4 s; 19.8 s).
AT_ONCE = 20
LONE = 1  # --timeout of the runs whose peers never come: they wait 5 s to meet
LONE_BOUND = 5 * LONE + 40
STARTING = 60


def error_lines(proc):
    return re.findall(r"^Error on rank .*$", proc.err, re.M)


def assert_one_line(proc, *phrases, code=1):
    """Exit status `code`, no traceback, and exactly one error line, naming the problem."""
    assert proc.returncode == code, proc
    assert_no_traceback(proc.err)
    lines = error_lines(proc)
    assert len(lines) == 1, proc
    for phrase in phrases:
        assert phrase in lines[0], proc
    return lines[0]


def note_ends(*procs):
    """Note when each run ends, as it ends (Run.ended is when the test got round to waiting for it)."""
    def poll():
        while not all(hasattr(proc, "exited_at") for proc in procs):
            for proc in procs:
                if not hasattr(proc, "exited_at") and proc.proc.poll() is not None:
                    proc.exited_at = time.monotonic()
            time.sleep(0.05)

    threading.Thread(target=poll, daemon=True).start()


def ended_at(proc):
    proc.wait(HANG)
    while not hasattr(proc, "exited_at"):  # note_ends sees it within 50 ms
        time.sleep(0.01)
    return proc.exited_at


def act_when_ready(*cases):
    """cases: (run, line, action). Call each action as soon as its run has printed a line holding that text
    (or, where `line` is a function, once it returns true), so that no run trains on, taking the machine's
    cores, while another is being waited for."""
    pending, deadline = list(cases), time.monotonic() + HANG
    while pending:
        for case in list(pending):
            proc, line, action = case
            if line(proc) if callable(line) else line in proc.out:
                pending.remove(case)
                action()
            else:
                assert proc.proc.poll() is None and time.monotonic() < deadline, f"never ready ({line}): {proc}"
        time.sleep(0.05)


def started_at(pid):
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])


def launched_ranks(launcher):
    """The rank processes a one-command run started, by rank: torch.multiprocessing starts them in rank order."""
    children = [proc for proc in launcher.processes_left(children_only=True)
                if b"multiprocessing.spawn" in Path(f"/proc/{proc}/cmdline").read_bytes()]
    return sorted(children, key=started_at)


def wait_gone(proc, since, limit=HANG):
    """Seconds from `since` until no process of the run was left; infinite if some still were after `limit`."""
    while proc.processes_left():
        if time.monotonic() - since > limit:
            return float("inf")
        time.sleep(0.05)
    return time.monotonic() - since


class Kill(NamedTuple):
    script: str
    world_size: int
    started: str  # a line that shows training under way
    printer: int  # the rank that prints it
    victim: int  # the rank that is killed
    lines: dict  # rank: what its one line says


# A rank killed mid-run, one terminal per rank (every role of the four scripts: tests/test_several_machines.py).
# The RNN trainer loses its parameter server (which hosts the store) under an RPC or between two.
KILLS = [Kill(SCRIPT, 2, "Training epoch 1 loss", 1, 0, {1: "Error on rank 1 (trainer): "})]


@pytest.fixture(scope="module")
def rank_runs(tmp_path_factory):
    """The failure cases of runs started one terminal per rank (--rank), started side by side to save time
    and all ended before any test reads them; each is checked on its own. A dict by case name of runs, or
    of a run's ranks; "kills" holds [case, ranks, when the victim was killed] for each of KILLS."""
    started = []

    def run(script, *args):  # one intra-op thread each: these runs share two cores and only need to be under way
        started.append(Run(script, args, cwd=tmp_path_factory.mktemp("rank"), env={"OMP_NUM_THREADS": "1"}))
        return started[-1]

    holder = socket.socket()  # a plain program that listens on a port and never answers
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    taken = holder.getsockname()[1]
    runs = {
        "taken": taken,
        "a lone rank 1": run(SCRIPT, "--rank=1", "--master_port", free_port(), "--timeout", LONE),
        "a listener that never answers": run(SCRIPT, "--rank=1", "--master_port", taken, "--timeout", LONE),
        "a port in use": run(SCRIPT, "--rank=0", "--master_port", taken, "--timeout", TIMEOUT),
    }
    # A bug in code that runs on another rank, as in a copy of the script someone changed: the decoder,
    # built on the parameter server, takes one input more than the trainer's LSTM gives it.
    buggy = tmp_path_factory.mktemp("buggy") / SCRIPT
    buggy.write_text((ROOT / SCRIPT).read_text().replace("nn.Linear(nhid, ntoken)", "nn.Linear(nhid + 1, ntoken)", 1))
    assert "nhid + 1" in buggy.read_text()
    common = ["--master_port", free_port(), "--timeout", TIMEOUT]
    runs["an exception inside an RPC"] = [run(buggy, *common, f"--rank={rank}") for rank in (0, 1)]
    runs["kills"] = []
    for case in KILLS:
        common = [f"--world_size={case.world_size}", "--master_port", free_port(), "--timeout", TIMEOUT,
                  "--epochs", 100000]
        runs["kills"].append([case, [run(case.script, *common, f"--rank={rank}") for rank in range(case.world_size)],
                              None])
    note_ends(*started)

    def kill(each):
        case, ranks, _ = each
        os.kill(ranks[case.victim].pid, signal.SIGKILL)
        each[2] = time.monotonic()

    try:
        act_when_ready(*[(ranks[case.printer], case.started, lambda each=each: kill(each))
                         for each in runs["kills"] for case, ranks, _ in [each]])
        wait_all(started, HANG)
        yield runs
    finally:
        holder.close()
        stop_all(started)


def test_a_peer_that_never_arrives_or_never_answers(rank_runs):
    # torch's own rendezvous waits 30 minutes for a missing rank, and forever on a listener that never answers.
    for case, rank, name in (("a lone rank 1", 1, "trainer"), ("a listener that never answers", 1, "trainer")):
        proc = rank_runs[case]
        assert_one_line(proc, f"Error on rank {rank} ({name}): not all 2 ranks met at port ",
                        "(check --world_size)")
        assert ended_at(proc) - proc.started < LONE_BOUND, f"{case}: {proc}"


def test_a_port_in_use(rank_runs):
    # The port comes first, not the ranks that did not meet.
    assert_one_line(rank_runs["a port in use"], f"Error on rank 0 (ps): port {rank_runs['taken']} is in use")


def test_an_exception_inside_an_rpc_names_its_rank_and_cause(rank_runs):
    ps, trainer = rank_runs["an exception inside an RPC"]
    assert_one_line(trainer, "Error on rank 1 (trainer): RuntimeError: On WorkerInfo(id=0, name=ps): "
                    "RuntimeError('mat1 and mat2 shapes cannot be multiplied")
    # Where the bug is, torch prints the remote traceback itself; the parameter server then loses its trainer.
    assert ps.returncode == 1, ps
    assert "On WorkerInfo(id=0, name=ps):\nRuntimeError('mat1 and mat2 shapes cannot be multiplied" in ps.err, ps
    assert re.search(r"line \d+, in forward\n +return self.decoder\(", ps.err), ps
    assert error_lines(ps) == ["Error on rank 0 (ps): lost contact with rank 1"], ps


def test_a_rank_killed_mid_run_stops_the_other_ranks(rank_runs):
    # One terminal per rank: each survivor stops by itself, at once, with one line that says what it lost.
    for case, ranks, killed in rank_runs["kills"]:
        assert killed is not None, f"{case.script}: never under way"
        for rank, proc in enumerate(ranks):
            assert ended_at(proc) - killed < AT_ONCE, f"{case}: not at once: {proc}"
            if rank != case.victim:
                assert_one_line(proc, f"Error on rank {rank} ", case.lines.get(rank, ""))


STOPS = ("a rank killed", "Ctrl-C while starting", "SIGTERM to the launcher")


@pytest.fixture(scope="module")
def launcher_runs(tmp_path_factory):
    """One-command RNN runs that fail or are stopped, started side by side; every process of each is gone
    before any test reads them. A dict by case of STOPS; each run has .stopped (when the test acted)
    and .gone (seconds from then until no process of the run was left)."""
    runs = {how: Run(SCRIPT, ["--epochs", 100000, "--timeout", TIMEOUT], cwd=tmp_path_factory.mktemp("launcher"),
                     env={"OMP_NUM_THREADS": "1"}) for how in STOPS}

    def stop(how):
        launcher = runs[how]
        if how == "a rank killed":
            launcher.ranks = launched_ranks(launcher)
            os.kill(launcher.ranks[1], signal.SIGKILL)
        elif how.startswith("Ctrl-C"):
            os.killpg(launcher.pid, signal.SIGINT)  # the terminal sends it to the whole foreground group
        else:
            os.kill(launcher.pid, signal.SIGTERM if how.startswith("SIGTERM") else signal.SIGKILL)
        launcher.stopped = time.monotonic()

    try:
        # "While starting": both rank processes exist and are loading torch.
        act_when_ready(*[(runs[how], (lambda run: len(launched_ranks(run)) == 2) if how.endswith("starting")
                          else "Training epoch 1 loss", lambda how=how: stop(how)) for how in STOPS])
        for how, launcher in runs.items():
            launcher.wait(HANG)
            launcher.gone = wait_gone(launcher, launcher.stopped)
        yield runs
    finally:
        stop_all(runs.values())


def test_a_rank_killed_in_a_one_command_run(launcher_runs):
    launcher = launcher_runs["a rank killed"]
    assert len(launcher.ranks) == 2, launcher
    assert launcher.returncode == 1 and launcher.gone < AT_ONCE, launcher
    assert_no_traceback(launcher.err)
    # The launcher's line, without torch's own "Terminating process ... via signal SIGTERM" before it.
    assert launcher.err.strip().splitlines()[-1] == "process 1 terminated with signal SIGKILL: stopped every rank."
    assert "Terminating process" not in launcher.err, launcher


def test_ctrl_c_while_starting_stops_every_rank(launcher_runs):
    # The ranks still load torch: the launcher stops them, and says so.
    launcher = launcher_runs["Ctrl-C while starting"]
    assert launcher.returncode == 1 and launcher.gone < STARTING, launcher
    assert_no_traceback(launcher.err)
    assert launcher.err.strip().splitlines()[-1] == "Interrupted: stopped every rank.", launcher
    assert error_lines(launcher) == [], launcher  # the ranks were stopped, not lost


def test_kill_stops_every_rank(launcher_runs):
    # `kill` ends the launcher; torch.multiprocessing's parent-death signal ends its ranks.
    launcher = launcher_runs["SIGTERM to the launcher"]
    assert launcher.returncode == -signal.SIGTERM and launcher.gone < AT_ONCE, launcher
    assert_no_traceback(launcher.err)
