"""How runs end when something goes wrong (README, "How a run ends, and troubleshooting"),
and runs across launchers and machines. Each failure is provoked for real:
real processes, real signals, a really taken port, a listener that never answers.

The plumbing that handles all of this is the same text in all four scripts
(tests/test_plumbing.py), so most cases run on the RNN example, the quickest to
start (two ranks, no torchvision); a killed peer is tried on every script.

Time limits here only keep a hang from running forever, except where a case is
about time itself (a bounded wait, a survivor that stops at once): there the
bound is far from what a busy machine needs and far below what a broken script takes."""
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist

import rpc_rnn_model_parallel as rnn_script
from conftest import ROOT, Run, assert_no_traceback, free_port, tiny_mnist_flags

SCRIPT = "rpc_rnn_model_parallel.py"
TIMEOUT = 30  # --timeout for these runs: a killed peer is noticed at once, a busy machine is no failure
HANG = TIMEOUT + 30  # a test's own limit: far above what the scripts promise
NEVER_RPC = 3  # --timeout for a rank whose peer meets, then never starts RPC: room for this process to join it
AT_ONCE = TIMEOUT / 2  # "at once": well under --timeout, so a rank that only noticed at a timeout fails
GPUS = torch.cuda.device_count()


@pytest.fixture
def run(run):
    """conftest's run, with one intra-op thread per process: these runs share two cores and only need to
    be under way, and idle OpenMP threads that spin would slow every other run."""
    return lambda *args, env=None, **kwargs: run(*args, env={"OMP_NUM_THREADS": "1", **(env or {})}, **kwargs)


def assert_quiet(proc):
    """No traceback, no C++ frames, no torch log line about stopping processes."""
    assert_no_traceback(proc.err)
    assert "Terminating process" not in proc.err, proc


def assert_one_paragraph(proc, *phrases, code=1):
    """Exit status `code`; stderr short and quiet, with the script's own paragraph last, naming the problem."""
    assert proc.returncode == code, proc
    assert_quiet(proc)
    err = proc.err.strip()
    assert len(err.splitlines()) <= 10, proc
    paragraph = err.split("\n\n")[-1]
    assert paragraph.startswith("Error on rank ") and "(Run with --debug" in paragraph, proc
    for phrase in phrases:
        assert phrase in paragraph, proc


def assert_lost(proc, victim, name):
    """The paragraph of a rank that lost `victim` (a rank that stopped because of that loss may be named too)."""
    assert_one_paragraph(proc)
    assert re.search(rf"^Error on rank \d+ \(\w+\): lost contact with [^:]*rank {victim} \({name}\)",
                     proc.err, re.M), proc


def note_err(proc, text):
    """Note, as it happens, when stderr first holds text (in proc.err_noted_at)."""
    def poll():
        deadline = time.monotonic() + HANG
        while text not in proc.err and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.err_noted_at = time.monotonic()

    threading.Thread(target=poll, daemon=True).start()


def wait_gone(proc, since):
    """Wait until no process of the run is left (ranks of a killed launcher stop by themselves)."""
    while proc.processes_left() and time.monotonic() - since < HANG:
        time.sleep(0.1)
    assert proc.processes_left() == [], f"ranks left running: {proc}"
    for reader in proc._readers:  # every rank has closed the pipes: all its output is in
        reader.join(5)


def listen_port(proc):
    return int(re.search(r"^Starting \d ranks; rank 0 listens on localhost:(\d+)$", proc.out, re.M).group(1))


def rank_pids(port, world_size):
    """Each rank's process id, as the rank itself wrote it in the store where the ranks met."""
    store = dist.TCPStore("localhost", port, is_master=False, timeout=timedelta(seconds=HANG))
    return [int(store.get(f"pid{rank}")) for rank in range(world_size)]


