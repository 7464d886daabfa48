"""Parameter server over RPC vs. the same Net trained in one process.

Both train one epoch on the real MNIST digits (8000 train / 2000 test, split
from ../shared/data/mnist_t10k), batch 32, SGD lr 0.03, and are measured in
this one invocation. Prints one line of key=value pairs; ratio is the RPC
run's ms per batch over the single-process one.

    python benchmarks/bench_parameter_server.py [--seed 0] [--world_size 2]
"""
import argparse
import contextlib
import io
import os
import re
import socket
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.join(os.path.dirname(ROOT), "shared")
sys.path.insert(0, ROOT)
import rpc_parameter_server as ps  # noqa: E402


def single_process(args):
    """The tutorial's Net, data and optimizer, with no RPC in between."""
    torch.manual_seed(args.seed)
    with contextlib.redirect_stdout(io.StringIO()):  # Net's "Putting ... on cpu" lines
        model = ps.Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.03)
    train_loader, test_loader = ps.load_mnist(args, rank=1)
    model.train()
    start = time.perf_counter()
    for data, target in train_loader:
        opt.zero_grad()
        F.nll_loss(model(data), target).backward()
        opt.step()
    ms_per_batch = 1000 * (time.perf_counter() - start) / len(train_loader)
    model.eval()
    with torch.no_grad():
        correct = sum((model(d).argmax(1) == t).sum().item() for d, t in test_loader)
    return ms_per_batch, correct / len(test_loader.dataset)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--world_size", type=int, default=2)
    parser.add_argument("--data_dir", default=None, help="an MNIST root; default: built from ../shared/data/mnist_t10k")
    parser.add_argument("--repeats", type=int, default=2, help="rounds of (single, RPC); each side keeps its fastest")
    bench = parser.parse_args()

    data_dir = bench.data_dir or tempfile.mkdtemp(prefix="mnist_real_")
    if bench.data_dir is None:
        subprocess.run([sys.executable, os.path.join(SHARED, "tools", "mnist_root.py"),
                        os.path.join(SHARED, "data", "mnist_t10k"), data_dir, "8000"],
                       check=True, stdout=subprocess.DEVNULL)
    flags = ["--data_dir", data_dir, "--no-download", "--seed", str(bench.seed)]
    args = ps.parse_args(flags)
    singles, runs = [], []
    for _ in range(bench.repeats):  # alternate the two, so a busy spell on the machine hits both
        singles.append(single_process(args))
        runs.append(rpc_run(bench, flags))
    base_ms, base_acc = min(singles)
    fields = min(runs, key=lambda f: float(f["ms_per_batch"]))
    rpc_ms = float(fields["ms_per_batch"])
    print(f"bench=parameter_server world_size={bench.world_size} seed={bench.seed} repeats={bench.repeats} "
          f"single_ms_per_batch={base_ms:.1f} rpc_ms_per_batch={rpc_ms:.1f} ratio={rpc_ms / base_ms:.2f} "
          f"single_accuracy={base_acc:.4f} accuracy={fields['accuracy']} target_ratio<=1.5 target_accuracy>=0.91")


def rpc_run(bench, flags):
    """One run of the script as a user would start it; returns its Summary fields."""
    with tempfile.TemporaryDirectory() as tmp:
        with socket.socket() as sock:  # a port the OS says is free, not a fixed one
            sock.bind(("127.0.0.1", 0))
            port = str(sock.getsockname()[1])
        out = subprocess.run(
            [sys.executable, os.path.join(ROOT, "rpc_parameter_server.py"), "--world_size", str(bench.world_size),
             "--master_port", port, *flags], cwd=tmp, capture_output=True, text=True, timeout=1800)
    summaries = re.findall(r"^Summary: (.*)$", out.stdout, re.M)
    if out.returncode != 0 or not summaries:
        sys.exit(f"RPC run failed (exit {out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return dict(kv.split("=") for kv in summaries[0].split())


if __name__ == "__main__":
    main()
