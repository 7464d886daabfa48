"""What the tests share: `run` starts a script as a user does, a fresh `python SCRIPT ...`."""
import atexit
import contextlib
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # so that tests can import the scripts
SCRIPTS = ["rpc_parameter_server", "rpc_rl_cartpole", "rpc_rnn_model_parallel", "ddp_rpc_hybrid",
           "rpc_batch_parameter_server", "rpc_batch_cartpole"]
BANNER = "# --------- Launching ranks"
# The user's environment but PYTHONUNBUFFERED, with which two ranks' lines may merge; a test that
# acts on lines as they come sets it (LIVE).
USER_ENV = {name: value for name, value in os.environ.items() if name != "PYTHONUNBUFFERED"}
LIVE = {"PYTHONUNBUFFERED": "1"}
# In the background (`bash .ci/run &`), the suite and every run would ignore Ctrl-C.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
HANG = 120  # seconds; the slowest run here, on two busy cores, takes 30
AT_ONCE = 60  # seconds for a rank whose peer died to end (a few, alone)
IN_PROCESS = pytest.mark.xdist_group("imports torch")  # tests that do, all on one worker


def free_port():
    """A port that no other socket gets while this one holds it."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("", 0))
    atexit.register(sock.close)  # held open until the tests end
    return sock.getsockname()[1]


class Run:
    """`python SCRIPT ARGS...` in a session of its own, so that a test can kill all it started."""

    def __init__(self, script, *args, cwd, env=None, prefix=(), python_args=()):
        self.args = [*prefix, sys.executable, *python_args, str(ROOT / script), *map(str, args)]
        self.proc = subprocess.Popen(self.args, cwd=cwd, env={**USER_ENV, **(env or {})},
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.pid, self.started, self.ended = self.proc.pid, time.monotonic(), None
        self.lines = [], []  # stdout's and stderr's, as they come
        self.readers = [threading.Thread(target=lines.extend, args=(pipe,), daemon=True)
                        for lines, pipe in zip(self.lines, (self.proc.stdout, self.proc.stderr))]
        for reader in self.readers:
            reader.start()

    out = property(lambda self: "".join(self.lines[0]))
    err = property(lambda self: "".join(self.lines[1]))
    returncode = property(lambda self: self.proc.returncode)

    def wait_until(self, ready):
        while not ready():
            if self.proc.poll() is not None or time.monotonic() > self.started + HANG:
                self.kill()
                self.proc.wait()
                pytest.fail(f"it never got there:\n{self}")
            time.sleep(0.01)

    def wait_for(self, text):
        self.wait_until(lambda: any(text in line for line in list(self.lines[0])))

    def wait(self, limit=HANG):
        try:
            self.proc.wait(limit)
        except subprocess.TimeoutExpired:
            self.kill()
            self.proc.wait()
            pytest.fail(f"still running after {limit} s: it hangs\n{self}")
        self.ended = self.ended or time.monotonic()
        for reader in self.readers:
            reader.join(5)
        return self

    def kill(self):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)

    def left(self):
        def ours(process):
            with contextlib.suppress(psutil.Error, OSError):
                return os.getsid(process.pid) == self.pid and process.status() != "zombie"
        return [process.pid for process in psutil.process_iter() if ours(process)]

    def __repr__(self):
        return (f"{' '.join(self.args[1:])}\nexit {self.returncode}\nstdout:\n{self.out[-3000:]}"
                f"\nstderr:\n{self.err[-3000:]}")


@pytest.fixture
def run(tmp_path):
    """run(script, *args, ...): a Run in the test's folder, killed when the test ends."""
    runs = []

    def start(script, *args, **kwargs):
        runs.append(Run(script, *args, cwd=tmp_path, **kwargs))
        return runs[-1]

    yield start
    for each in runs:
        each.kill()
        each.proc.wait()


def listening(rank_0):
    """Until rank 0 listens, as a person waits before starting the other terminals."""
    port = int(rank_0.args[rank_0.args.index("--master_port") + 1])

    def answers():
        with contextlib.suppress(OSError), socket.create_connection(("localhost", port), 1):
            return True
    rank_0.wait_until(answers)


