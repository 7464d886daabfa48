"""Shared test helpers: free ports, scripts run as real subprocesses, the runs that
several tests read, tiny MNIST, and the RPC helper process."""
import fcntl
import ipaddress
import json
import multiprocessing
import multiprocessing.connection
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed.rpc as rpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # so tests can import the scripts' classes

# The four scripts, as module names; each is the file ROOT / f"{name}.py".
SCRIPTS = ["rpc_parameter_server", "rpc_rl_cartpole", "rpc_rnn_model_parallel", "ddp_rpc_hybrid"]

# Tiny MNIST and the shared runs' settings: tests derive what they expect from these.
MNIST_TRAIN, MNIST_TEST = 64, 32  # images in the tiny MNIST
MNIST_BATCH_SIZE, MNIST_LOG_INTERVAL = 8, 2  # --batch_size, --log_interval of every parameter server run
PS_EPOCHS = 2
RL_EPISODES = 3
RNN_EPOCHS = 10  # the default: the smoke run is the README's command as written
DDP_EPOCHS = 4

TIMING_FIGURES = {"seconds", "ms_per_batch", "us_per_step"}  # Summary figures that vary from run to run
HANG = 300  # a test's own limit on a run: only keeps a hang from running forever


_reserved = []  # the sockets that hold free_port's ports for the whole session


def free_port():
    """A free port (never a hard-coded one), held for the session as the scripts' launchers hold theirs: bound
    on every address, never listening, so the OS gives it to no one else (held on one address only, it could go
    to a listener on another, and a rank 0 could then not listen on it), while a rank 0 can still listen on it."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("", 0))
    _reserved.append(sock)
    return sock.getsockname()[1]


def own_address():
    """(interface, IPv4 address) of this host's first non-loopback interface, or None if it has none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:  # SIOCGIFADDR: the interface's own address (OSError: it has none)
                addr = socket.inet_ntoa(fcntl.ioctl(sock, 0x8915, struct.pack("256s", name.encode()))[20:24])
            except OSError:
                continue
            if not ipaddress.ip_address(addr).is_loopback:
                return name, addr
    return None


def assert_no_traceback(text):
    """The scripts promise a paragraph, never a Python traceback or C++ frames."""
    assert "Traceback" not in text and "frame #" not in text, text


def assert_succeeded(*runs):
    """Each run exited 0 and printed no traceback."""
    for run in runs:
        assert run.returncode == 0, run
        assert_no_traceback(run.err)


def summary(out, timings=True):
    """The key=value figures of the one Summary line; timings=False leaves out those that vary."""
    lines = re.findall(r"^Summary: (.*)$", out, re.M)
    assert len(lines) == 1, f"expected one Summary line:\n{out}"
    figures = dict(pair.split("=", 1) for pair in lines[0].split())
    return figures if timings else {key: value for key, value in figures.items() if key not in TIMING_FIGURES}


class Preloaded:
    """tests/preloaded.py: a Python that has loaded torch once and forks each run asked of it."""

    def __init__(self):
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.server = subprocess.Popen([sys.executable, str(ROOT / "tests" / "preloaded.py"), str(theirs.fileno())],
                                       pass_fds=[theirs.fileno()], env={**os.environ, "PYTHONUNBUFFERED": "1"})
        theirs.close()
        self.lock, self.changed, self.started, self.ended = threading.Lock(), threading.Condition(), [], {}
        threading.Thread(target=self._listen, daemon=True).start()

    def _listen(self):
        while message := self.sock.recv(4096):
            what, pid, *status = json.loads(message)
            with self.changed:
                if what == "started":
                    self.started.append(pid)
                else:
                    self.ended[pid] = status[0]
                self.changed.notify_all()

    def start(self, argv, env, cwd, netns=None):
        """A Popen-like handle on `python argv...` forked by the server, in a session of its own."""
        (out_r, out_w), (err_r, err_w) = os.pipe(), os.pipe()
        with self.lock, self.changed:
            socket.send_fds(self.sock, [json.dumps([argv[0], argv[1:], env, str(cwd), netns]).encode()], [out_w, err_w])
            os.close(out_w), os.close(err_w)
            if not self.changed.wait_for(lambda: self.started, HANG):
                pytest.fail(f"tests/preloaded.py did not start {argv}")
            return Forked(self, self.started.pop(), open(out_r), open(err_r))

    def stop(self):
        self.sock.close()
        self.server.kill()
        self.server.wait()


