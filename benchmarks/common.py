"""What the benchmarks share: a clock per phase, RPC rounds in spawned processes, the printed figures."""
import contextlib
import os
import platform
import socket
import statistics
import sys
import tempfile
import threading
import time
import warnings

import torch
import torch.multiprocessing as mp


class PhaseClock:
    """Adds the time since the previous mark to the named phase, so the phases sum to the whole."""

    def __init__(self):
        self.totals = {}
        self.restart()

    def restart(self):
        self.last = time.perf_counter()

    def mark(self, phase):
        now = time.perf_counter()
        self.totals[phase] = self.totals.get(phase, 0.0) + now - self.last
        self.last = now


def free_port():
    """A port the OS says is free, so that no round meets another's group."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def captured_stdout():
    """Send stdout (print and os.write alike) to a file for the block; yields a function that reads it."""
    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile("a+") as file:  # append mode: reading it back never moves where lines go
        os.dup2(file.fileno(), 1)

        def read():
            sys.stdout.flush()
            file.seek(0)
            return file.read()

        try:
            yield read
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)


# What the scripts' one-command launcher adds to the environment of the ranks it spawns (README, "Speed").
LAUNCHER_ENV = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_THRESHOLD_": "33554432", "MALLOC_TRIM_THRESHOLD_": "268435456"}


def add_rank_env_flag(parser):
    parser.add_argument("--rank_env", choices=["launcher", "none"], default="launcher",
                        help="environment of the RPC ranks: the launcher's malloc settings, or none added")


def run_rpc_round(rank_fn, args, nprocs=2, rank_env="launcher"):
    """Run rank_fn(rank, args) in nprocs spawned processes; return the union of the dicts they return."""
    if rank_env == "launcher":  # read by glibc when a rank starts, so this process itself is left as it was
        os.environ.update(LAUNCHER_ENV)
    queue = mp.get_context("spawn").SimpleQueue()
    procs = mp.start_processes(_child, args=(rank_fn, args, queue, os.getpid()), nprocs=nprocs,
                               join=False, start_method="spawn")
    try:
        while not procs.join(grace_period=5):  # a failed rank: the others get 5 s to report, then are killed
            pass
    finally:
        for proc in procs.processes:  # interrupted or failed: no rank outlives the benchmark
            if proc.is_alive():
                proc.kill()
            proc.join()
    results = {}
    while not queue.empty():
        results.update(queue.get())
    return results


def _child(rank, rank_fn, args, queue, parent_pid):
    def exit_with_parent():  # a parent killed outright cannot stop its ranks; they stop themselves
        while os.getppid() == parent_pid:
            time.sleep(1)
        os._exit(1)

    threading.Thread(target=exit_with_parent, daemon=True).start()
    with warnings.catch_warnings():  # as the scripts' own _rank_main: rpc's use of a gloo Backend, not ours to fix
        warnings.filterwarnings("ignore", message="You are using a Backend .* as a ProcessGroup")
        queue.put(rank_fn(rank, args))


def machine():
    """Where the figures come from; call it after the last round (it may initialise CUDA)."""
    gpu = torch.cuda.get_device_name(0).replace(" ", "_") if torch.cuda.is_available() else "none"
    return (f"cores={len(os.sched_getaffinity(0))} intra_op_threads={torch.get_num_threads()} "
            f"torch={torch.__version__} python={platform.python_version()} gpu={gpu}")


def spread(name, values, digits):
    """name's median, range (min-max) and every round's figure, as key=value pairs."""
    def fmt(value):
        return f"{value:.{digits}f}"

    return (f"{name}_median={fmt(statistics.median(values))} {name}_range={fmt(min(values))}-{fmt(max(values))} "
            f"{name}_rounds={','.join(map(fmt, values))}")


def phase_medians(side, rounds, phases, digits):
    """Each phase's median over the rounds, as side_phase=value pairs."""
    return " ".join(f"{side}_{phase}={statistics.median(r.get(phase, 0.0) for r in rounds):.{digits}f}"
                    for phase in phases)


def same(values):
    """One value where all rounds agree, else every round's."""
    return values[0] if len(set(values)) == 1 else ",".join(map(str, values))