def fork_server_loaded_torch(launcher):
    """Whether the launcher's fork server (its child running multiprocessing.forkserver) has torch loaded."""
    for entry in Path("/proc").iterdir():
        try:
            if (int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == launcher.pid
                    and b"forkserver" in (entry / "cmdline").read_bytes()):
                return "/libtorch_cpu.so" in (entry / "maps").read_text()
        except (OSError, IndexError, ValueError):
            continue
    raise AssertionError(f"no fork server under launcher {launcher.pid}")


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
    """cases: (run, line, action). Call each action as soon as its run has printed a line holding that text,
    so that no run trains on, taking the machine's cores, while another is being waited for."""
    pending, deadline = list(cases), time.monotonic() + HANG
    while pending:
        for case in list(pending):
            proc, text, action = case
            if text in proc.out:
                pending.remove(case)
                action()
            else:
                assert proc.proc.poll() is None and time.monotonic() < deadline, f"never printed {text!r}: {proc}"
        time.sleep(0.05)


def fake_rank(port, rank, script_args):
    """This test process as one rank of a group at the meeting: it claims `rank` and gives its flags."""
    store = dist.TCPStore("localhost", port, is_master=False, timeout=timedelta(seconds=HANG))
    flags = {key: value for key, value in vars(rnn_script.parse_args(script_args)).items()
             if key not in rnn_script.RANK_OWN_FLAGS}
    store.add(f"rank{rank}", 1)
    store.set(f"flags{rank}", json.dumps(flags))
    store.set(f"compared{rank}", "1")  # as a rank does once it has read every rank's flags
    return store


class Kill(NamedTuple):
    script: str
    flags: list
    started: str  # a line that shows training under way
    printer: int  # the rank that prints it
    victim: int  # the rank that is stopped
    name: str  # its name
    signal: int = signal.SIGKILL


