"""How runs end when something goes wrong (CONVENTIONS.md, "How a run ends"),
and runs across launchers and machines. Each failure is provoked for real:
real processes, real signals, a really taken port.

The plumbing that handles all of this is the same text in all four scripts
(tests/test_plumbing.py), so most cases run on the RNN example, the quickest to
start (two ranks, no torchvision); a killed peer is tried on every script.

Time limits here only keep a hang from running forever: the figures that users
are promised ("within --timeout plus a few seconds") are measured by hand and
kept in the README, since interpreter start-up varies from host to host."""
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from conftest import free_port, tiny_mnist_flags

SCRIPT = "rpc_rnn_model_parallel.py"
TIMEOUT = 30  # --timeout for these runs: a killed peer is noticed at once, a busy machine is no failure
HANG = TIMEOUT + 30  # a test's own limit: far above what the scripts promise


def assert_one_paragraph(proc, *phrases):
    """Non-zero exit; stderr short, with no traceback or C++ frames, and the
    script's own paragraph last, naming the problem."""
    assert proc.returncode not in (0, None), proc
    err = proc.err.strip()
    assert "Traceback" not in err and "frame #" not in err and len(err.splitlines()) <= 10, proc
    paragraph = err.split("\n\n")[-1]
    assert paragraph.startswith("Error on rank ") and "(Run with --debug" in paragraph, proc
    for phrase in phrases:
        assert phrase in paragraph, proc


def test_failures_before_the_group_meets(run):
    # Independent runs, started side by side to save time; each is checked on its own.
    never, disagree = free_port(), free_port()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        runs = {
            "a peer that never arrives": run(SCRIPT, "--world_size=2", "--rank=1", "--master_port", never, "--timeout", 2),
            "a taken port": run(SCRIPT, "--world_size=2", "--rank=0", "--master_port", taken, "--timeout", TIMEOUT),
            "a missing interface": run(SCRIPT, "--world_size=2", "--rank=0", "--ifname", "eth9", "--timeout", TIMEOUT),
            # The RL example takes any world size: rank 1 says 3, then rank 0 says 2 (and gives up after 2 s).
            "world size 3": run("rpc_rl_cartpole.py", "--world_size=3", "--rank=1", "--master_port", disagree, "--timeout", TIMEOUT),
        }
        runs["world size 3"].wait_for("Rank 1: waiting")
        runs["world size 2"] = run("rpc_rl_cartpole.py", "--world_size=2", "--rank=0", "--master_port", disagree, "--timeout", 2)
        for proc in runs.values():
            proc.wait(HANG)
    assert f"Rank 1: waiting up to 2 s for all 2 processes to meet at localhost:{never}" in runs["a peer that never arrives"].out
    assert_one_paragraph(runs["a peer that never arrives"], "Error on rank 1 (trainer)", "waited 2 s", f"localhost:{never}")
    assert_one_paragraph(runs["a taken port"], f"port {taken}", "already in use", "--master_port")
    assert_one_paragraph(runs["a missing interface"], "no network interface --ifname eth9", "lo")
    assert_one_paragraph(runs["world size 3"], "Error on rank 1 (obs1)", "its --world_size is 2 (this rank's: 3)")
    assert_one_paragraph(runs["world size 2"], "Error on rank 0 (agent)", "waited 2 s", "not all came")


def test_a_rank_killed_mid_run_stops_the_other_rank(run, tiny_mnist):
    # One terminal per rank: each survivor must stop by itself. Two scripts side by side:
    # the parameter server loses its trainer (the rank that drives), the RNN trainer its
    # parameter server (a rank that only serves, and hosts the store).
    cases = [("rpc_parameter_server.py", [*tiny_mnist_flags(tiny_mnist)], "training batch", 1, "trainer_1"),
             (SCRIPT, [], "Training epoch 0 loss", 0, "ps")]
    runs = []
    for script, extra, started, victim, name in cases:
        common = ["--world_size=2", "--master_port", free_port(), "--timeout", TIMEOUT, "--epochs", 100000, *extra]
        runs.append([run(script, *common, f"--rank={rank}") for rank in range(2)])
    for ranks, (script, extra, started, victim, name) in zip(runs, cases):
        ranks[1].wait_for(started)
        os.kill(ranks[victim].pid, signal.SIGKILL)
        killed_at = time.monotonic()
        survivor = ranks[1 - victim].wait(HANG)
        print(f"{script}: the survivor ended {survivor.ended - killed_at:.1f} s after the kill")
        assert_one_paragraph(survivor, f"lost contact with rank {victim} ({name})")


