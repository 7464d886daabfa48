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

import pytest

from conftest import free_port, tiny_mnist_flags

SCRIPT = "rpc_rnn_model_parallel.py"
TIMEOUT = 10  # --timeout for these runs
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


def test_a_peer_that_never_arrives(run):
    port = free_port()
    trainer = run(SCRIPT, "--world_size=2", "--rank=1", "--master_port", port, "--timeout", 3).wait(HANG)
    assert f"Rank 1: waiting up to 3 s for all 2 processes to meet at localhost:{port}" in trainer.out
    assert_one_paragraph(trainer, "Error on rank 1 (trainer)", "waited 3 s", f"localhost:{port}", "--timeout")


def test_a_taken_port_is_named(run):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        server = run(SCRIPT, "--world_size=2", "--rank=0", "--master_port", port, "--timeout", TIMEOUT).wait(HANG)
    assert_one_paragraph(server, f"port {port}", "already in use", "--master_port")


def test_a_missing_interface_is_named(run):
    proc = run(SCRIPT, "--world_size=2", "--rank=0", "--ifname", "eth9", "--timeout", TIMEOUT).wait(HANG)
    assert_one_paragraph(proc, "no network interface --ifname eth9", "lo")


def test_world_sizes_that_disagree(run):
    # The RL example accepts any world size; rank 0 says 2, rank 1 says 3.
    port = free_port()
    common = ["rpc_rl_cartpole.py", "--max_episodes=1", "--master_port", port, "--timeout", 5]
    agent, observer = run(*common, "--world_size=2", "--rank=0"), run(*common, "--world_size=3", "--rank=1")
    observer.wait(HANG), agent.wait(HANG)
    assert_one_paragraph(observer, "Error on rank 1 (obs1)", "its --world_size is 2 (this rank's: 3)")
    assert_one_paragraph(agent, "Error on rank 0 (agent)", "waited 5 s", "not all came")


KILLS = [
    # script, world size, flags, the rank that prints, what it prints once training is under way, victim, its name
    ("rpc_parameter_server.py", 2, ["--epochs", 100000], 1, "training batch", 1, "trainer_1"),
    ("rpc_rl_cartpole.py", 3, ["--log_interval=1"], 0, "Episode 1\t", 2, "obs2"),
    (SCRIPT, 2, ["--epochs", 100000], 1, "Training epoch 0 loss", 0, "ps"),
    ("ddp_rpc_hybrid.py", 3, ["--epochs", 100000], 0, "Training done for epoch 0", 0, "trainer0"),
]


@pytest.mark.parametrize("script, world_size, extra, printer, started, victim, name", KILLS, ids=[k[0] for k in KILLS])
def test_a_rank_killed_mid_run_stops_every_other_rank(run, tiny_mnist, script, world_size, extra, printer, started,
                                                      victim, name):
    port = free_port()
    common = [f"--world_size={world_size}", "--master_port", port, "--timeout", TIMEOUT, *extra]
    if script == "rpc_parameter_server.py":
        common += tiny_mnist_flags(tiny_mnist)
    if script == "ddp_rpc_hybrid.py":
        common += ["--ddp_port", free_port()]
    ranks = [run(script, *common, f"--rank={rank}") for rank in range(world_size)]
    ranks[printer].wait_for(started)
    os.kill(ranks[victim].pid, signal.SIGKILL)
    killed_at = time.monotonic()
    for rank, proc in enumerate(ranks):
        if rank != victim:
            proc.wait(HANG)
            print(f"rank {rank} ended {proc.ended - killed_at:.1f} s after the kill")
            assert_one_paragraph(proc, "lost contact with ")
            # (With more ranks, a rank that already stopped because of the loss may be named too.)
            assert re.search(rf"lost contact with [^:]*rank {victim} \({name}\)", proc.err), proc


def test_two_one_command_runs_at_once_each_on_its_own_port(run):
    first, second = run(SCRIPT, "--epochs", 4, "--timeout", 30), run(SCRIPT, "--epochs", 4, "--timeout", 30)
    for proc in (first.wait(HANG), second.wait(HANG)):
        assert proc.returncode == 0, proc
        assert re.search(r"^Starting 2 ranks; rank 0 listens on localhost:\d+$", proc.out, re.M), proc
        assert "Summary: epochs=4 " in proc.out
    ports = [re.search(r"listens on localhost:(\d+)", proc.out).group(1) for proc in (first, second)]
    assert ports[0] != ports[1]


@pytest.mark.parametrize("how", ["Ctrl-C", "SIGTERM to the launcher", "SIGKILL to the launcher"])
def test_stopping_a_one_command_run_stops_every_rank(run, how):
    launcher = run(SCRIPT, "--epochs", 100000, "--timeout", TIMEOUT)
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
    assert launcher.returncode != 0
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
