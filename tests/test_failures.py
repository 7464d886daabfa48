"""How runs end when something goes wrong: one test per row of CONVENTIONS' "How a run ends"
table (the README's "If it hangs or fails"), and runs across machines. Each failure is provoked
for real: real processes, real signals, a really taken port, a listener that never answers.

The plumbing is the same text in all four scripts, so most cases run on the RNN example, the
quickest to start (two ranks, no torchvision); a killed peer is also tried on the parameter
server (an idle rank 0) and on the DDP example (a rank 0 whose work runs in RPC threads).

Time limits here only keep a hang from running forever, except where a case is about time
itself (a bounded wait, a survivor that stops at once): there the bound is far from what a
busy machine needs and far below what a broken script takes."""
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import NamedTuple

import pytest

from conftest import ROOT, Run, assert_no_traceback, free_port, tiny_mnist_flags

SCRIPT = "rpc_rnn_model_parallel.py"
TIMEOUT = 30  # --timeout for these runs: a killed peer is noticed at once, a busy machine is no failure
HANG = TIMEOUT + 60  # a test's own limit: far above what the scripts promise
AT_ONCE = TIMEOUT / 2  # "at once": well under --timeout, so a rank that only noticed at a timeout fails


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


def wait_gone(proc, since):
    """Wait until no process of the run is left; return the seconds from `since`."""
    while proc.processes_left() and time.monotonic() - since < HANG:
        time.sleep(0.05)
    assert proc.processes_left() == [], f"processes left running: {proc}"
    return time.monotonic() - since


class Kill(NamedTuple):
    script: str
    world_size: int
    started: str  # a line that shows training under way
    printer: int  # the rank that prints it
    victim: int  # the rank that is killed
    name: str  # its name
    mnist: bool = False  # whether the script reads the tiny MNIST


# A rank killed mid-run, one terminal per rank: the RNN's idle parameter server loses its trainer, the RNN
# trainer its parameter server (which hosts the store); the parameter server example's idle server loses its
# only trainer; DDP's trainer0 (rank 0, whose work runs in RPC threads) loses the master.
KILLS = [Kill(SCRIPT, 2, "Training epoch 1 loss", 1, 1, "trainer"),
         Kill(SCRIPT, 2, "Training epoch 1 loss", 1, 0, "ps"),
         Kill("rpc_parameter_server.py", 2, "training batch 2 ", 1, 1, "trainer_1", mnist=True),
         Kill("ddp_rpc_hybrid.py", 3, "Training done for epoch 1", 0, 1, "master")]


@pytest.fixture(scope="module")
def rank_runs(tmp_path_factory, tiny_mnist):
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
        "a peer that never arrives": run(SCRIPT, "--rank=1", "--master_port", free_port(), "--timeout", 2),
        "a listener that never answers": run(SCRIPT, "--rank=1", "--master_port", taken, "--timeout", 3),
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
                  "--epochs", 100000, *(tiny_mnist_flags(tiny_mnist) if case.mnist else [])]
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
        for proc in started:
            proc.wait(HANG)
        yield runs
    finally:
        holder.close()
        for proc in started:
            proc.kill()
            proc.proc.wait()


def test_a_peer_that_never_arrives_or_never_answers(rank_runs):
    # torch's own rendezvous waits 30 minutes for a missing rank, and forever on a listener that never answers.
    for case, timeout in (("a peer that never arrives", 2), ("a listener that never answers", 3)):
        proc = rank_runs[case]
        assert_one_line(proc, "Error on rank 1 (trainer): not all 2 ranks met at localhost:",
                        f"within --timeout {timeout} s", "--master_port")
        assert ended_at(proc) - proc.started < timeout + AT_ONCE, proc


def test_a_port_in_use(rank_runs):
    assert_one_line(rank_runs["a port in use"], "Error on rank 0 (ps): ", f"port: {rank_runs['taken']}",
                    "address already in use")


def test_an_exception_inside_an_rpc_names_its_rank_and_cause(rank_runs):
    ps, trainer = rank_runs["an exception inside an RPC"]
    assert_one_line(trainer, "Error on rank 1 (trainer): an RPC that ran on rank 0 (ps) raised "
                    "RuntimeError('mat1 and mat2 shapes cannot be multiplied")
    # Where the bug is, torch prints the remote traceback itself; the parameter server then loses its trainer.
    assert ps.returncode == 1, ps
    assert "On WorkerInfo(id=0, name=ps):\nRuntimeError('mat1 and mat2 shapes cannot be multiplied" in ps.err, ps
    assert re.search(r"line \d+, in forward\n +return self.decoder\(", ps.err), ps
    assert error_lines(ps) == ["Error on rank 0 (ps): lost contact with rank 1 (trainer); see its output."], ps


def test_a_rank_killed_mid_run_stops_the_other_ranks(rank_runs):
    # One terminal per rank: each survivor stops by itself, at once, with one line.
    for case, ranks, killed in rank_runs["kills"]:
        assert killed is not None, f"{case.script}: never under way"
        for rank, proc in enumerate(ranks):
            assert ended_at(proc) - killed < AT_ONCE, f"{case}: not at once: {proc}"
            if rank == case.victim:
                continue
            line = assert_one_line(proc, f"Error on rank {rank} ")
            # It names the lost rank, or (torch says only "end of file") says that a peer's process ended.
            assert f"lost contact with rank {case.victim} ({case.name})" in line or "a peer's process ended" in line \
                or f"rank {case.victim} ({case.name})" in line, f"{case}: {proc}"
        if case.victim == 1 and case.world_size == 2:  # an idle rank 0 knows which peer it lost
            assert "lost contact with rank 1" in error_lines(ranks[0])[0], ranks[0]