def test_a_rank_killed_in_a_one_command_run(run):
    # Two scripts side by side: an RL observer dies while the agent and the other
    # observer still play; a DDP trainer dies (world size 3: trainer 0, the master,
    # the parameter server).
    cases = [("rpc_rl_cartpole.py", ["--log_interval=1"], "Episode 1\t", 2, "obs2"),
             ("ddp_rpc_hybrid.py", ["--epochs", 100000], "Training done for epoch 0", 0, "trainer0")]
    launchers = [run(script, "--world_size=3", "--timeout", TIMEOUT, *extra) for script, extra, *_ in cases]
    for launcher, (script, extra, started, victim, name) in zip(launchers, cases):
        launcher.wait_for(started)
        ranks = [pid for pid in launcher.processes_left(children_only=True)  # started in rank order
                 if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]  # not the resource tracker
        assert len(ranks) == 3, launcher
        os.kill(ranks[victim], signal.SIGKILL)
    for launcher, (script, extra, started, victim, name) in zip(launchers, cases):
        launcher.wait(HANG)
        assert launcher.returncode == 1, launcher
        assert "Traceback" not in launcher.err and "frame #" not in launcher.err, launcher
        # Every other rank says what it lost (a rank that stopped because of the loss may be named too),
        # then the launcher says which rank ended and that it stopped the rest.
        for rank in {0, 1, 2} - {victim}:
            assert re.search(rf"^Error on rank {rank} \(\w+\): lost contact with [^:]*rank {victim} \({name}\)",
                             launcher.err, re.M), launcher
        assert launcher.err.strip().splitlines()[-1] == f"Rank {victim} ({name}) ended with SIGKILL: stopped every rank."


def test_one_command_runs_at_once_each_on_its_own_port(smoke_runs):
    # The four smoke runs (conftest.py) ran at the same time: each picked a free port of its own.
    ports = []
    for proc in smoke_runs.values():
        proc.wait()
        assert proc.returncode == 0, proc
        ports.append(re.search(r"^Starting \d ranks; rank 0 listens on localhost:(\d+)$", proc.out, re.M).group(1))
    assert len(set(ports)) == len(ports)


def test_stopping_a_one_command_run_stops_every_rank(run):
    # Three runs side by side, each stopped its own way.
    launchers = {how: run(SCRIPT, "--epochs", 100000, "--timeout", TIMEOUT)
                 for how in ("Ctrl-C", "SIGTERM to the launcher", "SIGKILL to the launcher")}
    for how, launcher in launchers.items():
        launcher.wait_for("Training epoch 0 loss")
        if how == "Ctrl-C":
            os.killpg(launcher.pid, signal.SIGINT)  # the terminal sends it to the whole foreground group
        else:
            os.kill(launcher.pid, signal.SIGTERM if how == "SIGTERM to the launcher" else signal.SIGKILL)
        stopped_at = time.monotonic()
        launcher.wait(HANG)
        # Ranks whose launcher was killed outright get SIGINT from the kernel (torch.multiprocessing asks for it).
        while launcher.processes_left() and time.monotonic() - stopped_at < HANG:
            time.sleep(0.1)
        print(f"{how}: every process gone {time.monotonic() - stopped_at:.1f} s after the signal")
        assert launcher.processes_left() == [], f"{how}: ranks left running"
        assert launcher.returncode != 0, launcher
        assert "Traceback" not in launcher.err and "frame #" not in launcher.err, launcher
        if how != "SIGKILL to the launcher":
            assert "Interrupted: stopping every rank." in launcher.err, launcher


def test_torchrun_sets_the_ranks(run):
    # torchrun hosts its own store at MASTER_PORT; the script must join it, not bind it.
    proc = run(SCRIPT, "--epochs", 2, "--timeout", 30,
               python_args=["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]).wait(HANG)
    assert proc.returncode == 0, proc
    assert "Summary: epochs=2 " in proc.out, proc


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
    # Here, as on many cloud images, the hostname resolves to 127.0.0.1; without
    # the right interface Gloo tells the peer to connect to 127.0.0.1 and fails.
    (host_a, host_b), (addr_a, addr_b) = two_hosts
    common = ["--world_size=2", "--master_addr", addr_a, "--master_port", free_port(), "--epochs", 2, "--timeout", 30]
    server = run(SCRIPT, *common, "--rank=0", prefix=["ip", "netns", "exec", host_a])
    trainer = run(SCRIPT, *common, "--rank=1", prefix=["ip", "netns", "exec", host_b])
    trainer.wait(HANG), server.wait(HANG)
    assert trainer.returncode == 0 and server.returncode == 0, (trainer, server)
    veth = re.escape(f"v{host_a[3:9]}")
    assert re.search(rf"^Rank 0: using network interface {veth}a to reach {addr_a}$", server.out, re.M), server
    assert re.search(rf"^Rank 1: using network interface {veth}b to reach {addr_a}$", trainer.out, re.M), trainer
    assert "Summary: epochs=2 " in trainer.out
