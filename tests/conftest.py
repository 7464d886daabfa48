"""Shared test helpers: free ports, scripts run as real subprocesses, tiny MNIST."""
import multiprocessing
import multiprocessing.connection
import os
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


def free_port():
    """A port the OS says is free now (never a hard-coded one)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Run:
    """One script started as a user would, in its own session; output read as it comes."""

    def __init__(self, script, args, cwd, env=None, prefix=(), python_args=()):
        self.started, self.cwd = time.monotonic(), Path(cwd)
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, *python_args, str(ROOT / script), *map(str, args)],
            cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            start_new_session=True,  # so a test can signal the whole group, and kill it if it hangs
        )
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
        """Block until stdout has a line containing text (a run that is under way)."""
        deadline = time.monotonic() + timeout
        while not any(text in line for line in list(self._out)):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                self.wait()
                pytest.fail(f"never printed {text!r}: {self}")
            time.sleep(0.05)

    def wait(self, timeout=120):
        """Wait for the exit; a hang is killed and fails the test."""
        try:
            self.proc.wait(timeout=timeout)
            self.ended = time.monotonic()
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
    """run(script, *args) starts a script of the repository; prefix= puts a command
    before python (ip netns exec ...), python_args= goes between python and the
    script (-m torch.distributed.run ...). Every process it started is killed at
    teardown, pass or fail."""
    started = []

    def start(script, *args, env=None, prefix=(), python_args=()):
        proc = Run(script, args, cwd=tmp_path, env=env, prefix=prefix, python_args=python_args)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.kill()
        proc.proc.wait()


@pytest.fixture(scope="session")
def smoke_runs(tmp_path_factory, tiny_mnist):
    """One run of each script as a user starts it (one command, tiny data), all four
    started at once on first use, so that they share the machine's cores; each
    script's own test file checks its run's output."""
    commands = {
        "rpc_parameter_server.py": ["--world_size=3", "--epochs", 2, *tiny_mnist_flags(tiny_mnist), "--save_model", "model.pt"],
        "rpc_rl_cartpole.py": ["--world_size=3", "--max_episodes=3", "--log_interval=1"],
        "rpc_rnn_model_parallel.py": ["--epochs", 4],
        "ddp_rpc_hybrid.py": ["--epochs", 4],
    }
    runs = {script: Run(script, [*args, "--timeout", 60], cwd=tmp_path_factory.mktemp(script[:-3]))
            for script, args in commands.items()}
    yield runs
    for proc in runs.values():
        proc.kill()
        proc.proc.wait()


def write_idx(raw_dir, split, images, labels):
    with open(raw_dir / f"{split}-images-idx3-ubyte", "wb") as f:
        f.write(struct.pack(">IIII", 2051, len(images), 28, 28) + images.numpy().tobytes())
    with open(raw_dir / f"{split}-labels-idx1-ubyte", "wb") as f:
        f.write(struct.pack(">II", 2049, len(labels)) + labels.numpy().tobytes())


def tiny_mnist_flags(root):
    return ["--data_dir", root, "--no-download", "--batch_size", 8, "--log_interval", 2]


@pytest.fixture(scope="session")
def tiny_mnist(tmp_path_factory):
    """An MNIST root with 64 train and 32 test 28x28 images, in the raw IDX
    form that torchvision.datasets.MNIST(download=False) reads."""
    root = tmp_path_factory.mktemp("mnist")
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    for split, count in (("train", 64), ("t10k", 32)):
        labels = torch.arange(count, dtype=torch.uint8) % 10
        # Each digit class lights its own band of rows, so the set is learnable.
        images = torch.randint(0, 60, (count, 28, 28), dtype=torch.uint8, generator=gen)
        for i, label in enumerate(labels.tolist()):
            images[i, 2 * label + 4: 2 * label + 8, 4:24] = 255
        write_idx(raw, split, images, labels)
    return root


def _serve_checks(name, requests, results):
    """The helper process: an RPC group of one named `name`, running the checks it is sent."""
    # TCP only, as in the scripts: TensorPipe's shared-memory transport busy-polls a core for the whole session.
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{free_port()}", _transports=["uv"])
    rpc.init_rpc(name, rank=0, world_size=1, rpc_backend_options=options)
    for check in iter(requests.recv, None):
        try:
            check()
            results.send(None)
        except BaseException:
            results.send(traceback.format_exc())
    rpc.shutdown()


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
    if helper.is_alive():
        to_helper.send(None)
        helper.join(30)
    if helper.is_alive():
        helper.kill()
        helper.join()