@pytest.fixture(scope="module")
def rank_runs(tmp_path_factory, tiny_mnist):
    """The failure cases of runs started one terminal per rank (--rank), started side by side to save time
    and all ended before any test reads them; each is checked on its own. Where a case needs a peer, this
    test process plays it on the store, so that only the rank under test starts. A dict by case name of
    runs, or of a run's ranks; "kills" holds (case, ranks, when the victim was stopped)."""
    started = []

    def run(script, *args):  # one intra-op thread each: these runs share two cores and only need to be under way
        started.append(Run(script, args, cwd=tmp_path_factory.mktemp("rank"), env={"OMP_NUM_THREADS": "1"}))
        return started[-1]

    never, disagree, flags, fake = free_port(), free_port(), free_port(), free_port()
    holder = socket.socket()  # a plain program that listens and never answers
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    taken = holder.getsockname()[1]
    rnn = ["--world_size=2", "--timeout", TIMEOUT]
    runs = {
        "ports": (never, taken),
        "a peer that never arrives": run(SCRIPT, "--world_size=2", "--rank=1", "--master_port", never, "--timeout", 2),
        "a listener that never answers": run(SCRIPT, "--world_size=2", "--rank=1", "--master_port", taken, "--timeout", 3),
        "a taken port": run(SCRIPT, *rnn, "--rank=0", "--master_port", taken),
        "a missing interface": run(SCRIPT, *rnn, "--rank=0", "--ifname", "eth9"),
        # Rank 0 with --epochs 2; this process joins as a rank 1 with --epochs 3.
        "flags that differ": run(SCRIPT, *rnn, "--rank=0", "--master_port", flags, "--epochs", 2),
        # A peer that meets on the store, then never starts RPC (as one that dies in init_rpc).
        "a peer that never starts RPC": run(SCRIPT, "--world_size=2", "--rank=0", "--master_port", fake,
                                            "--timeout", NEVER_RPC),
    }
    # A rank 1 that says world size 3, where this process serves as a rank 0 that said 2.
    rank0 = dist.TCPStore("localhost", disagree, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=HANG))
    rank0.set("world_size", "2")
    runs["world size 3"] = run("rpc_rl_cartpole.py", "--world_size=3", "--rank=1", "--master_port", disagree,
                               "--timeout", TIMEOUT)
    # A bug in code that runs on another rank, as in a copy of the script someone changed: the decoder,
    # built on the parameter server, takes one input more than the trainer's LSTM gives it.
    buggy = tmp_path_factory.mktemp("buggy") / SCRIPT
    buggy.write_text((ROOT / SCRIPT).read_text().replace("nn.Linear(nhid, ntoken)", "nn.Linear(nhid + 1, ntoken)", 1))
    assert "nhid + 1" in buggy.read_text()
    common = ["--world_size=2", "--master_port", free_port(), "--timeout", TIMEOUT]
    runs["an exception inside an RPC"] = [run(buggy, *common, f"--rank={rank}") for rank in (0, 1)]
    # A rank killed mid-run: the parameter server loses its trainer (the rank that drives), the RNN trainer
    # its parameter server (a rank that only serves, and hosts the store), DDP's master and parameter server
    # a trainer (whose DDP group dies with it); and Ctrl-C stops the DDP master, which waits inside torch
    # (Future.wait) for the whole training. DDP at world size 3: trainer 0, the master, the parameter server.
    kills = [Kill("rpc_parameter_server.py", tiny_mnist_flags(tiny_mnist), "training batch", 1, 1, "trainer_1"),
             Kill(SCRIPT, [], "Training epoch 0 loss", 1, 0, "ps"),
             Kill("ddp_rpc_hybrid.py", [], "Training done for epoch 0", 0, 0, "trainer0"),
             Kill("ddp_rpc_hybrid.py", [], "Training done for epoch 0", 0, 1, "master", signal.SIGINT)]
    runs["kills"] = []
    for case in kills:
        world_size = 3 if case.script == "ddp_rpc_hybrid.py" else 2
        common = [f"--world_size={world_size}", "--master_port", free_port(), "--timeout", TIMEOUT, "--epochs", 100000]
        runs["kills"].append([case, [run(case.script, *common, *case.flags, f"--rank={rank}")
                                     for rank in range(world_size)], None])
    note_ends(*started)

    def join(name, port, script_args):
        fake_rank(port, 1, ["--world_size=2", "--rank=1", "--master_port", str(port), *script_args])
        runs[name].met = time.monotonic()

    def stop(kill):
        case, ranks, _ = kill
        os.kill(ranks[case.victim].pid, case.signal)
        kill[2] = time.monotonic()

    try:
        act_when_ready(  # each says it waits once it listens
            (runs["flags that differ"], "Rank 0: waiting", lambda: join(
                "flags that differ", flags, ["--timeout", str(TIMEOUT), "--epochs", "3"])),
            (runs["a peer that never starts RPC"], "Rank 0: waiting", lambda: join(
                "a peer that never starts RPC", fake, ["--timeout", str(NEVER_RPC)])),
            (runs["a listener that never answers"], "Rank 1: waiting", lambda: setattr(
                runs["a listener that never answers"], "met", time.monotonic())),
            *[(ranks[case.printer], case.started, lambda kill=kill: stop(kill))
              for kill in runs["kills"] for case, ranks, _ in [kill]])
        for proc in started:
            proc.wait(HANG)
        yield runs
    finally:
        holder.close()
        for proc in started:
            proc.kill()
            proc.proc.wait()


def test_failures_before_the_group_meets(rank_runs):
    runs, (never, taken) = rank_runs, rank_runs["ports"]
    assert f"Rank 1: waiting up to 2 s for all 2 processes to meet at localhost:{never}" in runs["a peer that never arrives"].out
    assert_one_paragraph(runs["a peer that never arrives"], "Error on rank 1 (trainer)", "waited 2 s for rank 0",
                         f"localhost:{never}", "no rank 0 answered")
    # Before, the store client waited as long as the listener lived.
    listener = runs["a listener that never answers"]
    assert_one_paragraph(listener, f"waited 3 s for rank 0 at localhost:{taken}", "no other program listens there")
    assert ended_at(listener) - listener.met < 3 + AT_ONCE, listener
    assert_one_paragraph(runs["a taken port"], f"port {taken}", "already in use", "--master_port")
    assert "waiting up to" not in runs["a taken port"].out, runs["a taken port"]  # it never waited
    names = ", ".join(name for _, name in socket.if_nameindex())
    assert_one_paragraph(runs["a missing interface"], "no network interface --ifname eth9",
                         f"this machine has {names}.")
    assert_one_paragraph(runs["flags that differ"], "different flags: rank 1 has --epochs 3, rank 0 --epochs 2")
    # init_rpc alone would wait for that peer for days.
    never_rpc = runs["a peer that never starts RPC"]
    assert_one_paragraph(never_rpc, "all 2 processes met", f"RPC did not start within {NEVER_RPC} s", "firewall")
    assert ended_at(never_rpc) - never_rpc.met < NEVER_RPC + AT_ONCE, never_rpc
    assert_one_paragraph(runs["world size 3"], "Error on rank 1 (obs1)", "its --world_size is 2 (this rank's: 3)")