class Forked:
    """What Run uses of Popen, for a process that tests/preloaded.py forked (its parent there reaps it)."""

    def __init__(self, server, pid, stdout, stderr):
        self.server, self.pid, self.stdout, self.stderr, self.returncode = server, pid, stdout, stderr, None

    def poll(self):
        if self.returncode is None and self.pid in self.server.ended:
            self.returncode = os.waitstatus_to_exitcode(self.server.ended[self.pid])
        return self.returncode

    def wait(self, timeout=None):
        with self.server.changed:
            if not self.server.changed.wait_for(lambda: self.pid in self.server.ended, timeout):
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
        return self.poll()


_preloaded = []  # the one Preloaded server of this session


def pytest_sessionstart(session):
    _preloaded.append(Preloaded())  # it loads torch while pytest collects the tests


def pytest_sessionfinish(session):
    for server in _preloaded:
        server.stop()


class Run:
    """One script started as a user would, in its own session (and network namespace netns, if given);
    output read as it comes. Forked from tests/preloaded.py unless it needs a fresh interpreter: python_args
    (torchrun) or --debug (torch's log level is set before torch loads)."""

    def __init__(self, script, args, cwd, env=None, netns=None, python_args=()):
        self.started, self.cwd = time.monotonic(), Path(cwd)
        argv, env = [str(ROOT / script), *map(str, args)], {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        if python_args or "--debug" in argv:
            prefix = ["ip", "netns", "exec", netns] if netns else []
            self.proc = subprocess.Popen(
                [*prefix, sys.executable, *python_args, *argv], cwd=cwd, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, text=True, env=env,
                start_new_session=True,  # so a test can signal the whole group, and kill it if it hangs
            )
        else:
            self.proc = _preloaded[0].start(argv, env, cwd, netns)
        self.pid = self.proc.pid
        self._out, self._err = [], []
        self._readers = [threading.Thread(target=lambda pipe=pipe, lines=lines: lines.extend(pipe), daemon=True)
                         for pipe, lines in ((self.proc.stdout, self._out), (self.proc.stderr, self._err))]
        for reader in self._readers:
            reader.start()
        self.seconds = self.ended = None

    @property
    def out(self):
        return "".join(self._out)

    @property
    def err(self):
        return "".join(self._err)

    @property
    def returncode(self):
        return self.proc.returncode

    def wait_for(self, text, timeout=60):
        """Block until stdout has a line containing text (a run that is under way). Fails if the run ends
        first, or prints no line at all for `timeout` s: a loaded machine slows each step (launch, imports,
        meeting, training), so the limit counts from the last line, not from the start."""
        last_line, lines = time.monotonic(), 0
        while not any(text in line for line in list(self._out)):
            if len(self._out) + len(self._err) != lines:
                last_line, lines = time.monotonic(), len(self._out) + len(self._err)
            now = time.monotonic()
            if self.proc.poll() is not None or now - last_line > timeout or now - self.started > HANG:
                self.kill()
                self.wait()
                pytest.fail(f"never printed {text!r}: {self}")
            time.sleep(0.05)

    def wait(self, timeout=120):
        """Wait for the exit; a hang is killed and fails the test."""
        try:
            self.proc.wait(timeout=timeout)
            self.ended = self.ended or time.monotonic()  # a second wait keeps the first end time
        except subprocess.TimeoutExpired:
            self.kill()
            self.proc.wait()
            pytest.fail(f"still running after {timeout} s: {self}")
        finally:
            for reader in self._readers:
                reader.join(5)
        self.seconds = self.ended - self.started
        return self

    def kill(self):
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def processes_left(self, children_only=False):
        """Processes still alive in this run's session (launcher and ranks), or only the launcher's children."""
        left = []
        for entry in Path("/proc").iterdir():
            try:
                state, ppid, _, session = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:4]
            except (OSError, IndexError, ValueError):
                continue
            if int(session) == self.pid and state != "Z" and (int(ppid) == self.pid or not children_only):
                left.append(int(entry.name))
        return sorted(left)

    def __repr__(self):
        return (f"exit {self.returncode} after {self.seconds} s\nstdout:\n{self.out[-4000:]}"
                f"\nstderr:\n{self.err[-4000:]}")


