"""What the benchmarks share: a clock per phase, commands run side by side, key=value lines read and printed.

Nothing here imports torch: the process that drives a benchmark only starts, waits and reads; every figure
comes from a fresh process of its own.
"""
import contextlib
import os
import platform
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)  # the scripts' folder: every command runs there, as a user's would


class PhaseClock:
    """Adds the time since the previous mark to the named phase, so that the phases sum to the whole."""

    def __init__(self):
        self.totals = {}
        self.restart()

    def restart(self):
        self.last = time.perf_counter()

    def mark(self, phase):
        now = time.perf_counter()
        self.totals[phase] = self.totals.get(phase, 0.0) + now - self.last
        self.last = now


class Failed(Exception):
    """A command of a round failed; the message says which and how, with the end of what it printed."""


@contextlib.contextmanager
def held_port():
    """A free port for rank 0, held until the block ends, as the scripts' own one-command launcher holds it:
    bound on every address and never listening, so the OS gives it to no one else while rank 0 can still listen."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("", 0))
        yield sock.getsockname()[1]


def python(*args):
    """A command line as a user types it in the scripts' folder: `python ARGS...` (this interpreter)."""
    return [sys.executable, *map(str, args)]


def shown(command):
    """A command as it reads in a terminal, `python` for this interpreter."""
    return shlex.join(["python", *command[1:]])


def run_together(commands, limit, grace=10.0):
    """Start every command at once in the scripts' folder, with this process's environment unchanged (nothing
    added), each with its own output files (as a terminal each); wait until all have ended. Returns what each
    printed on stdout. If one fails, the others get `grace` seconds to end, then are killed; nothing outlives
    this call. Raises Failed with the failing command's stderr."""
    with contextlib.ExitStack() as stack:
        outs = [stack.enter_context(tempfile.TemporaryFile("w+")) for _ in commands]
        errs = [stack.enter_context(tempfile.TemporaryFile("w+")) for _ in commands]
        procs = []
        try:
            for command, out, err in zip(commands, outs, errs):
                procs.append(subprocess.Popen(command, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=out, stderr=err))
            start, failed_at = time.monotonic(), None
            while any(proc.poll() is None for proc in procs):
                now = time.monotonic()
                if failed_at is None and any(proc.returncode not in (None, 0) for proc in procs):
                    failed_at = now
                if now - start > limit or failed_at is not None and now - failed_at > grace:
                    break
                time.sleep(0.05)
        finally:
            for proc in procs:  # by their own pids: interrupted, failed or over the limit, none outlives us
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
        texts = []
        for out in outs:
            out.seek(0)
            texts.append(out.read())
        for command, proc, err in zip(commands, procs, errs):
            if proc.returncode != 0:
                err.seek(0)
                tail = "\n".join(err.read().strip().splitlines()[-5:]) or "(nothing on stderr)"
                how = f"exit status {proc.returncode}" if proc.returncode > 0 else f"signal {-proc.returncode}"
                late = f" (killed after --limit {limit:g} s)" if time.monotonic() - start > limit else ""
                raise Failed(f"`{shown(command)}` ended with {how}{late}:\n{tail}")
        return texts


def fields(text, prefix):
    """The key=value pairs of the last line of text that starts with prefix (e.g. 'Summary:'), as a dict."""
    lines = [line for line in text.splitlines() if line.startswith(prefix)]
    if not lines:
        raise Failed(f"no line starting {prefix!r} in:\n" + "\n".join(text.strip().splitlines()[-5:]))
    return dict(pair.split("=", 1) for pair in lines[-1][len(prefix):].split() if "=" in pair)


# Variables that change how fast torch, glibc or TensorPipe run. The scripts' README asks for none of them, so
# a figure taken with any set is not what a user gets; the benchmark passes the environment through and says so.
SPEED_ENV = re.compile(r"^(MALLOC_\w+|LD_PRELOAD|OMP_\w+|GOMP_\w+|KMP_\w+|MKL_\w+|OPENBLAS_\w+|TP_\w+|"
                       r"ATEN_\w+|TORCH_\w*THREADS\w*|PYTORCH_\w+)$")


def machine(torch_version):
    """Where the figures come from, as key=value pairs."""
    cpu = "unknown"
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as info:
            names = re.findall(r"^model name\s*:\s*(.*)$", info.read(), re.M)
            cpu = names[0].strip().replace(" ", "_") if names else cpu
    speed_env = ",".join(sorted(name for name in os.environ if SPEED_ENV.match(name))) or "none"
    load = os.getloadavg()[0]
    return (f"cores={len(os.sched_getaffinity(0))} cpu={cpu} torch={torch_version} "
            f"python={platform.python_version()} load_average_1min={load:.2f} speed_env={speed_env}")


def median(values):
    return statistics.median(values)


def spread(name, values, digits):
    """name's median and range (min-max) over the rounds, as key=value pairs."""
    def fmt(value):
        return f"{value:.{digits}f}"

    return f"{name}_median={fmt(median(values))} {name}_range={fmt(min(values))}-{fmt(max(values))}"


def medians(side, rounds, keys, digits):
    """Each key's median over the rounds (dicts of floats), as side_key=value pairs."""
    return " ".join(f"{side}_{key}={median([r[key] for r in rounds]):.{digits}f}" for key in keys)


def same(values):
    """One value where all rounds agree, else every round's, comma-separated."""
    return values[0] if len(set(values)) == 1 else ",".join(map(str, values))


def add_bench_flags(parser, sides):
    """The flags both benchmarks take; sides names what one round runs, e.g. "single process, RPC"."""
    parser.add_argument("--rounds", type=int, default=3, help=f"alternating rounds of ({sides})")
    parser.add_argument("--seed", type=int, default=1, help="the script's --seed")
    parser.add_argument("--transports", choices=("script", "default"), default="script",
                        help="RPC side: the script's TCP only, or TensorPipe's defaults (not what a user runs)")
    parser.add_argument("--limit", type=float, default=600, help="seconds one side of a round may take")
    parser.add_argument("--single", action="store_true", help="run only the single-process loop, once, and print it")


@contextlib.contextmanager
def rounds_reported(done):
    """Around the rounds: a failed round, Ctrl-C or `kill` ends the benchmark with one line (run_together has
    already ended every process of the round); done is the list of finished rounds."""
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # `kill` ends the round's processes as Ctrl-C does
    try:
        yield
    except Failed as exc:
        sys.exit(f"Round {len(done) + 1} failed: {exc}")
    except KeyboardInterrupt:
        sys.exit(f"Interrupted in round {len(done) + 1}.")
