"""Shared test helpers: free ports, scripts run as a user runs them (a fresh `python SCRIPT ...` each), the
runs that several tests read, tiny MNIST, and hosts made of network namespaces."""
import contextlib
import ipaddress
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
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # so tests can import the scripts' classes
# The environment pytest was started with, the user's: before the tests import gymnasium, which sets a variable.
USER_ENV = dict(os.environ)
# But for PYTHONUNBUFFERED, which tests that read lines as they come set (LIVE): with it, the lines of two ranks
# printing at once into one pipe may merge (the README says so); without it, each rank's lines come whole.
USER_ENV.pop("PYTHONUNBUFFERED", None)
# A terminal's Ctrl-C reaches a run. This suite started in the background of a script (`bash .ci/run &`) has
# SIGINT ignored, and so would each run it starts, as an ignored signal stays ignored in a child.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# The scripts, as module names; each is the file ROOT / f"{name}.py".
SCRIPTS = ["rpc_parameter_server", "rpc_rl_cartpole", "rpc_rnn_model_parallel", "ddp_rpc_hybrid",
           "rpc_batch_parameter_server", "rpc_batch_cartpole"]
SCRIPT_FILES = [f"{name}.py" for name in SCRIPTS]

# Tiny MNIST and the shared runs' settings: tests derive what they expect from these.
MNIST_TRAIN, MNIST_TEST = 192, 64  # images in the tiny MNIST: 6 and 2 batches of the script's 32
PS_EPOCHS = 1
RL_EPISODES = 10  # whether so few improve the policy depends on the seed (test_classes checks the loss)
RNN_EPOCHS = 10  # the default: the smoke run is the README's command as written
DDP_EPOCHS = 2
BATCHES = ["--batches=20"]  # the batch parameter server's smoke runs: twice its tutorial's 6
BATCH_RL = ["--num_episode=3", "--n_steps=50"]  # the batch CartPole's: 3 short episodes
SLOW = 20  # seconds that the slow agent's fifth select_action takes; its observer's --timeout is half that
VANISH_TIMEOUT = 20  # --timeout of the runs whose machine vanishes: 5x to meet, as two suites at once need
SIZES_TIMEOUT = 10  # --timeout of the ranks of two world sizes, which never meet: they stop after 5x that

# A run's lines as they are printed, through a pipe: the environment of a user who watches them with `| tee`.
LIVE = {"PYTHONUNBUFFERED": "1"}
TIMING_FIGURES = {"seconds", "ms_per_batch", "us_per_step"}  # Summary figures that vary from run to run
HANG = 600  # a test's own limit on a run: only keeps a hang from running forever
# The processes of the suite's runs alive at once: each holds 0.3-0.4 GB with torch's CUDA build, so that one suite
# fits in 6 GB (a CI runner of 7 GB); more would only share the cores.
PROCESSES = 13


_reserved = []  # the sockets that hold free_port's ports for the whole session


def free_port():
    """A free port (never a hard-coded one), held for the session: bound on every address with SO_REUSEADDR, never
    listening, as a one-command run holds its own. The kernel hands a port so held to no other bind, listener or
    connection, so no run takes it, while a rank 0 can still listen on it."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("", 0))
    _reserved.append(sock)
    return sock.getsockname()[1]


def own_address():
    """(interface, IPv4 address) of this host's first interface with a non-loopback address, or None."""
    for name, addrs in psutil.net_if_addrs().items():
        for addr in addrs:
            if addr.family == socket.AF_INET and not ipaddress.ip_address(addr.address).is_loopback:
                return name, addr.address
    return None


def assert_no_traceback(text):
    """The scripts promise one line, never a Python traceback or C++ frames."""
    assert "Traceback" not in text and "frame #" not in text, text


def assert_succeeded(*runs):
    """Each run exited 0 and printed no traceback."""
    for run in runs:
        assert run.returncode == 0, run
        assert_no_traceback(run.err)