def test_address_errors_name_the_flag(monkeypatch):
    # The check behind the paragraph, in this process: it runs before torch.distributed is touched.
    args = rnn_script.parse_args(["--rank=1", "--master_addr", "no-such-host.invalid"])
    with pytest.raises(rnn_script.RankFailure, match=r"^--master_addr no-such-host.invalid does not resolve .*fix "
                                                     r"--master_addr"):
        rnn_script._pick_interface(1, args)


def test_no_download_leaves_no_folder_behind(tmp_path):
    import rpc_parameter_server as ps

    args = ps.parse_args(["--rank=1", "--no-download", "--data_dir", str(tmp_path / "data")])
    with pytest.raises(ps.RankFailure, match="--no-download forbids fetching it"):
        ps.load_mnist(args, rank=1)
    assert not (tmp_path / "data").exists()


def test_an_exception_inside_an_rpc_names_its_rank_and_cause(rank_runs):
    ps, trainer = rank_runs["an exception inside an RPC"]
    assert_one_paragraph(trainer, "Error on rank 1 (trainer): an RPC that ran on rank 0 (ps) raised "
                         "RuntimeError('mat1 and mat2 shapes cannot be multiplied", "Its traceback is in rank 0's output")
    # Where the bug is, torch prints the remote traceback; the parameter server then loses its trainer.
    assert ps.returncode == 1, ps
    assert "On WorkerInfo(id=0, name=ps):\nRuntimeError('mat1 and mat2 shapes cannot be multiplied" in ps.err, ps
    assert re.search(r"line \d+, in forward\n +return self.decoder\(", ps.err), ps
    assert re.search(r"\n\nError on rank 0 \(ps\): lost contact with rank 1 \(trainer\)[^\n]*\n\(Run with --debug[^\n]*$",
                     ps.err.strip()), ps


def test_a_rank_killed_mid_run_stops_the_other_ranks(rank_runs):
    # One terminal per rank: each survivor must stop by itself, at once.
    for case, ranks, stopped in rank_runs["kills"]:
        assert stopped is not None, f"{case.script}: never under way"
        for rank, proc in enumerate(ranks):
            assert ended_at(proc) - stopped < AT_ONCE, f"{case.script}: not at once: {proc}"
            if rank != case.victim:
                assert_lost(proc, case.victim, case.name)
    master = rank_runs["kills"][3][1][1]
    assert master.returncode == 130 and master.err.strip().split("\n\n")[-1] == "Error on rank 1 (master): interrupted."
    assert_quiet(master)



STOPS = ("Ctrl-C, twice", "SIGTERM to the launcher", "SIGKILL to the launcher", "SIGTERM while starting",
         "SIGKILL while starting")


