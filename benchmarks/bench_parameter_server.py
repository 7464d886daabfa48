"""Parameter server over RPC, run as the README tells a user, against the plain loop in one process.

    python benchmarks/bench_parameter_server.py --data_dir DIR --rounds 3

--data_dir is an MNIST root (it holds MNIST/raw/ with the four IDX files), as the script takes it. Each round
runs, one after the other:

1. the single process: this file's plain loop, in a fresh process with torch's defaults. It is the loop a user
   would write: the tutorial's Net (imported from the script), the first --train_samples MNIST training images
   in the script's shuffled order (rank 1's seeded generator), batch 32, SGD lr 0.03, one epoch, then accuracy
   on the first --test_samples test images. It runs on its own too, and prints the same line:

       python benchmarks/bench_parameter_server.py --single --data_dir DIR [--train_samples 8000 --test_samples 2000]

2. RPC: rpc_parameter_server.py at world size 2, one process per rank as a user runs it in two terminals,

       python rpc_parameter_server.py --world_size=2 --rank=0 --master_port=PORT --data_dir=DIR ...
       python rpc_parameter_server.py --world_size=2 --rank=1 --master_port=PORT --data_dir=DIR ...

   on a free port, with the environment of the shell this runs in and nothing added. Each rank runs through
   benchmarks/timed_rank.py, which calls the script's own main() with those arguments and adds clocks: the
   trainer's phases and the server's own forward and backward compute. ms per batch and accuracy are the
   script's own Summary line.

Prints every round, then the machine, the median ms per batch of each phase of both sides (load, forward,
backward, step; RPC also other: the once-per-run gradient check and releasing each autograd context) with the
server's own compute (server_forward within forward, server_backward within backward: the rest is the round
trip), and the medians, ranges and ratio, all as key=value pairs. Exit status 1 if a run fails.

--transports default runs the RPC side with TensorPipe's default transports (shared memory added, which
busy-polls a core per process) instead of the script's TCP only: not what a user runs, for the README's
figures of what TCP costs. Defaults: --rounds 3, --train_samples 8000, --test_samples 2000, --seed 1.
"""
import argparse
import os
import sys
import time

from common import (Failed, add_bench_flags, fields, held_port, machine, median, medians, python, rounds_reported,
                    run_together, same, shown, spread)

SINGLE_PHASES = ("load", "forward", "backward", "step")
RPC_PHASES = SINGLE_PHASES + ("other",)
TRAINER_RANK = 1  # the script's only trainer at world size 2; its shuffled order is the one both sides use


def single(args):
    """The plain single-process loop; prints one `Single:` line of key=value pairs."""
    import torch
    import torch.nn.functional as F
    from torch import optim
    from torchvision import datasets, transforms

    from rpc_parameter_server import Net

    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])
    train_set = datasets.MNIST(args.data_dir, train=True, download=True, transform=transform)
    test_set = datasets.MNIST(args.data_dir, train=False, transform=transform)
    train_set = torch.utils.data.Subset(train_set, range(min(args.train_samples or len(train_set), len(train_set))))
    test_set = torch.utils.data.Subset(test_set, range(min(args.test_samples or len(test_set), len(test_set))))
    generator = torch.Generator().manual_seed(args.seed + TRAINER_RANK)  # the script's trainer shuffles so
    train_loader = torch.utils.data.DataLoader(train_set, batch_size=32, shuffle=True, generator=generator)
    test_loader = torch.utils.data.DataLoader(test_set, batch_size=32)

    torch.manual_seed(args.seed)  # what the script's rank 0, which builds the Net, seeds
    model = Net()
    opt = optim.SGD(model.parameters(), lr=0.03)
    model.train()
    totals = dict.fromkeys(SINGLE_PHASES, 0.0)
    start = last = time.perf_counter()
    for data, target in train_loader:
        now = time.perf_counter()
        totals["load"] += now - last
        opt.zero_grad()
        loss = F.nll_loss(model(data), target)
        last, now = now, time.perf_counter()
        totals["forward"] += now - last
        loss.backward()
        last, now = now, time.perf_counter()
        totals["backward"] += now - last
        opt.step()
        last = time.perf_counter()
        totals["step"] += last - now
    seconds = time.perf_counter() - start
    totals["load"] += seconds - sum(totals.values())  # the last, empty fetch

    model.eval()
    correct = 0
    with torch.no_grad():
        for data, target in test_loader:
            correct += model(data).argmax(dim=1).eq(target).sum().item()
    batches = len(train_loader)
    print(f"Single: batches={batches} seconds={seconds:.3f} ms_per_batch={1000 * seconds / batches:.2f} "
          + " ".join(f"{phase}_ms={1000 * total / batches:.2f}" for phase, total in totals.items())
          + f" accuracy={correct / len(test_set):.4f} torch={torch.__version__} "
            f"intra_op_threads={torch.get_num_threads()}", flush=True)


def single_round(bench):
    command = python("benchmarks/bench_parameter_server.py", "--single", "--data_dir", bench.data_dir,
                     "--train_samples", bench.train_samples, "--test_samples", bench.test_samples,
                     "--seed", bench.seed)
    got = fields(run_together([command], bench.limit)[0], "Single:")
    result = {phase: float(got[f"{phase}_ms"]) for phase in SINGLE_PHASES}
    result.update(ms_per_batch=float(got["ms_per_batch"]), accuracy=got["accuracy"], batches=int(got["batches"]),
                  torch=got["torch"], intra_op_threads=got["intra_op_threads"])
    return result, command