def listening(first):
    """Block until the rank 0 started as `first` listens on its --master_addr:--master_port (a person starts the
    other terminals once it has); fail if it ends first."""
    flags = first.proc.args
    where = (flags[flags.index("--master_addr") + 1] if "--master_addr" in flags else "localhost",
             int(flags[flags.index("--master_port") + 1]))
    while first.proc.poll() is None and time.monotonic() - first.started < HANG:
        try:
            socket.create_connection(where, 1).close()
            return
        except OSError:
            time.sleep(0.1)
    pytest.fail(f"rank 0 never listened: {first}")


def error_lines(proc):
    return re.findall(r"^Error on rank .*$", proc.err, re.M)


def one_error_line(proc, code=1):
    """Exit status `code`, exactly one error line, which it returns, and no traceback but torch's own reports of
    an exception raised inside an RPC that ran here (from "On WorkerInfo(" to the error line)."""
    assert proc.returncode == code, proc
    assert_no_traceback(re.sub(r"(?ms)^On WorkerInfo\(.*?(?=^Error on rank|\Z)", "", proc.err))
    lines = error_lines(proc)
    assert len(lines) == 1, proc
    return lines[0]


def summary(out, timings=True):
    """The key=value figures of the one Summary line; timings=False leaves out those that vary."""
    lines = re.findall(r"^Summary: (.*)$", out, re.M)
    assert len(lines) == 1, f"expected one Summary line:\n{out}"
    figures = dict(pair.split("=", 1) for pair in lines[0].split())
    return figures if timings else {key: value for key, value in figures.items() if key not in TIMING_FIGURES}


class Run:
    """`python SCRIPT ARGS...` started as a user would, with the user's environment (plus `env`), in a session of
    its own so that a test can signal or kill all it started; in network namespace `netns` if given (`ip netns
    exec`); `python_args` go between python and the script (-m torch.distributed.run ...). Output is read as it
    comes."""

    def __init__(self, script, args, cwd, env=None, netns=None, python_args=()):
        self.started, self.cwd = time.monotonic(), Path(cwd)
        prefix = ["ip", "netns", "exec", netns] if netns else []
        self.proc = subprocess.Popen([*prefix, sys.executable, *python_args, str(ROOT / script), *map(str, args)],
                                     cwd=cwd, env={**USER_ENV, **(env or {})}, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.pid = self.proc.pid
        self._out, self._err = [], []
        self._readers = [threading.Thread(target=lambda pipe=pipe, lines=lines: lines.extend(pipe), daemon=True)
                         for pipe, lines in ((self.proc.stdout, self._out), (self.proc.stderr, self._err))]
        for reader in self._readers:
            reader.start()
        self.seconds = self.ended = None
        threading.Thread(target=self._note_the_end, daemon=True).start()

    def _note_the_end(self):
        """The time the process ended, whenever a test reads it."""
        self.proc.wait()
        self.ended = self.ended or time.monotonic()

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

    def processes_left(self):
        """Processes still alive in this run's session (the command and all it started)."""
        left = []
        for entry in Path("/proc").iterdir():
            try:
                state, _, _, session = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:4]
            except (OSError, IndexError, ValueError):
                continue
            if int(session) == self.pid and state != "Z":
                left.append(int(entry.name))
        return sorted(left)

    def __repr__(self):
        return (f"exit {self.returncode} after {self.seconds} s\nstdout:\n{self.out[-4000:]}"
                f"\nstderr:\n{self.err[-4000:]}")


@pytest.fixture
def run(tmp_path):
    """run(script, *args, env=None) starts a script of the repository (Run). Every process it started is killed
    at teardown, pass or fail."""
    started = []

    def start(script, *args, env=None):
        started.append(Run(script, args, cwd=tmp_path, env=env))
        return started[-1]

    yield start
    stop_all(started)


def stop_all(runs):
    """Kill whatever is left of each run, pass or fail, and reap it."""
    for proc in runs:
        proc.kill()
        proc.proc.wait()