@pytest.fixture(scope="module")
def launcher_runs(tmp_path_factory, tiny_mnist):
    """One-command runs that fail or are stopped, started side by side to save time; every process of each is
    gone before any test reads them. A dict by case: "obs2 killed", "no GPU" (None on a GPU host, where
    --num_gpus=1 is tests/test_gpu.py's success case) and each of STOPS; each run has .stopped (when the test
    acted, or its rank failed)."""
    started = []

    def run(script, *args):  # one intra-op thread each: these runs share two cores and only need to be under way
        started.append(Run(script, args, cwd=tmp_path_factory.mktemp("launcher"), env={"OMP_NUM_THREADS": "1"}))
        return started[-1]

    # An RL observer dies while the agent and the other observer still play (world size 3).
    runs = {"obs2 killed": run("rpc_rl_cartpole.py", "--world_size=3", "--timeout", TIMEOUT, "--log_interval=1")}
    # A rank that fails at once while the others have nothing to report yet: no grace period for them.
    runs["no GPU"] = GPUS == 0 and run("rpc_parameter_server.py", "--world_size=2", "--num_gpus=1", "--timeout",
                                       TIMEOUT, *tiny_mnist_flags(tiny_mnist))
    # Stopped each its own way: under way (the RL agent waits in torch for its observer's episodes), or while it
    # still starts its ranks. RL: of the four, the quickest to load.
    runs.update({how: run("rpc_rl_cartpole.py", "--log_interval=1", "--timeout", TIMEOUT) for how in STOPS})
    note_ends(*started)
    if runs["no GPU"]:
        note_err(runs["no GPU"], "Error on rank 0")

    def stop(how):
        launcher = runs[how]
        if how.startswith("Ctrl-C"):
            os.killpg(launcher.pid, signal.SIGINT)  # the terminal sends it to the whole foreground group
            time.sleep(0.2)
            os.kill(launcher.pid, signal.SIGINT)  # impatient: a second Ctrl-C while the launcher stops the ranks
        else:
            os.kill(launcher.pid, signal.SIGTERM if how.startswith("SIGTERM") else signal.SIGKILL)
        launcher.stopped = time.monotonic()

    def kill_obs2():
        launcher = runs["obs2 killed"]
        # Started from another folder (the test's), the ranks still forked from a server that had loaded torch.
        launcher.preloaded = fork_server_loaded_torch(launcher)
        os.kill(rank_pids(listen_port(launcher), 3)[2], signal.SIGKILL)  # each rank wrote its own pid
        launcher.stopped = time.monotonic()

    try:
        act_when_ready((runs["obs2 killed"], "Episode 1\t", kill_obs2),
                       *[(runs[how], "Starting 2 ranks" if how.endswith("while starting") else "Episode 1\t",
                          lambda how=how: stop(how)) for how in STOPS])
        for launcher in started:
            launcher.wait(HANG)
            if launcher is runs["no GPU"]:
                while not hasattr(launcher, "err_noted_at"):  # note_err sees it within 50 ms
                    time.sleep(0.01)
                launcher.stopped = launcher.err_noted_at
            wait_gone(launcher, launcher.stopped)
        yield runs
    finally:
        for proc in started:
            proc.kill()
            proc.proc.wait()


def test_a_rank_killed_in_a_one_command_run(launcher_runs):
    launcher = launcher_runs["obs2 killed"]
    assert launcher.preloaded, launcher
    assert launcher.returncode == 1, launcher
    assert_quiet(launcher)
    # Every other rank says what it lost (a rank that stopped because of the loss may be named too),
    # then the launcher says which rank ended and that it stopped the rest.
    for rank in (0, 1):
        assert re.search(rf"^Error on rank {rank} \(\w+\): lost contact with [^:]*rank 2 \(obs2\)",
                         launcher.err, re.M), launcher
    assert launcher.err.strip().splitlines()[-1] == "Rank 2 (obs2) ended with SIGKILL: stopped every rank."
    no_gpu = launcher_runs["no GPU"]
    if not no_gpu:
        return
    # The old launcher held every rank for a 10 s grace period; well under that, with room for a loaded machine.
    assert ended_at(no_gpu) - no_gpu.stopped < 8, f"the launcher held the run for a rank with nothing to report: {no_gpu}"
    assert no_gpu.returncode == 1, no_gpu
    assert_quiet(no_gpu)
    assert no_gpu.err.strip().split("\n\n")[-1] == (
        "Error on rank 0 (parameter_server): --num_gpus 1 asks for 1 GPU on the parameter server (rank 0), but its "
        "machine has 0: run rank 0 on a machine with that many GPUs, or lower --num_gpus on every rank.\n"
        "(Run with --debug to see the traceback and torch's own log.)\n"
        "Rank 0 (parameter_server) ended with exit code 1: stopped every rank."), no_gpu