def rpc_round(bench):
    with held_port() as port:
        flags = ["--world_size=2", f"--master_port={port}", f"--data_dir={bench.data_dir}", f"--seed={bench.seed}",
                 f"--train_samples={bench.train_samples}", f"--test_samples={bench.test_samples}"]
        commands = [python("benchmarks/timed_rank.py", *bench.wrapper_flags, "rpc_parameter_server.py",
                           f"--rank={rank}", *flags) for rank in (0, 1)]
        server_out, trainer_out = run_together(commands, bench.limit)
    summary, trainer = fields(trainer_out, "Summary:"), fields(trainer_out, "Timed:")
    server = fields(server_out, "Timed:")
    batches = int(summary["batches"])
    if int(server["forwards"]) != batches or int(server["backwards"]) != batches:
        raise Failed(f"the server timed {server['forwards']} forward and {server['backwards']} backward passes "
                     f"for {batches} batches")
    result = {phase: 1000 * float(trainer.get(f"{phase}_s", 0)) / batches for phase in RPC_PHASES}
    result.update(ms_per_batch=float(summary["ms_per_batch"]), summary_ms=1000 * float(summary["seconds"]) / batches,
                  accuracy=summary["accuracy"], batches=batches,
                  server_forward=1000 * float(server["forward_s"]) / batches,
                  server_backward=1000 * float(server["backward_s"]) / batches)
    result["phase_sum"] = sum(result[phase] for phase in RPC_PHASES)
    return result, commands


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--data_dir", default="./data", help="an MNIST root (holds MNIST/raw/), as the script's")
    parser.add_argument("--train_samples", type=int, default=8000, help="first N training images (0: all)")
    parser.add_argument("--test_samples", type=int, default=2000, help="first N test images (0: all)")
    add_bench_flags(parser, "single process, RPC")
    bench = parser.parse_args(argv)
    if bench.rounds < 1 or bench.train_samples < 0 or bench.test_samples < 0:
        parser.error("--rounds must be at least 1, and the sample counts 0 (all) or more")
    bench.data_dir = os.path.abspath(bench.data_dir)  # the same folder for every process, wherever it runs
    if bench.single:
        return single(bench)
    bench.wrapper_flags = ["--transports=default"] * (bench.transports == "default")

    singles, rpcs = [], []
    with rounds_reported(rpcs):
        for n in range(1, bench.rounds + 1):  # alternating, so that a busy spell on the machine hits both sides
            result, command = single_round(bench)
            singles.append(result)
            result, commands = rpc_round(bench)
            rpcs.append(result)
            if n == 1:
                print(f"# single: {shown(command)}", f"# rpc rank 0: {shown(commands[0])}",
                      f"# rpc rank 1: {shown(commands[1])}", sep="\n")
            single_ms, rpc_ms = singles[-1]["ms_per_batch"], rpcs[-1]["ms_per_batch"]
            print(f"round={n} single_ms_per_batch={single_ms:.1f} rpc_ms_per_batch={rpc_ms:.1f} "
                  f"ratio={rpc_ms / single_ms:.2f} single_accuracy={singles[-1]['accuracy']} "
                  f"rpc_accuracy={rpcs[-1]['accuracy']} rpc_phase_sum_ms={rpcs[-1]['phase_sum']:.1f} "
                  f"rpc_summary_ms={rpcs[-1]['summary_ms']:.1f}", flush=True)

    single_ms, rpc_ms = [r["ms_per_batch"] for r in singles], [r["ms_per_batch"] for r in rpcs]
    print(machine(singles[0]["torch"]), f"single_intra_op_threads={singles[0]['intra_op_threads']}")
    print("phase_ms_per_batch=median", medians("single", singles, SINGLE_PHASES, 1),
          medians("rpc", rpcs, RPC_PHASES, 1), medians("rpc", rpcs, ("phase_sum", "summary_ms"), 1))
    print("server_ms_per_batch=median", medians("rpc", rpcs, ("server_forward", "server_backward"), 1),
          "rpc_forward_outside_server={:.1f} rpc_backward_outside_server={:.1f}".format(
              median([r["forward"] - r["server_forward"] for r in rpcs]),
              median([r["backward"] - r["server_backward"] for r in rpcs])))
    worst = max(abs(r["phase_sum"] / r["summary_ms"] - 1) for r in rpcs)
    print(f"bench=parameter_server world_size=2 rounds={bench.rounds} batches={same([r['batches'] for r in rpcs])} "
          f"train_samples={bench.train_samples} test_samples={bench.test_samples} seed={bench.seed} "
          f"transports={bench.transports} "
          f"{spread('single_ms_per_batch', single_ms, 1)} {spread('rpc_ms_per_batch', rpc_ms, 1)} "
          f"ratio={median(rpc_ms) / median(single_ms):.2f} single_accuracy={same([r['accuracy'] for r in singles])} "
          f"rpc_accuracy={same([r['accuracy'] for r in rpcs])} rpc_phases_vs_summary_worst={100 * worst:.1f}%",
          flush=True)
    if worst > 0.05:
        print(f"warning: the trainer's phases differ from its Summary by {100 * worst:.1f}% in a round",
              file=sys.stderr)


if __name__ == "__main__":
    sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the scripts, for --single
    main()