STOPS = ("a rank killed", "Ctrl-C while starting", "SIGTERM to the launcher", "SIGKILL to the launcher while starting")


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
        for launcher in runs.values():
            launcher.wait(HANG)
            launcher.gone = wait_gone(launcher, launcher.stopped)
        yield runs
    finally:
        for proc in runs.values():
            proc.kill()
            proc.proc.wait()


def test_a_rank_killed_in_a_one_command_run(launcher_runs):
    launcher = launcher_runs["a rank killed"]
    assert len(launcher.ranks) == 2, launcher
    assert launcher.returncode == 1 and launcher.gone < AT_ONCE, launcher
    assert_no_traceback(launcher.err)
    # The parameter server says what it lost, then the launcher says which rank ended and that it stopped the rest.
    assert error_lines(launcher) == ["Error on rank 0 (ps): lost contact with rank 1 (trainer); see its output."], launcher
    assert launcher.err.strip().splitlines()[-1] == "Rank 1 (trainer) ended with SIGKILL: stopped every rank."


def test_stopping_a_one_command_run_stops_every_rank(launcher_runs):
    # Ctrl-C while the ranks still load torch: they get it too, and end without a traceback.
    for how in ("Ctrl-C while starting", "SIGTERM to the launcher"):
        launcher = launcher_runs[how]
        assert launcher.returncode == 130 and launcher.gone < AT_ONCE, f"{how}: {launcher}"
        assert_no_traceback(launcher.err)
        assert launcher.err.strip().splitlines()[-1] == "Interrupted: stopping every rank.", f"{how}: {launcher}"
        assert error_lines(launcher) == [], f"{how}: {launcher}"  # the ranks were stopped, not lost
    # SIGKILL while the ranks load torch, before torch.multiprocessing arms their parent-death signal: each rank
    # sees at its start that the launcher is gone (later, that signal ends them).
    launcher = launcher_runs["SIGKILL to the launcher while starting"]
    assert launcher.returncode == -signal.SIGKILL and launcher.gone < AT_ONCE, launcher


def test_torchrun_sets_the_ranks(shared_runs):
    # torchrun hosts its own store at MASTER_PORT; the script joins it, and runs one rank per process.
    proc = shared_runs["rnn torchrun"]
    assert proc.returncode == 0, proc
    assert_no_traceback(proc.err)
    assert proc.out.count("Summary:") == 1 and "Summary: epochs=2 " in proc.out, proc
    assert "Starting " not in proc.out, proc


@pytest.fixture
def two_hosts():
    """Two network namespaces joined by a veth pair: two hosts with their own addresses."""
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("needs root and iproute2 to create network namespaces")
    tag = uuid.uuid4().hex[:6]
    hosts = [f"rpc{tag}a", f"rpc{tag}b"]
    subnet = f"10.{200 + int(tag[:2], 16) % 50}.{int(tag[2:4], 16)}"
    commands = [
        ["ip", "netns", "add", hosts[0]], ["ip", "netns", "add", hosts[1]],
        ["ip", "link", "add", f"v{tag}a", "type", "veth", "peer", "name", f"v{tag}b"],
    ]
    for i, host in enumerate(hosts):
        dev = f"v{tag}{'ab'[i]}"
        commands += [["ip", "link", "set", dev, "netns", host],
                     ["ip", "-n", host, "addr", "add", f"{subnet}.{i + 1}/24", "dev", dev],
                     ["ip", "-n", host, "link", "set", dev, "up"],
                     ["ip", "-n", host, "link", "set", "lo", "up"]]
    try:
        for command in commands:
            if subprocess.run(command, capture_output=True).returncode != 0:
                pytest.skip(f"cannot create network namespaces here ({' '.join(command)} failed)")
        yield hosts, [f"{subnet}.1", f"{subnet}.2"]
    finally:
        for host in hosts:
            subprocess.run(["ip", "netns", "del", host], capture_output=True)


def test_two_machines_pick_the_interface_that_reaches_the_master(run, two_hosts, tiny_mnist):
    # Here, as on many cloud images, the hostname resolves to 127.0.0.1; without the right interface Gloo
    # and TensorPipe tell the peer to connect to 127.0.0.1 and fail. DDP at the tutorial's world size 4 with
    # trainer 1 on host B and the other ranks on A, and the parameter server example with its trainer on B,
    # with --master_addr only: RPC and DDP's group each go over the interface that reaches the master.
    (host_a, host_b), (addr_a, _) = two_hosts
    common = ["--master_addr", addr_a, "--timeout", 60]
    ddp_port, ps_port = free_port(), free_port()
    ddp = [run("ddp_rpc_hybrid.py", "--world_size=4", *common, "--master_port", ddp_port, "--epochs", 2,
               f"--rank={rank}", netns=host_b if rank == 1 else host_a) for rank in range(4)]
    ps = [run("rpc_parameter_server.py", "--world_size=2", *common, "--master_port", ps_port, "--epochs=1",
              *tiny_mnist_flags(tiny_mnist), f"--rank={rank}", netns=host_b if rank == 1 else host_a)
          for rank in range(2)]
    for proc in ddp + ps:
        proc.wait(HANG)
        assert proc.returncode == 0, proc
    veth = re.escape(f"v{host_a[3:9]}")
    for ranks in (ddp, ps):
        for rank, proc in enumerate(ranks):
            side = "b" if rank == 1 else "a"
            assert re.search(rf"^Rank {rank}: using network interface {veth}{side} to reach {re.escape(addr_a)}$",
                             proc.out, re.M), proc
    assert re.search(r"^Summary: .*fc_in_sync=true$", ddp[2].out, re.M), ddp[2]
    assert re.search(r"^Summary: rank=1 .* accuracy=", ps[1].out, re.M), ps[1]