def test_one_command_runs_at_once_each_on_its_own_port(smoke_runs):
    # The four smoke runs (conftest.py) ran at the same time: each picked a free port of its own, and
    # left no folder of multiprocessing's in its TMPDIR (torch's own cache folder is meant to stay).
    ports = []
    for proc in smoke_runs.values():
        proc.wait()
        assert proc.returncode == 0, proc
        ports.append(listen_port(proc))
        assert list((proc.cwd / "tmp").glob("pymp-*")) == [], proc
    assert len(set(ports)) == len(ports)


def test_stopping_a_one_command_run_stops_every_rank(launcher_runs):
    launchers = {how: launcher_runs[how] for how in STOPS}
    for how, launcher in launchers.items():
        if how != "SIGKILL while starting":  # a rank whose launcher died mid-spawn: Python's own EOFError traceback
            assert_quiet(launcher)
        assert "lost contact" not in launcher.err, f"{how}: {launcher}"
        if how.startswith("SIGKILL"):
            assert launcher.returncode == -signal.SIGKILL, launcher
        else:
            assert launcher.returncode == 130, f"{how}: {launcher}"
            assert "Interrupted: stopping every rank.\n" in launcher.err, f"{how}: {launcher}"
    for rank, name in enumerate(["agent", "obs1"]):  # each rank got the Ctrl-C too and says so, the agent too
        assert f"Error on rank {rank} ({name}): interrupted." in launchers["Ctrl-C, twice"].err, launchers["Ctrl-C, twice"]
    for rank, name in enumerate(["agent", "obs1"]):  # told by the launcher's pipe, which closed when it died
        assert (f"Error on rank {rank} ({name}): the launcher is gone (it was killed)"
                in launchers["SIGKILL to the launcher"].err), launchers["SIGKILL to the launcher"]
    for how in ("SIGTERM to the launcher", "SIGTERM while starting"):  # an orderly stop: the ranks say nothing
        assert "Error on rank" not in launchers[how].err, launchers[how]


def test_torchrun_sets_the_ranks(run):
    # torchrun hosts its own store at MASTER_PORT; the script must join it, not bind it, and run one rank only.
    proc = run(SCRIPT, "--epochs", 2, "--timeout", 30,
               python_args=["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]).wait(HANG)
    assert proc.returncode == 0, proc
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


def test_two_machines_pick_the_interface_that_reaches_the_master(run, two_hosts):
    # Here, as on many cloud images, the hostname resolves to 127.0.0.1; without the right interface Gloo
    # tells the peer to connect to 127.0.0.1 and fails. DDP with trainer 1 on host B and the other ranks on
    # A, with --master_addr only: RPC, and DDP's group on the same port, each over the interface that
    # reaches the master. (The plumbing that picks it is the same in every script: tests/test_plumbing.py.)
    (host_a, host_b), (addr_a, addr_b) = two_hosts
    port = free_port()
    ddp = [run("ddp_rpc_hybrid.py", "--world_size=4", "--master_addr", addr_a, "--master_port", port, "--epochs", 2,
               "--timeout", 30, f"--rank={rank}", netns=host_b if rank == 1 else host_a) for rank in range(4)]
    for proc in ddp:
        proc.wait(HANG)
        assert proc.returncode == 0, proc
    veth = re.escape(f"v{host_a[3:9]}")
    for rank in range(4):
        side = "b" if rank == 1 else "a"
        assert re.search(rf"^Rank {rank}: using network interface {veth}{side} to reach {addr_a}$", ddp[rank].out,
                         re.M), ddp[rank]
    for rank in (0, 1):
        assert f"trainer{rank}: DDP on cpu with gloo" in ddp[rank].out.splitlines(), ddp[rank]
    assert re.search(r"^Summary: epochs=2 .* fc_in_sync=true$", ddp[2].out, re.M), ddp[2]