def terminals(run, script, world_size, *args, env=None, late=0):
    """One terminal per rank: rank 0, then, `late` s after it listens, the others."""
    common = [script, f"--world_size={world_size}", "--master_port", free_port(), *args]
    ranks = [run(*common, "--rank=0", env=env)]
    listening(ranks[0])
    time.sleep(late)
    return ranks + [run(*common, f"--rank={rank}", env=env) for rank in range(1, world_size)]


def assert_succeeded(*runs):
    """Exit 0, and on stderr no line but torch's two-line warning of each DistributedOptimizer."""
    for each in runs:
        noise = re.sub(r".*DeprecationWarning: `TorchScript` support .*\n.*\n", "", each.err)
        assert each.returncode == 0 and noise == "", each


def one_error_line(proc):
    """Exit 1 and one `Error on rank` line, returned; no traceback but torch's report of an
    exception raised in an RPC that ran here."""
    assert proc.returncode == 1, proc
    ours = re.sub(r"(?ms)^On WorkerInfo\(.*?(?=^Error on rank|\Z)", "", proc.err)
    assert "Traceback" not in ours and "frame #" not in ours, proc
    lines = re.findall(r"^Error on rank .*$", proc.err, re.M)
    assert len(lines) == 1, proc
    return lines[0]


def ends_with(proc, line, limit=AT_ONCE):
    assert one_error_line(proc.wait(limit)) == line


def summary(out):
    lines = re.findall(r"^Summary: (.*)$", out, re.M)
    assert len(lines) == 1, out
    return dict(pair.split("=", 1) for pair in lines[0].split())


def episodes(out):
    return re.findall(r"^Episode (\d+)\tLast reward: (\d+\.\d\d)\tAverage reward: (\d+\.\d\d)$",
                      out, re.M)


def changed_copy(folder, script, old, new):
    text = (ROOT / script).read_text()
    assert old in text, old
    (Path(folder) / script).write_text(text.replace(old, new, 1))
    return Path(folder) / script


@pytest.fixture(scope="session")
def tiny_mnist(tmp_path_factory):
    """An MNIST root of 6 and 2 batches of 32 images, each digit a band of rows of its own."""
    raw = tmp_path_factory.mktemp("mnist") / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for split, count in (("train", 192), ("t10k", 64)):
        labels = bytes(i % 10 for i in range(count))
        pixels = bytearray(count * 28 * 28)
        for i, label in enumerate(labels):
            for row in range(2 * label + 4, 2 * label + 8):
                pixels[(i * 28 + row) * 28 + 4:(i * 28 + row) * 28 + 24] = b"\xff" * 20
        (raw / f"{split}-images-idx3-ubyte").write_bytes(
            struct.pack(">IIII", 2051, count, 28, 28) + pixels)
        (raw / f"{split}-labels-idx1-ubyte").write_bytes(struct.pack(">II", 2049, count) + labels)
    return raw.parent.parent


@pytest.fixture
def two_hosts():
    """Two hosts, (name, interface, address) each: network namespaces joined by a veth pair, whose
    hostnames resolve to 127.0.0.1 as on many cloud images."""
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("needs root and iproute2 to make network namespaces")
    tag = uuid.uuid4().hex[:6]  # unique names; the addresses are the pair's alone
    hosts = [(f"rpc{tag}{n}", f"v{tag}{n}", f"10.213.0.{n}") for n in (1, 2)]
    commands = [f"netns add {hosts[0][0]}", f"netns add {hosts[1][0]}",
                f"link add {hosts[0][1]} type veth peer name {hosts[1][1]}"]
    for netns, ifname, addr in hosts:
        commands += [f"link set {ifname} netns {netns}", f"-n {netns} link set lo up",
                     f"-n {netns} addr add {addr}/24 dev {ifname}",
                     f"-n {netns} link set {ifname} up"]
    try:
        for command in commands:
            if subprocess.run(["ip", *command.split()], capture_output=True).returncode:
                pytest.skip(f"cannot make network namespaces here (ip {command} failed)")
        yield hosts
    finally:
        for netns, _, _ in hosts:
            subprocess.run(["ip", "netns", "del", netns], capture_output=True)
            shutil.rmtree(f"/etc/netns/{netns}", ignore_errors=True)


@pytest.fixture(scope="session")
def gpus():
    import torch
    return torch.cuda.device_count()


@pytest.fixture
def user_shell(monkeypatch):
    """Not torchrun's variables, which would be the flags' defaults."""
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
