"""Several one-command runs of one script started together: does any starve the others?

Starts --runs one-command runs of the script at the same moment (`python SCRIPT [flags]`, no --rank: each
starts its own ranks with torch.multiprocessing on a free port), as a user with several terminals or a CI
runner would, and times how long each takes to print its first training line; then stops them all with
Ctrl-C (SIGINT to each run's process group, as a terminal sends it) and starts the next round. Prints one
`round=N` line per round and a last `bench=` line with the slowest run of each round, all as key=value pairs.
The bar (issue 26): on 2 cores every run reaches its first training line within 30 s (45 s for DDP).

    python benchmarks/side_by_side.py rpc_rnn_model_parallel.py --runs 3
    python benchmarks/side_by_side.py rpc_rl_cartpole.py --runs 3 -- --world_size=3
    python benchmarks/side_by_side.py ddp_rpc_hybrid.py --runs 2
    python benchmarks/side_by_side.py rpc_parameter_server.py --runs 2 -- --world_size=3 --data_dir=DIR

What follows `--` goes to every run of the script (the parameter server needs an MNIST root in --data_dir).
"""
import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

from common import ROOT, python

# Each script's first training line, as it prints it, and flags that keep it training until the round ends.
FIRST_LINE = {
    "rpc_rnn_model_parallel.py": ("Training epoch 0 loss ", ["--epochs=100000"]),
    "rpc_rl_cartpole.py": ("Episode 1\tLast reward: ", ["--log_interval=1"]),
    "ddp_rpc_hybrid.py": ("Training done for epoch 0 loss ", ["--epochs=100000"]),
    "rpc_parameter_server.py": (" training batch 0 loss ", ["--epochs=100"]),
}


def one_round(script, extra, runs, limit):
    """Seconds from the common start to each run's first training line (None: not within limit), and for each
    run that ended without it, the last line of its stderr."""
    text, flags = FIRST_LINE[script]
    command = python(script, *flags, *extra)
    errs = [tempfile.TemporaryFile("w+") for _ in range(runs)]
    start = time.monotonic()
    procs = [subprocess.Popen(command, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err,
                              text=True, start_new_session=True) for err in errs]
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
        for proc in procs:  # Ctrl-C to each run's own process group, then no mercy
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
        for reader in readers:
            reader.join(5)
    why = []
    for i, err in enumerate(errs):
        err.seek(0)
        lines = err.read().strip().splitlines()
        if seen[i] is None and procs[i].returncode not in (None, 130, -signal.SIGINT):
            named = [line for line in lines if line.startswith("Error on rank")] or lines[-1:] or ["(no stderr)"]
            why.append(f"run {i + 1} ended with status {procs[i].returncode}: {named[0]}")
        err.close()
    return seen, why


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     usage="%(prog)s SCRIPT [options] [-- script flags]")
    parser.add_argument("script", choices=sorted(FIRST_LINE))
    parser.add_argument("--runs", type=int, default=3, help="one-command runs started together")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--limit", type=float, default=60.0, help="seconds a run may take to its first line")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)  # what follows -- is the script's
    args = parser.parse_args(argv[:cut])
    args.extra = argv[cut + 1:]
    if args.runs < 1 or args.rounds < 1:
        parser.error("--runs and --rounds must be at least 1")
    worst = []
    for n in range(1, args.rounds + 1):
        seen, why = one_round(args.script, args.extra, args.runs, args.limit)
        for line in why:
            print(line, file=sys.stderr)
        shown = ",".join("missed" if s is None else f"{s:.1f}" for s in seen)
        worst.append(max(args.limit if s is None else s for s in seen))
        missed = sum(s is None for s in seen)
        print(f"round={n} script={args.script} runs={args.runs} seconds_to_first_line={shown} "
              f"worst={worst[-1]:.1f} missed={missed}", flush=True)
    print(f"bench=side_by_side script={args.script} runs={args.runs} rounds={args.rounds} "
          f"extra={','.join(args.extra) or 'none'} worst_per_round={','.join(f'{w:.1f}' for w in worst)} "
          f"worst={max(worst):.1f} cores={len(os.sched_getaffinity(0))} load_average_1min={os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
