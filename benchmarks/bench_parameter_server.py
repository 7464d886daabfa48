"""The parameter server, run as the README tells a user, against the same model trained in one process.

    python benchmarks/bench_parameter_server.py --data_dir DIR [--rounds 3] [--threads 1]

--data_dir is an MNIST root (it holds MNIST/raw/), as the script takes it. Each round runs, one after the other:

1. one process: this file's plain loop in a fresh process with torch's defaults, the loop a user would write:
   the script's Net, the training images in the order the script's trainer draws them, batch 32, SGD lr 0.03,
   one epoch, then accuracy on the test images. Alone:
       python benchmarks/bench_parameter_server.py --single --data_dir DIR
2. the parameter server at world size 2, one process per rank as a user starts them in two terminals:
       python rpc_parameter_server.py --world_size=2 --rank=0 --master_port=PORT --data_dir=DIR ...
       python rpc_parameter_server.py --world_size=2 --rank=1 --master_port=PORT --data_dir=DIR ...
   on a free port, with the shell's environment. ms per batch and accuracy are the trainer's own Summary line.

--threads 1 sets OMP_NUM_THREADS=1 for every process of both sides. Prints one line per round, then the machine
and the medians as key=value pairs; exit status 1 if a run fails.
"""
import os
import statistics
import sys
import time

from common import fields, free_port, machine, parser, python, rounds, run_together, shown, spread

TRAINER = 1  # the only trainer at world size 2


def single(args):
    """The plain loop in this process; prints one `Single:` line."""
    import torch
    import torch.nn.functional as F
    from torchvision import datasets, transforms

    from rpc_parameter_server import Net

    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])
    train = datasets.MNIST(args.data_dir, train=True, download=False, transform=transform)
    test = datasets.MNIST(args.data_dir, train=False, download=False, transform=transform)
    shuffle = torch.Generator().manual_seed(args.seed + TRAINER)  # the order in which the script's trainer draws
    train_loader = torch.utils.data.DataLoader(train, batch_size=32, shuffle=True, generator=shuffle)
    test_loader = torch.utils.data.DataLoader(test, batch_size=32)
    torch.manual_seed(args.seed)  # as the script's rank 0, which builds the Net
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.03)
    model.train()
    start = time.perf_counter()
    for data, target in train_loader:
        opt.zero_grad()
        F.nll_loss(model(data), target).backward()
        opt.step()
    seconds = time.perf_counter() - start
    model.eval()
    with torch.no_grad():
        correct = sum(model(data).argmax(dim=1).eq(target).sum().item() for data, target in test_loader)
    print(f"Single: batches={len(train_loader)} seconds={seconds:.2f} "
          f"ms_per_batch={1000 * seconds / len(train_loader):.1f} accuracy={correct / len(test):.4f} "
          f"torch={torch.__version__} intra_op_threads={torch.get_num_threads()}", flush=True)


def main():
    p = parser(__doc__.splitlines()[0], "one process, parameter server")
    p.add_argument("--data_dir", required=True, help="an MNIST root (holds MNIST/raw/), as the script's")
    p.add_argument("--single", action="store_true", help="run only the one-process loop, here, and print it")
    args = p.parse_args()
    args.data_dir = os.path.abspath(args.data_dir)
    if args.single:
        return single(args)
    samples = [f"--seed={args.seed}"]

    def one_round(n):
        one = python("benchmarks/bench_parameter_server.py", "--single", f"--data_dir={args.data_dir}", *samples)
        got = fields(run_together([one], args)[0], "Single:")
        with free_port() as port:
            ranks = [python("rpc_parameter_server.py", "--world_size=2", f"--rank={rank}", f"--master_port={port}",
                            f"--data_dir={args.data_dir}", *samples) for rank in (0, 1)]
            rpc = fields(run_together(ranks, args)[TRAINER], "Summary:")
        if n == 1:
            print(f"# one process: {shown(one)}", *(f"# rank {r}: {shown(c)}" for r, c in enumerate(ranks)), sep="\n")
        single_ms, rpc_ms = float(got["ms_per_batch"]), float(rpc["ms_per_batch"])
        print(f"round={n} single_ms_per_batch={single_ms:.1f} rpc_ms_per_batch={rpc_ms:.1f} "
              f"ratio={rpc_ms / single_ms:.2f} single_accuracy={got['accuracy']} rpc_accuracy={rpc['accuracy']} "
              f"batches={rpc['batches']}", flush=True)
        return single_ms, rpc_ms, got

    results = rounds(args, one_round)
    single_ms, rpc_ms = [r[0] for r in results], [r[1] for r in results]
    print(machine(args, results[0][2]["torch"]), f"single_intra_op_threads={results[0][2]['intra_op_threads']}")
    print(f"bench=parameter_server world_size=2 rounds={args.rounds} threads={args.threads} "
          f"seed={args.seed} "
          f"{spread('single_ms_per_batch', single_ms, 1)} {spread('rpc_ms_per_batch', rpc_ms, 1)} "
          f"ratio_median={statistics.median(r / s for s, r in zip(single_ms, rpc_ms)):.2f} "
          f"ratio_of_medians={statistics.median(rpc_ms) / statistics.median(single_ms):.2f}", flush=True)


if __name__ == "__main__":
    sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the scripts, for --single
    main()
