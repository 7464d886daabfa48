"""What the benchmarks share: fresh processes run side by side, their key=value lines read, rounds summed up.

Nothing here imports torch or a script: the process that drives a benchmark only starts, waits and reads.
"""
import argparse
import contextlib
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # every command runs there, as a user's


class Failed(Exception):
    """A command of a round failed; the message says which, how, and the end of its stderr."""


def parser(description, sides):
    """The flags every benchmark takes; sides names what one round runs."""
    p = argparse.ArgumentParser(description=description, allow_abbrev=False)
    p.add_argument("--rounds", type=int, default=3, help=f"alternating rounds of ({sides}); the median is printed")
    p.add_argument("--threads", choices=("default", "1"), default="default",
                   help="1: OMP_NUM_THREADS=1 for every process of both sides alike, as a user may set it")
    p.add_argument("--seed", type=int, default=1, help="the script's --seed")
    p.add_argument("--limit", type=float, default=900, help="seconds one side of a round may take")
    return p


def environment(args):
    """The shell's environment, plus OMP_NUM_THREADS=1 with --threads 1: nothing else is added."""
    return dict(os.environ, **({"OMP_NUM_THREADS": "1"} if args.threads == "1" else {}))


def python(*args):
    """`python ARGS...` with this interpreter, as a user types it in the scripts' folder."""
    return [sys.executable, *map(str, args)]


def shown(command):
    return " ".join(["python", *command[1:]])


@contextlib.contextmanager
def free_port():
    """A port for rank 0, bound (never listening) until the block ends so that the OS gives it to no one else;
    with SO_REUSEADDR, rank 0 can still listen on it."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("", 0))
        yield sock.getsockname()[1]


def run_together(commands, args):
    """Start every command at once in the scripts' folder, each with its own output (a terminal each), and wait
    for all. Returns their stdout texts. A failure, or --limit, ends every one; raises Failed."""
    with contextlib.ExitStack() as stack:
        outs = [stack.enter_context(tempfile.TemporaryFile("w+")) for _ in commands]
        errs = [stack.enter_context(tempfile.TemporaryFile("w+")) for _ in commands]
        procs, start = [], time.monotonic()
        try:
            for command, out, err in zip(commands, outs, errs):
                procs.append(subprocess.Popen(command, cwd=ROOT, env=environment(args), stdin=subprocess.DEVNULL,
                                              stdout=out, stderr=err))
            while any(p.poll() is None for p in procs) and time.monotonic() - start < args.limit:
                if any(p.returncode not in (None, 0) for p in procs):
                    time.sleep(10)  # the others have time to say why, then end with it
                    break
                time.sleep(0.05)
        finally:
            for p in procs:  # by their own pids: none outlives the round
                if p.poll() is None:
                    p.kill()
                p.wait()
        for command, p, err in zip(commands, procs, errs):
            if p.returncode != 0:
                err.seek(0)
                tail = "\n".join(err.read().strip().splitlines()[-5:]) or "(nothing on stderr)"
                raise Failed(f"`{shown(command)}` ended with status {p.returncode}:\n{tail}")
        texts = []
        for out in outs:
            out.seek(0)
            texts.append(out.read())
        return texts


def fields(text, prefix):
    """The key=value pairs of the last line that starts with prefix (e.g. 'Summary:'), as a dict of strings."""
    lines = [line for line in text.splitlines() if line.startswith(prefix)]
    if not lines:
        raise Failed(f"no line starting {prefix!r} in:\n" + "\n".join(text.strip().splitlines()[-5:]))
    return dict(pair.split("=", 1) for pair in lines[-1][len(prefix):].split() if "=" in pair)


# Variables that change how fast torch or glibc run: the README asks for none, so the machine line names any set.
SPEED_ENV = re.compile(r"^(MALLOC_\w+|LD_PRELOAD|OMP_\w+|GOMP_\w+|KMP_\w+|MKL_\w+|OPENBLAS_\w+|TP_\w+)$")


def machine(args, torch_version):
    cpu = "unknown"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as info:
        cpu = (re.findall(r"^model name\s*:\s*(.*)$", info.read(), re.M) or [cpu])[0].strip().replace(" ", "_")
    speed_env = ",".join(sorted(name for name in environment(args) if SPEED_ENV.match(name))) or "none"
    return (f"cores={len(os.sched_getaffinity(0))} cpu={cpu} torch={torch_version} python={platform.python_version()}"
            f" load_average_1min={os.getloadavg()[0]:.2f} speed_env={speed_env}")


def spread(name, values, digits):
    """name's median and range over the rounds, as key=value pairs."""
    fmt = f"{{:.{digits}f}}".format
    return f"{name}_median={fmt(statistics.median(values))} {name}_range={fmt(min(values))}-{fmt(max(values))}"


def rounds(args, one_round):
    """Calls one_round(n) for each round (it prints its own line); a failure or Ctrl-C ends with one line."""
    results = []
    try:
        for n in range(1, args.rounds + 1):
            results.append(one_round(n))
    except Failed as exc:
        sys.exit(f"Round {len(results) + 1} failed: {exc}")
    except KeyboardInterrupt:
        sys.exit(f"Interrupted in round {len(results) + 1}.")
    return results
