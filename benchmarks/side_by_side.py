"""Several one-command runs of one script started together: does any starve the others?

Starts --runs launchers of the script at the same moment, as a user with two
terminals or a CI runner would, and times how long each takes to print its
first training line; then stops them all (Ctrl-C, as a user would) and starts
the next round. Prints one `round=N` line per round and a last `bench=` line
with the worst run of each round, all as key=value pairs.

    python benchmarks/side_by_side.py rpc_rnn_model_parallel.py --runs 3
    python benchmarks/side_by_side.py rpc_rl_cartpole.py --runs 3 -- --world_size=3
    python benchmarks/side_by_side.py ddp_rpc_hybrid.py --runs 2
"""
import argparse
import os
import signal
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Each script's first training line, and flags that keep it training until the round ends.
FIRST_LINE = {
    "rpc_rnn_model_parallel.py": ("Training epoch 0 loss", ["--epochs=100000"]),
    "rpc_rl_cartpole.py": ("Episode 1\t", ["--log_interval=1"]),
    "ddp_rpc_hybrid.py": ("Training done for epoch 0", ["--epochs=100000"]),
    "rpc_parameter_server.py": ("training batch 0 ", ["--epochs=100"]),
}


def one_round(script, extra, runs, limit):
    """Seconds from the common start to each run's first training line (None: not within limit)."""
    text, flags = FIRST_LINE[script]
    command = [sys.executable, os.path.join(ROOT, script), *flags, *extra]
    start = time.monotonic()
    procs = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                              start_new_session=True) for _ in range(runs)]
    seen = [None] * runs

    def read(i):
        for line in procs[i].stdout:
            if seen[i] is None and text in line:
                seen[i] = time.monotonic() - start

    readers = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(runs)]
    for reader in readers:
        reader.start()
    try:
        while None in seen and time.monotonic() - start < limit and any(p.poll() is None for p in procs):
            time.sleep(0.05)
    finally:
        for proc in procs:  # Ctrl-C to each run's whole process group, then no mercy
            try:
                os.killpg(proc.pid, signal.SIGINT)
            except ProcessLookupError:
                pass
        for proc in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return seen


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], usage="%(prog)s SCRIPT [options] [-- script flags]")
    parser.add_argument("script", choices=sorted(FIRST_LINE))
    parser.add_argument("--runs", type=int, default=3, help="one-command runs started together")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--limit", type=float, default=60.0, help="seconds a run may take to its first line")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)  # what follows -- is the script's
    args = parser.parse_args(argv[:cut])
    args.extra = argv[cut + 1:]
    worst = []
    for n in range(1, args.rounds + 1):
        seen = one_round(args.script, args.extra, args.runs, args.limit)
        shown = ",".join("missed" if s is None else f"{s:.1f}" for s in seen)
        worst.append(max(args.limit if s is None else s for s in seen))
        missed = sum(s is None for s in seen)
        print(f"round={n} script={args.script} runs={args.runs} seconds_to_first_line={shown} "
              f"worst={worst[-1]:.1f} missed={missed}", flush=True)
    print(f"bench=side_by_side script={args.script} runs={args.runs} rounds={args.rounds} "
          f"extra={' '.join(args.extra) or 'none'} worst_per_round={','.join(f'{w:.1f}' for w in worst)} "
          f"worst={max(worst):.1f} cores={len(os.sched_getaffinity(0))}")


if __name__ == "__main__":
    main()
