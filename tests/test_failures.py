"""How runs end when something goes wrong (CONVENTIONS.md, "How a run ends"),
and runs across launchers and machines. Each failure is provoked for real:
real processes, real signals, a really taken port.

The plumbing that handles all of this is the same text in all four scripts
(tests/test_plumbing.py), so each case runs on one script: the RNN example,
the quickest to start (two ranks, no torchvision), whose trainer and passive
parameter server cover both kinds of rank."""
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import uuid

import pytest

from conftest import free_port

SCRIPT = "rpc_rnn_model_parallel.py"
TIMEOUT = 10  # --timeout for these runs: the bound every failure must meet
SLACK = 5  # "plus a few seconds"


def flags(port, *extra):
    # Many epochs: training is still under way when the test strikes.
    return ["--epochs", 100000, "--master_port", port, "--timeout", TIMEOUT, *extra]


def assert_explained(proc, *phrases):
    """Non-zero exit, one short paragraph naming the problem, no traceback."""
    assert proc.returncode not in (0, None), proc
    for phrase in phrases:
        assert phrase in proc.err, proc
    assert "Traceback" not in proc.err + proc.out, proc


def test_a_peer_that_never_arrives(run):
    port = free_port()
    trainer = run(SCRIPT, "--world_size=2", "--rank=1", *flags(port, "--timeout", 3)).wait()
    assert_explained(trainer, "Error on rank 1 (trainer)", "waited 3 s", f"localhost:{port}", "--timeout")
    assert trainer.seconds < 3 + SLACK + 5  # + the ~4 s it takes to import torch


@pytest.mark.parametrize("script, world_size, extra, printer, started, victim, name", [
    # the rank that drives training:
    (SCRIPT, 2, ["--epochs", 100000], 1, "Training epoch 0 loss", 1, "trainer"),
    # a rank that only serves, and hosts the store:
    (SCRIPT, 2, ["--epochs", 100000], 1, "Training epoch 0 loss", 0, "ps"),
    # a rank that only serves, not rank 0 (it has long said it is done with its own work):
    ("rpc_rl_cartpole.py", 3, ["--log_interval", 1], 0, "Episode 1\t", 2, "obs2"),
])
def test_a_rank_killed_mid_run_stops_every_other_rank(run, script, world_size, extra, printer, started, victim, name):
    port = free_port()
    common = [f"--world_size={world_size}", "--master_port", port, "--timeout", TIMEOUT, *extra]
    ranks = [run(script, *common, f"--rank={rank}") for rank in range(world_size)]
    ranks[printer].wait_for(started)
    os.kill(ranks[victim].pid, signal.SIGKILL)
    killed_at = time.monotonic()
    for rank, proc in enumerate(ranks):
        if rank != victim:
            proc.wait(TIMEOUT + SLACK + 30)
            assert time.monotonic() - killed_at < TIMEOUT + SLACK, proc
            # (With more ranks, a rank that already stopped because of the loss may be named too.)
            assert_explained(proc, "lost contact with ")
            assert re.search(rf"lost contact with [^:]*rank {victim} \({name}\)", proc.err), proc


@pytest.mark.parametrize("how", ["Ctrl-C", "SIGTERM to the launcher", "SIGKILL to the launcher"])
def test_stopping_a_one_command_run_stops_every_rank(run, how):
    launcher = run(SCRIPT, *flags(free_port()))
    launcher.wait_for("Training epoch 0 loss")
    if how == "Ctrl-C":
        os.killpg(launcher.pid, signal.SIGINT)  # the terminal sends it to the whole foreground group
    else:
        os.kill(launcher.pid, signal.SIGTERM if how == "SIGTERM to the launcher" else signal.SIGKILL)
    stopped_at = time.monotonic()
    launcher.proc.wait(30)
    # Ranks that lost their launcher notice within a second or so.
    while launcher.processes_left() and time.monotonic() - stopped_at < SLACK:
        time.sleep(0.1)
    assert launcher.processes_left() == [], f"{how}: ranks left running"
    assert time.monotonic() - stopped_at < SLACK
    assert launcher.returncode != 0
    if how != "SIGKILL to the launcher":
        launcher.wait()
        assert "Interrupted: stopping every rank." in launcher.err, launcher
        assert "Traceback" not in launcher.err, launcher


def test_a_taken_port_is_named(run):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        server = run(SCRIPT, "--world_size=2", "--rank=0", *flags(port)).wait()
    assert_explained(server, f"port {port}", "already in use", "--master_port")


def test_torchrun_sets_the_ranks(run):
    # torchrun hosts its own store at MASTER_PORT; the script must join it, not bind it.
    proc = run(SCRIPT, "--epochs", 2, "--timeout", 30,
               python_args=["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]).wait()
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
    trainer.wait(), server.wait()
    assert trainer.returncode == 0 and server.returncode == 0, (trainer, server)
    assert "Rank 0: using network interface" in server.out and f"({addr_a}) to reach {addr_a}" in server.out
    assert f"({addr_b}) to reach {addr_a}" in trainer.out
    assert "Summary: epochs=2 " in trainer.out
