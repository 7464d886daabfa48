"""What the tests share: `run`, which starts a script as a user does (a fresh `python SCRIPT ...`),
one terminal per rank, what a run's lines must show, free ports, tiny MNIST and two hosts. A wait's
limit only tells "bounded" from "hangs": a run that outlives it is killed, and its test fails."""
import collections
import contextlib
import os
import random
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
# The user's environment, before gymnasium sets a variable, without PYTHONUNBUFFERED: with it two
# ranks' lines may merge in one pipe. A test that acts on lines as they come sets it (LIVE).
USER_ENV = {name: value for name, value in os.environ.items() if name != "PYTHONUNBUFFERED"}
LIVE = {"PYTHONUNBUFFERED": "1"}
# Started in the background (`bash .ci/run &`), the suite and every run would ignore Ctrl-C.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
HANG = 120  # seconds: the slowest run here, on two busy cores, takes 30
AT_ONCE = 60  # seconds within which a rank whose peer died ends (a few, alone)
TINY_MNIST = (192, 64)  # train and test images: 6 and 2 batches of the scripts' 32
_held = []


def free_port():
    """A port that the kernel gives no other socket while this process holds it (bound, not
    listening): rank 0 can still listen on it."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("", 0))
    _held.append(sock)
    return sock.getsockname()[1]


class Run:
    """`python SCRIPT ARGS...` with the user's environment and `env`, in a session of its own (a
    test can kill all it started); `prefix` goes before python, `python_args` after it."""

    def __init__(self, script, *args, cwd, env=None, prefix=(), python_args=()):
        self.args = [*prefix, sys.executable, *python_args, str(ROOT / script), *map(str, args)]
        self.proc = subprocess.Popen(self.args, cwd=cwd, env={**USER_ENV, **(env or {})},
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.pid, self.started, self.ended = self.proc.pid, time.monotonic(), None
        self.lines = {"out": [], "err": []}  # as they come
        self.readers = [threading.Thread(target=self.lines[name].extend, args=(pipe,), daemon=True)
                        for name, pipe in (("out", self.proc.stdout), ("err", self.proc.stderr))]
        for reader in self.readers:
            reader.start()

    out = property(lambda self: "".join(self.lines["out"]))
    err = property(lambda self: "".join(self.lines["err"]))
    returncode = property(lambda self: self.proc.returncode)

    def flag(self, name):
        return self.args[self.args.index(name) + 1]

    def wait_until(self, ready, limit=HANG):
        """Return once ready() holds; fail if the run ends first, or `limit` s after its start."""
        while not ready():
            if self.proc.poll() is not None or time.monotonic() > self.started + limit:
                self.kill()
                self.proc.wait()
                pytest.fail(f"it never got there:\n{self}")
            time.sleep(0.01)

    def wait_for(self, text):
        """Return once a line of stdout holds `text`."""
        self.wait_until(lambda: any(text in line for line in list(self.lines["out"])))

    def wait(self, limit=HANG):
        """Wait for the end, `limit` s after the start at most; one still running then fails."""
        try:
            self.proc.wait(max(0.1, self.started + limit - time.monotonic()))
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
        """The processes alive in this run's session: the command and all it started."""
        def ours(process):
            with contextlib.suppress(psutil.Error, OSError):
                return os.getsid(process.pid) == self.pid and process.status() != "zombie"
        return [process.pid for process in psutil.process_iter() if ours(process)]

    def __repr__(self):
        return (f"{' '.join(self.args[1:])}\nexit {self.returncode}\nstdout:\n{self.out[-3000:]}"
                f"\nstderr:\n{self.err[-3000:]}")


@pytest.fixture
def run(tmp_path):
    """run(script, *args, **Run's) starts a script in the test's own folder; all it started is
    killed when the test ends, pass or fail."""
    runs = []

    def start(script, *args, **kwargs):
        runs.append(Run(script, *args, cwd=tmp_path, **kwargs))
        return runs[-1]

    yield start
    for each in runs:
        each.kill()
        each.proc.wait()


def listening(rank_0):
    """Wait until rank 0 listens, as a person waits before starting the other terminals."""
    addr = rank_0.flag("--master_addr") if "--master_addr" in rank_0.args else "localhost"

    def answers():
        with contextlib.suppress(OSError), socket.create_connection(
                (addr, int(rank_0.flag("--master_port"))), 1):
            return True
    rank_0.wait_until(answers)


def terminals(run, script, world_size, *args, env=None, late=0):
    """One terminal per rank, each with the same flags: rank 0, then, `late` s after it listens,
    the others."""
    common = [script, f"--world_size={world_size}", "--master_port", free_port(), *args]
    ranks = [run(*common, "--rank=0", env=env)]
    listening(ranks[0])
    time.sleep(late)
    return ranks + [run(*common, f"--rank={rank}", env=env) for rank in range(1, world_size)]