@pytest.fixture
def run(tmp_path):
    """run(script, *args) starts a script of the repository (conftest.Run); netns= runs it in that
    network namespace, python_args= goes between python and the script (-m torch.distributed.run ...).
    Every process it started is killed at teardown, pass or fail."""
    started = []

    def start(script, *args, env=None, netns=None, python_args=()):
        proc = Run(script, args, cwd=tmp_path, env=env, netns=netns, python_args=python_args)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.kill()
        proc.proc.wait()


@pytest.fixture(scope="session")
def shared_runs(tmp_path_factory, tiny_mnist, alone_in_rpc):
    """Every script run that several tests read, started together on first use so that they share the cores,
    and all ended before any test reads them, so that their load never overlaps a later test. A dict: the
    RNN's one-command run by its file name, and its twin of the same flags run one rank per process with
    --master_addr this host's own non-loopback address where it has one ("rnn ranks at own address"); the
    parameter server and CartPole at world size 2 one rank per process, twice with the same flags ("ps ranks"
    and "ps twin", "rl ranks" and "rl twin"), and at world size 3 ("ps 3 ranks", "rl 3 ranks"); DDP at world
    size 3, one rank per process, by its file name; "rnn torchrun", the RNN under torchrun. One command runs
    only the RNN here: every rank it starts imports torch afresh, the suite's largest cost, and the launcher is
    the same text in all four scripts. The RPC helper process (alone_in_rpc) starts with them."""
    started = []

    def start(script, *args, python_args=()):
        # --timeout only bounds a failure: on a loaded machine the ranks of one run may arrive far apart.
        started.append(Run(script, [*args, "--timeout", 120], cwd=tmp_path_factory.mktemp(script[:-3]),
                           python_args=python_args))
        return started[-1]

    def ranks(script, world_size, *args, addr="localhost"):
        common = [f"--world_size={world_size}", "--master_addr", addr, "--master_port", free_port(), *args]
        return [start(script, *common, f"--rank={rank}") for rank in range(world_size)]

    ps_flags = [f"--epochs={PS_EPOCHS}", *tiny_mnist_flags(tiny_mnist)]
    rl_flags = [f"--max_episodes={RL_EPISODES}", "--log_interval=1"]
    rnn_flags = [f"--epochs={RNN_EPOCHS}"]
    runs = {  # world size 2, twice with the same flags: the same numbers
        "ps ranks": ranks("rpc_parameter_server.py", 2, *ps_flags),
        "ps twin": ranks("rpc_parameter_server.py", 2, *ps_flags),
        "rl ranks": ranks("rpc_rl_cartpole.py", 2, *rl_flags),
        "rl twin": ranks("rpc_rl_cartpole.py", 2, *rl_flags),
        "rpc_rnn_model_parallel.py": start("rpc_rnn_model_parallel.py", *rnn_flags),
        "rnn ranks at own address": ranks("rpc_rnn_model_parallel.py", 2, *rnn_flags,
                                          addr=(own_address() or (None, "localhost"))[1]),
        # World size 3: two trainers, two observers; DDP at its smallest.
        "ps 3 ranks": ranks("rpc_parameter_server.py", 3, *ps_flags, "--save_model", "model.pt"),
        "rl 3 ranks": ranks("rpc_rl_cartpole.py", 3, *rl_flags),
        "ddp_rpc_hybrid.py": ranks("ddp_rpc_hybrid.py", 3, f"--epochs={DDP_EPOCHS}"),
        "rnn torchrun": start("rpc_rnn_model_parallel.py", "--epochs=2", python_args=[
            "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]),
    }
    try:
        deadline = time.monotonic() + HANG
        for proc in started:
            proc.wait(max(1, deadline - time.monotonic()))
        yield runs
    finally:
        for proc in started:
            proc.kill()
            proc.proc.wait()


def write_idx(raw_dir, split, images, labels):
    with open(raw_dir / f"{split}-images-idx3-ubyte", "wb") as f:
        f.write(struct.pack(">IIII", 2051, len(images), 28, 28) + images.numpy().tobytes())
    with open(raw_dir / f"{split}-labels-idx1-ubyte", "wb") as f:
        f.write(struct.pack(">II", 2049, len(labels)) + labels.numpy().tobytes())


def tiny_mnist_flags(root):
    return ["--data_dir", root, "--no-download", "--batch_size", MNIST_BATCH_SIZE, "--log_interval", MNIST_LOG_INTERVAL]


@pytest.fixture(scope="session")
def tiny_mnist(tmp_path_factory):
    """An MNIST root with MNIST_TRAIN train and MNIST_TEST test 28x28 images, in the
    raw IDX form that torchvision.datasets.MNIST(download=False) reads."""
    root = tmp_path_factory.mktemp("mnist")
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    for split, count in (("train", MNIST_TRAIN), ("t10k", MNIST_TEST)):
        labels = torch.arange(count, dtype=torch.uint8) % 10
        # Each digit class lights its own band of rows, so the set is learnable.
        images = torch.randint(0, 60, (count, 28, 28), dtype=torch.uint8, generator=gen)
        for i, label in enumerate(labels.tolist()):
            images[i, 2 * label + 4: 2 * label + 8, 4:24] = 255
        write_idx(raw, split, images, labels)
    return root


def _serve_checks(name, requests, results):
    """The helper process: an RPC group of one named `name`, running the tests it is sent."""
    # TCP only, as in the scripts: TensorPipe's shared-memory transport busy-polls a core for the whole session.
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{free_port()}", _transports=["uv"])
    rpc.init_rpc(name, rank=0, world_size=1, rpc_backend_options=options)
    while True:  # until the session's end kills it
        check = requests.recv()
        try:
            check()
            results.send(None)
        except BaseException:
            results.send(traceback.format_exc())


@pytest.fixture(scope="session")
def alone_in_rpc():
    """alone_in_rpc(check) runs check() in a helper process that is an RPC group of one
    named like the parameter server, so a script's RPCs to that worker land there.
    A process of its own, because RPC can be started only once per process; spawned,
    not forked, because a forked child cannot use CUDA once the test process has."""
    ctx = multiprocessing.get_context("spawn")
    requests, to_helper = ctx.Pipe(duplex=False)
    from_helper, results = ctx.Pipe(duplex=False)
    helper = ctx.Process(target=_serve_checks, args=("parameter_server", requests, results), daemon=True)
    helper.start()

    def run_check(check, timeout=120):
        to_helper.send(check)
        # Wait for the answer or the helper's death, whichever comes first.
        ready = multiprocessing.connection.wait([from_helper, helper.sentinel], timeout)
        if from_helper in ready:
            failure = from_helper.recv()
            if failure:
                pytest.fail(f"{check.__name__} failed in the RPC helper process:\n{failure}", pytrace=False)
        elif ready:
            pytest.fail(f"the RPC helper process died (exit code {helper.exitcode}) while running "
                        f"{check.__name__}; its error is in the captured stderr above", pytrace=False)
        else:
            pytest.fail(f"{check.__name__} did not finish within {timeout} s", pytrace=False)

    yield run_check
    helper.kill()  # nothing in its group of one to wind down; rpc.shutdown() would take a second or two
    helper.join()


def in_rpc_group(test):
    """Decorates a test that takes no arguments: it runs in the alone_in_rpc helper process, not in pytest's."""
    return pytest.mark.usefixtures("alone_in_rpc")(pytest.mark.in_rpc_group(test))


def pytest_configure(config):
    config.addinivalue_line("markers", "in_rpc_group: run the test in the RPC helper process (conftest.in_rpc_group)")


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    if pyfuncitem.get_closest_marker("in_rpc_group"):
        pyfuncitem.funcargs["alone_in_rpc"](pyfuncitem.obj)
        return True
    return None