def wait_all(runs, limit=HANG):
    """Wait for every run to end, `limit` seconds at most in all, and kill those left then: each test judges its
    runs by what they printed and how they ended (-9: killed here)."""
    deadline = time.monotonic() + limit
    for proc in runs:
        try:
            proc.proc.wait(max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
        proc.wait()


def when(runs, condition):
    """Return as soon as condition() holds, so that a test acts on runs under way before they train on, taking the
    cores; fail at once where one of the runs ends first."""
    deadline = time.monotonic() + HANG
    while not condition():
        if any(run.proc.poll() is not None for run in runs) or time.monotonic() > deadline:
            pytest.fail(f"a run ended, or hung, before it was ready: {runs}")
        time.sleep(0.001)


def named_case(runs, name, begin, act=None, limit=HANG):
    """A case for side_by_side: runs[name] = begin(), a run or a list of them; act(runs[name]) if given; then wait
    for every process to end, `limit` s at most."""
    def run_case():
        runs[name] = begin()
        if act:
            act(runs[name])
        wait_all(runs[name] if isinstance(runs[name], list) else [runs[name]], limit)
    return run_case


_room = threading.Condition()  # the room left for processes (PROCESSES), and the cases waiting for it in turn
_free, _waiting = [PROCESSES], []


def side_by_side(cases):
    """cases: (size, case) pairs. Run each case, a function that starts `size` processes at most, acts on them and
    returns once they have ended, in a thread of its own, once the processes still alive leave room for it: cases
    in the order given, so that at most PROCESSES processes of the suite's runs are alive at once. Returns once
    every case has returned, raising the first failure of one."""
    failures, tickets = [], [object() for _ in cases]

    def in_turn(ticket, size, case):
        with _room:
            _room.wait_for(lambda: _waiting[0] is ticket and _free[0] >= size)
            _waiting.pop(0)
            _free[0] -= size
            _room.notify_all()
        try:
            case()
        except BaseException as failure:  # pytest.fail's too
            failures.append(failure)
        finally:
            with _room:
                _free[0] += size
                _room.notify_all()

    assert all(size <= PROCESSES for size, _ in cases), cases
    with _room:
        _waiting.extend(tickets)
    threads = [threading.Thread(target=in_turn, args=(ticket, *case), daemon=True)
               for ticket, case in zip(tickets, cases)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise failures[0]


def killed(run):
    """Kill a run (a rank in a terminal of its own), noting when (.killed)."""
    run.kill()
    run.killed = time.monotonic()


def changed_copy(folder, script, old, new, *more):
    """A copy of a script in `folder` with `old` replaced by `new` once, and so on for each further pair of `more`,
    as someone might change it."""
    text = (ROOT / script).read_text()
    changes = [(old, new), *zip(more[::2], more[1::2])]
    for old, new in changes:
        assert old in text, old
        text = text.replace(old, new, 1)
    (folder / script).write_text(text)
    return folder / script


def slow_agent(folder):
    """A copy of rpc_rl_cartpole.py whose agent answers its fifth select_action SLOW s late, as a slow agent on a
    busy machine would, on the script's one RPC thread: nothing else the agent answers gets through meanwhile."""
    return changed_copy(folder, "rpc_rl_cartpole.py", "    def select_action(self, ob_id, state):\n",
                        "    def select_action(self, ob_id, state):\n"
                        "        self.calls = getattr(self, 'calls', 0) + 1\n"
                        f"        time.sleep({SLOW} if self.calls == 5 else 0)\n")


def write_idx(raw_dir, split, images, labels):
    with open(raw_dir / f"{split}-images-idx3-ubyte", "wb") as f:
        f.write(struct.pack(">IIII", 2051, len(images), 28, 28) + images.numpy().tobytes())
    with open(raw_dir / f"{split}-labels-idx1-ubyte", "wb") as f:
        f.write(struct.pack(">II", 2049, len(labels)) + labels.numpy().tobytes())


@pytest.fixture(scope="session")
def tiny_mnist(tmp_path_factory):
    """An MNIST root with MNIST_TRAIN train and MNIST_TEST test 28x28 images, in the
    raw IDX form that torchvision.datasets.MNIST reads."""
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


@contextlib.contextmanager
def two_hosts():
    """Two network namespaces joined by a veth pair: two hosts with their own addresses, whose hostnames resolve
    to 127.0.0.1 as on many cloud images. Yields (hosts, addrs), or the reason why they cannot be made here; the
    veth inside host i is "v" + hosts[i][3:]."""
    if os.geteuid() != 0 or not shutil.which("ip"):
        yield "needs root and iproute2 to create network namespaces"
        return
    tag = uuid.uuid4().hex[:6]
    hosts = [f"rpc{tag}a", f"rpc{tag}b"]
    subnet = f"10.{200 + int(tag[:2], 16) % 50}.{int(tag[2:4], 16)}"
    commands = [["ip", "netns", "add", hosts[0]], ["ip", "netns", "add", hosts[1]],
                ["ip", "link", "add", f"v{tag}a", "type", "veth", "peer", "name", f"v{tag}b"]]
    for i, host in enumerate(hosts):
        dev = "v" + host[3:]
        commands += [["ip", "link", "set", dev, "netns", host],
                     ["ip", "-n", host, "addr", "add", f"{subnet}.{i + 1}/24", "dev", dev],
                     ["ip", "-n", host, "link", "set", dev, "up"],
                     ["ip", "-n", host, "link", "set", "lo", "up"]]
    try:
        failed = next((command for command in commands if subprocess.run(command, capture_output=True).returncode),
                      None)
        yield f"cannot create network namespaces here ({' '.join(failed)} failed)" if failed else (
            hosts, [f"{subnet}.1", f"{subnet}.2"])
    finally:
        for host in hosts:
            subprocess.run(["ip", "netns", "del", host], capture_output=True)
            shutil.rmtree(f"/etc/netns/{host}", ignore_errors=True)


def host_resolves_hostname_to(host, addr):
    """Make `ip netns exec host` resolve this machine's hostname to addr, as a desktop or a cloud machine whose
    hostname resolves to its network address does: ip netns exec reads /etc/netns/HOST/hosts as /etc/hosts."""
    Path(f"/etc/netns/{host}").mkdir(parents=True, exist_ok=True)
    Path(f"/etc/netns/{host}/hosts").write_text(f"127.0.0.1 localhost\n{addr} {socket.gethostname()}\n")


def watch_listening(run, netns, runs):
    """Into runs["rnn listening"], the local addresses on which the processes of `run` listened for TCP inside
    network namespace `netns`, from its start until it ended."""
    runs["rnn listening"] = seen = set()
    while run.proc.poll() is None:
        pids = run.processes_left()
        table = subprocess.run(["ip", "netns", "exec", netns, "ss", "-ltnpH"], capture_output=True, text=True)
        seen.update(line.split()[3].rsplit(":", 1)[0] for line in table.stdout.splitlines()
                    if any(int(pid) in pids for pid in re.findall(r"pid=(\d+)", line)))
        time.sleep(0.1)


# One terminal per rank across two hosts, rank 0 on host A and the others on B, each with the --ifname of its host,
# until A's link goes down: (script, world size, flags, the rank that shows training under way, its line). The DDP
# example has every kind of rank: its trainers sit in RPCs and collectives, its master waits on them, its
# parameter server only waits. Rank 0 is a copy of the script whose host says that it has two GPUs, as
# gpu_host() makes it, and rank 1's has none: the trainers must agree on the CPU.
VANISHING = [("ddp_rpc_hybrid.py", 4, ["--epochs", 100000], 1, "Training done for epoch 1 ")]


def gpu_host(folder):
    """A copy of ddp_rpc_hybrid.py for a host that says it has two GPUs (it has none: a trainer that believes
    it and puts its replica on cuda:0 fails)."""
    return changed_copy(folder, "ddp_rpc_hybrid.py", "import torch\n",
                        "import torch\ntorch.cuda.device_count = lambda: 2\n")


def torchrun(addr, endpoint, nproc):
    """torchrun's flags for one machine of two: c10d rendezvous at endpoint, hosted by the machine that has that
    address (is_host: its hostname resolves to 127.0.0.1, so torchrun cannot tell), each machine naming its own
    address (--local_addr: else the ranks are told MASTER_ADDR=localhost)."""
    return ["-m", "torch.distributed.run", "--nnodes=2", f"--nproc_per_node={nproc}", "--rdzv_backend=c10d",
            f"--rdzv_endpoint={endpoint}", f"--rdzv_conf=is_host={int(endpoint.startswith(addr + ':'))}",
            f"--local_addr={addr}"]


@pytest.fixture(scope="session")
def shared_runs(tmp_path_factory, tiny_mnist):
    """The runs that tests read, but for the failure cases that time how fast a run ends, started side by side
    (side_by_side: those that take longest or that a test acts on first), all ended before any test reads them, so
    that their load never overlaps a later test's. A dict by name:
    - "rnn", "ps", "rl", "ddp 3", "ddp 4": each script's one-command launch, as a user types it (the RNN's and
      the parameter server's are the README's commands as written, the latter with tiny MNIST as its DIR); the
      parameter server at world size 3, CartPole at 2, DDP at 3 and at 4;
    - "ps workers": the parameter server at world size 2 in one command, its trainers loading MNIST with two
      DataLoader workers, as a learner may change it;
    - "rnn ranks", "ps ranks", "rl ranks": one terminal per rank, a list of ranks: one rank drives the training
      alone, so each must print its one-command twin's numbers ("ps workers" for the parameter server), for as
      long as it runs (the parameter server one epoch, CartPole 5 episodes). The RNN's ranks are started as a
      person starts them, with the README's flags: rank 1 two seconds after rank 0 listens, at this host's own
      non-loopback address and its --ifname where it has one;
    - "bps 2", "bps 3", "bps ranks": the batch parameter server in one command at world size 2 and 3, and one
      terminal per rank at 2, its trainer killed (.killed: when) once it has printed its loss at batch 20;
      "brl 2", "brl 3", "brl ranks": the batch CartPole likewise, batching but at world size 3 (--no-batch),
      its observer killed once the agent has printed episode 2 (PYTHONUNBUFFERED=1, as a user who watches the
      lines through a pipe sets it, in both);
    - "rl slow": [agent, observer] of slow_agent(), the observer, whose --timeout is SLOW / 2, started once the
      agent listens;
    - "scripts": the RNN's rank 0 and CartPole's rank 1 on one port; "sizes": CartPole's rank 0 at --world_size 2
      and its rank 1 at 3 on one port; "ps sizes": the parameter server's ranks 0 and 2 at --world_size 3, and
      rank 1 where the person forgot the flag (the default, 4); each rank but 0 started once rank 0 listens, as a
      person starts them;
    - "copy": tests/learner.py, the parameter server's tutorial part copied into a program of a learner's own,
      without the plumbing, with two trainers and the upstream example's launcher;
    - "hosts": where network namespaces can be made, else the reason why not (a str); then the RNN's one command
      runs on host B, whose hostname resolves to B's address, and "rnn listening" holds the addresses its
      processes listened on while they trained;
      "vanished": the runs of VANISHING by script, a list of ranks, rank 0 on host A and the others on B (each
      PYTHONUNBUFFERED=1), each under way when A's link went down, "down" seconds later all had ended;
      "torchrun addrs" and "torchrun": the RNN under torchrun across a second pair of hosts, one agent on each."""
    started = []

    def start(script, *args, python_args=(), timeout=120, netns=None, env=None):
        # --timeout only bounds a failure: on a loaded machine the ranks of one run may arrive far apart.
        run = Run(script, [*args, *(["--timeout", timeout] if timeout else [])],
                  cwd=tmp_path_factory.mktemp(Path(script).stem), python_args=python_args, netns=netns, env=env)
        started.append(run)  # several threads start runs: each returns its own
        return run

    def ranks(script, world_size, *args, env=None):
        common = [f"--world_size={world_size}", "--master_port", free_port(), *args]
        return [start(script, *common, f"--rank={rank}", env=env) for rank in range(world_size)]

    def once_listening(first, *args, late=0, **kwargs):
        """Start a rank as a person would, `late` s after rank 0, started as `first`, listens."""
        listening(first)
        time.sleep(late)
        return start(*args, **kwargs)

    def case(name, begin, act=None):
        return named_case(runs, name, begin, act)

    def kill_trainer(ranks):
        when(ranks, lambda: "trainer1 batch 20 " in ranks[1].out)
        killed(ranks[1])

    def kill_observer(ranks):
        when(ranks, lambda: "Episode 2\t" in ranks[0].out)
        killed(ranks[1])

    ps_flags = ["--data_dir", tiny_mnist, f"--epochs={PS_EPOCHS}"]
    ifname, addr = own_address() or ("lo", "localhost")
    rnn_at = ["--master_addr", addr, "--ifname", ifname, "--master_port", free_port()]
    slow, slow_port = slow_agent(tmp_path_factory.mktemp("slow")), ["--master_port", free_port(), "--max_episodes=3"]
    scripts_port, sizes, ps_sizes = free_port(), ["--master_port", free_port()], ["--master_port", free_port()]

    def by_hand(first, *later):
        """Ranks started one terminal each, as a person starts them: first, rank 0, then each of later (start's
        arguments, with late=) once first listens."""
        def begin():
            ranks = [start(*first[0], **first[1])]
            for args, kwargs in later:
                ranks.append(once_listening(ranks[0], *args, **kwargs))
            return ranks
        return begin

    runs = {}
    with two_hosts() as pair, two_hosts() as torchrun_pair:
        runs["hosts"] = pair
        cases = []
        if not isinstance(pair, str):
            (host_a, host_b), (addr_a, addr_b) = pair
            host_resolves_hostname_to(host_b, addr_b)

            def vanish(ranks):  # host A's own link goes down, once every rank is under way: nothing sends FIN or RST
                when(ranks, lambda: all(line in runs["vanished"][script][printer].out
                                        for script, _, _, printer, line in VANISHING))
                subprocess.run(["ip", "-n", host_a, "link", "set", "v" + host_a[3:], "down"], check=True)
                runs["down"] = time.monotonic()
                wait_all(ranks)  # the test asks for less
                runs["down"] = max(run.ended for run in ranks) - runs["down"]

            def vanishing():
                runs["vanished"] = {}
                for script, world_size, flags, _, _ in VANISHING:
                    common = [f"--world_size={world_size}", "--master_addr", addr_a, "--master_port", free_port(),
                              *flags]
                    runs["vanished"][script] = [
                        start(script if rank else gpu_host(tmp_path_factory.mktemp("gpus")), *common,
                              f"--rank={rank}", "--ifname", "v" + host[3:], timeout=VANISH_TIMEOUT, netns=host,
                              env={"OMP_NUM_THREADS": "1", **LIVE})
                        for rank in range(world_size) for host in [host_b if rank else host_a]]
                return [run for ranks in runs["vanished"].values() for run in ranks]

            def rnn_on_host_b():
                rnn = start("rpc_rnn_model_parallel.py", netns=host_b)
                watch_listening(rnn, host_b, runs)
                return rnn

            cases.append((sum(size for _, size, *_ in VANISHING), case("vanishing", vanishing, vanish)))
        # The longest first, the runs that only wait among them, then those that a test acts on.
        cases.append((2, case("rl slow", by_hand(([slow, "--rank=0", *slow_port], {"timeout": 60}),
                                                 ([slow, "--rank=1", *slow_port], {"timeout": SLOW / 2})))))
        if not isinstance(pair, str):
            cases.append((3, case("rnn", rnn_on_host_b)))
        else:
            cases.append((3, case("rnn", lambda: start("rpc_rnn_model_parallel.py"))))
        if not isinstance(torchrun_pair, str):
            hosts, addrs = torchrun_pair
            endpoint = f"{addrs[0]}:{free_port()}"
            runs["torchrun addrs"] = addrs
            cases.append((4, case("torchrun", lambda: [  # an agent and its rank on each
                start("rpc_rnn_model_parallel.py", "--epochs=2", "--ifname", "v" + host[3:], netns=host,
                      python_args=torchrun(addr, endpoint, 1))
                for host, addr in zip(hosts, addrs)])))
        cases += [
            (2, case("rnn ranks", by_hand(
                (["rpc_rnn_model_parallel.py", "--rank=0", *rnn_at], {"timeout": None}),
                (["rpc_rnn_model_parallel.py", "--rank=1", *rnn_at], {"timeout": None, "late": 2})))),
            (2, case("bps ranks", lambda: ranks("rpc_batch_parameter_server.py", 2, "--batches", 10 ** 7,
                                                env=LIVE), kill_trainer)),
            (2, case("brl ranks", lambda: ranks("rpc_batch_cartpole.py", 2, "--num_episode", 10 ** 7, BATCH_RL[1],
                                                env=LIVE), kill_observer)),
            (2, case("sizes", by_hand(
                (["rpc_rl_cartpole.py", "--rank=0", "--world_size=2", *sizes], {"timeout": SIZES_TIMEOUT}),
                (["rpc_rl_cartpole.py", "--rank=1", "--world_size=3", *sizes], {"timeout": SIZES_TIMEOUT})))),
            (3, case("ps sizes", by_hand(  # rank 1's terminal forgot --world_size
                (["rpc_parameter_server.py", "--rank=0", "--world_size=3", *ps_sizes], {"timeout": SIZES_TIMEOUT}),
                (["rpc_parameter_server.py", "--rank=1", *ps_sizes], {"timeout": SIZES_TIMEOUT}),
                (["rpc_parameter_server.py", "--rank=2", "--world_size=3", *ps_sizes], {"timeout": SIZES_TIMEOUT})))),
            # Runs that need no one to act on them, the longest first.
            (5, case("ps workers", lambda: start(changed_copy(
                tmp_path_factory.mktemp("workers"), "rpc_parameter_server.py", "shuffle=True)\n    test_loader",
                "shuffle=True, num_workers=2)\n    test_loader"), "--world_size=2", *ps_flags))),
            (5, case("ddp 4", lambda: start("ddp_rpc_hybrid.py", "--world_size=4", f"--epochs={DDP_EPOCHS}"))),
            (4, case("copy", lambda: start(ROOT / "tests" / "learner.py", free_port(), tiny_mnist, timeout=None))),
            (4, case("ps", lambda: start("rpc_parameter_server.py", "--world_size=3", f"--data_dir={tiny_mnist}"))),
            (3, case("rl", lambda: start("rpc_rl_cartpole.py", "--world_size=2", f"--max_episodes={RL_EPISODES}",
                                         "--log_interval=1"))),
            (4, case("ddp 3", lambda: start("ddp_rpc_hybrid.py", "--world_size=3", f"--epochs={DDP_EPOCHS}"))),
            (4, case("bps 3", lambda: start("rpc_batch_parameter_server.py", "--world_size=3", *BATCHES))),
            (4, case("brl 3", lambda: start("rpc_batch_cartpole.py", "--world_size=3", "--no-batch", *BATCH_RL))),
            (3, case("bps 2", lambda: start("rpc_batch_parameter_server.py", "--world_size=2", *BATCHES))),
            (3, case("brl 2", lambda: start("rpc_batch_cartpole.py", "--world_size=2", *BATCH_RL))),
            (2, case("scripts", lambda: [start("rpc_rnn_model_parallel.py", "--rank=0", "--master_port", scripts_port),
                                         start("rpc_rl_cartpole.py", "--rank=1", "--master_port", scripts_port)])),
            (2, case("ps ranks", lambda: ranks("rpc_parameter_server.py", 2, "--data_dir", tiny_mnist))),
            (2, case("rl ranks", lambda: ranks("rpc_rl_cartpole.py", 2, "--max_episodes=5", "--log_interval=1"))),
        ]
        try:
            side_by_side(cases)
            yield runs
        finally:
            stop_all(started)