def assert_succeeded(*runs):
    for each in runs:
        assert each.returncode == 0 and "Traceback" not in each.err, each


def one_error_line(proc, code=1):
    """Exit `code` and one `Error on rank` line, returned; no traceback or C++ frame but torch's
    report of an exception raised in an RPC that ran here (from `On WorkerInfo(`)."""
    assert proc.returncode == code, proc
    ours = re.sub(r"(?ms)^On WorkerInfo\(.*?(?=^Error on rank|\Z)", "", proc.err)
    assert "Traceback" not in ours and "frame #" not in ours, proc
    lines = re.findall(r"^Error on rank .*$", proc.err, re.M)
    assert len(lines) == 1, proc
    return lines[0]


def summary(out):
    """The key=value figures of the one Summary line."""
    lines = re.findall(r"^Summary: (.*)$", out, re.M)
    assert len(lines) == 1, out
    return dict(pair.split("=", 1) for pair in lines[0].split())


def episodes(out):
    """CartPole's status lines, as (episode, last reward, average reward)."""
    return re.findall(r"^Episode (\d+)\tLast reward: (\d+\.\d\d)\tAverage reward: (\d+\.\d\d)$",
                      out, re.M)


def changed_copy(folder, script, old, new):
    """A copy of a script in `folder`, `old` replaced by `new` once, as someone might change it."""
    text = (ROOT / script).read_text()
    assert old in text, old
    (Path(folder) / script).write_text(text.replace(old, new, 1))
    return Path(folder) / script


@pytest.fixture(scope="session")
def tiny_mnist(tmp_path_factory):
    """An MNIST root of TINY_MNIST images, as torchvision's MNIST reads them: noise, and a band of
    rows that each digit lights alone, so that it can be learnt."""
    raw = tmp_path_factory.mktemp("mnist") / "MNIST" / "raw"
    raw.mkdir(parents=True)
    noise = random.Random(0)
    for split, count in zip(("train", "t10k"), TINY_MNIST):
        labels = bytes(i % 10 for i in range(count))
        pixels = bytearray(noise.randrange(60) for _ in range(count * 28 * 28))
        for i, label in enumerate(labels):
            for row in range(2 * label + 4, 2 * label + 8):
                pixels[(i * 28 + row) * 28 + 4:(i * 28 + row) * 28 + 24] = b"\xff" * 20
        (raw / f"{split}-images-idx3-ubyte").write_bytes(
            struct.pack(">IIII", 2051, count, 28, 28) + pixels)
        (raw / f"{split}-labels-idx1-ubyte").write_bytes(struct.pack(">II", 2049, count) + labels)
    return raw.parent.parent


Host = collections.namedtuple("Host", "netns ifname addr")


@pytest.fixture
def two_hosts():
    """Two hosts, network namespaces joined by a veth pair, whose hostnames resolve to 127.0.0.1 as
    on many cloud images; skipped where they cannot be made."""
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("needs root and iproute2 to make network namespaces")
    tag = uuid.uuid4().hex[:6]
    subnet = f"10.{200 + int(tag[:2], 16) % 50}.{int(tag[2:4], 16)}"
    hosts = [Host(f"rpc{tag}{n}", f"v{tag}{n}", f"{subnet}.{n}") for n in (1, 2)]
    commands = [f"netns add {hosts[0].netns}", f"netns add {hosts[1].netns}",
                f"link add {hosts[0].ifname} type veth peer name {hosts[1].ifname}"]
    for host in hosts:
        commands += [f"link set {host.ifname} netns {host.netns}",
                     f"-n {host.netns} addr add {host.addr}/24 dev {host.ifname}",
                     f"-n {host.netns} link set {host.ifname} up", f"-n {host.netns} link set lo up"]
    try:
        for command in commands:
            if subprocess.run(["ip", *command.split()], capture_output=True).returncode:
                pytest.skip(f"cannot make network namespaces here (ip {command} failed)")
        yield hosts
    finally:
        for host in hosts:
            subprocess.run(["ip", "netns", "del", host.netns], capture_output=True)
            shutil.rmtree(f"/etc/netns/{host.netns}", ignore_errors=True)


# Tests that import torch in pytest's own process: one worker runs them all, so only it loads torch.
IN_PROCESS = pytest.mark.xdist_group("imports torch")


@pytest.fixture(scope="session")
def gpus():
    """How many CUDA GPUs torch finds here."""
    import torch
    return torch.cuda.device_count()


@pytest.fixture
def user_shell(monkeypatch):
    """A user's shell, not torchrun's, whose variables the flags' defaults would be."""
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
