"""The tutorial "Combining Distributed DataParallel with Distributed RPC Framework"
(https://pytorch.org/tutorials/advanced/rpc_ddp_tutorial.html): trainers (ranks 0 to N-3) keep a
layer in sync with DDP and look up a table on the parameter server (N-1); the master (N-2) drives.

    python ddp_rpc_hybrid.py  # every rank; or one terminal each, with --rank=0, 1, 2 and 3
"""
import argparse
import contextlib
import datetime
import fcntl
import logging
import math
import os
import re
import signal
import socket
import sys
import threading
import time
import traceback
import warnings

if __name__ == "__main__" and "--debug" not in sys.argv:  # torch reads it as it loads
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")

import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
import torch.optim as optim
from torch.distributed.nn import RemoteModule
from torch.distributed.optim import DistributedOptimizer
from torch.distributed.rpc import RRef
from torch.nn.parallel import DistributedDataParallel as DDP

NUM_EMBEDDINGS = 100
EMBEDDING_DIM = 16


class HybridModel(torch.nn.Module):
    r"""
    A dense nn.Linear, replicated on all trainers with DDP, and a sparse
    RemoteModule holding an nn.EmbeddingBag on the parameter server.
    """

    def __init__(self, remote_emb_module, device):
        super().__init__()
        self.remote_emb_module = remote_emb_module
        # The tutorial's cuda:device where this host has it, else the CPU.
        if isinstance(device, int) and torch.cuda.device_count() <= device:
            device = "cpu"
        self.device = torch.device(device)
        # No device_ids: DDP takes the module's device, CPU or CUDA.
        self.fc = DDP(torch.nn.Linear(16, 8).to(self.device))

    def forward(self, indices, offsets):
        emb_lookup = self.remote_emb_module.forward(indices, offsets)
        return self.fc(emb_lookup.to(self.device))


# Returns its losses and fc weights, where the tutorial's returns none: the master checks them.
def _run_trainer(remote_emb_module, rank, epochs=100, device=None):  # None: the tutorial's rank
    model = HybridModel(remote_emb_module, rank if device is None else device)

    # Retrieve parameters for embedding table.
    model_parameter_rrefs = model.remote_emb_module.remote_parameters()

    # Not model.parameters(): it calls remote_emb_module.parameters(), which RemoteModule refuses.
    for param in model.fc.parameters():
        model_parameter_rrefs.append(RRef(param))

    opt = DistributedOptimizer(optim.SGD, model_parameter_rrefs, lr=0.05)
    criterion = torch.nn.CrossEntropyLoss()

    def get_next_batch():  # no rank: targets go to model.device, which may be the CPU
        # Each bag from its class's part of the table: the tutorial's random targets teach nothing.
        # torch's generator, not the tutorial's random module: --seed repeats the batches.
        for _ in range(10):
            num_indices = int(torch.randint(20, 51, ()))
            offsets = []
            start = 0
            while start < num_indices:
                offsets.append(start)
                start += int(torch.randint(1, 11, ()))
            bag_sizes = torch.diff(torch.tensor(offsets + [num_indices]))
            target = torch.randint(0, 8, (len(offsets),))
            indices = target.repeat_interleave(bag_sizes) * (NUM_EMBEDDINGS // 8)
            indices += torch.randint(0, NUM_EMBEDDINGS // 8, (num_indices,))
            yield indices, torch.tensor(offsets), target.to(model.device)

    epoch_losses = []
    for epoch in range(epochs):
        losses = []
        for indices, offsets, target in get_next_batch():
            with dist_autograd.context() as context_id:
                output = model(indices, offsets)
                loss = criterion(output, target)
                dist_autograd.backward(context_id, [loss])
                opt.step(context_id)
                # No zero_grad: each iteration's autograd context holds its own grads.
            losses.append(loss.item())
        epoch_losses.append(sum(losses) / len(losses))
        # The loss too, to see it learn, and which trainer: both print here.
        print(f"Training done for epoch {epoch} loss {epoch_losses[-1]:.4f} (trainer{rank})")
    return epoch_losses, {name: t.cpu() for name, t in model.fc.module.state_dict().items()}


def run_worker(rank, world_size, args):  # args: the flags; the tutorial has none
    trainers = range(world_size - 2)  # the tutorial's ranks 0 and 1, for any world size
    # Both meet at MASTER_ADDR:MASTER_PORT (one store), the tutorial's at localhost:29500 and 29501.
    with meeting(rank, args):
        if rank in trainers:
            # The timeout bounds DDP's collectives, else 30 minutes.
            dist.init_process_group(backend="gloo", rank=rank, world_size=len(trainers),
                                    timeout=datetime.timedelta(seconds=5 * args.timeout))
        rpc.init_rpc(worker_name(rank, world_size), rank=rank, world_size=world_size,
                     rpc_backend_options=backend_options(args))

    if rank == world_size - 2:
        # Setup embedding table remotely on the parameter server.
        remote_emb_module = RemoteModule(
            "ps", torch.nn.EmbeddingBag, args=(NUM_EMBEDDINGS, EMBEDDING_DIM),
            kwargs={"mode": "sum"})

        # cuda:rank only if every trainer has it: DDP can't mix CUDA and CPU replicas.
        gpus = [rpc.rpc_sync(worker_name(r, world_size), torch.cuda.device_count) for r in trainers]
        device = None if all(n > r for r, n in zip(trainers, gpus)) else "cpu"

        # Run the training loop on trainers.
        start = time.perf_counter()
        futs = []
        for trainer_rank in trainers:
            trainer_name = worker_name(trainer_rank, world_size)
            # No RPC timeout (0): training outlasts it.
            fut = rpc.rpc_async(trainer_name, _run_trainer, args=(remote_emb_module, trainer_rank),
                                kwargs={"epochs": args.epochs, "device": device}, timeout=0)
            futs.append(fut)

        # wait_all, not the tutorial's fut.wait() in turn: the first error ends the wait.
        results = torch.futures.wait_all(futs)
        first = results[0][1]  # did DDP keep the replicas equal?
        in_sync = all(torch.equal(fc[key], first[key]) for _, fc in results for key in first)
        in_sync = str(in_sync).lower() if len(results) > 1 else "n/a"
        losses = " ".join(f"trainer{i}_loss={loss[-1]:.4f}" for i, (loss, _) in enumerate(results))
        # not in the tutorial: for people and scripts
        print(f"Summary: epochs={args.epochs} seconds={time.perf_counter() - start:.2f} {losses} "
              f"fc_in_sync={in_sync}")
    say_done(rank, args)  # not in the tutorial: rank 0 watches until all are done
    rpc.shutdown()  # blocks until all RPCs finish


def worker_name(rank, world_size):
    roles = {world_size - 1: "ps", world_size - 2: "master"}
    return roles.get(rank, f"trainer{rank}")


def parse_args(argv=None):  # the tutorial has no flags
    parser = argparse.ArgumentParser(
        description="DDP and RPC combined",
        epilog="Ranks 0 to N-3 are trainers, N-2 the master, N-1 the parameter server.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)
    parser.add_argument("--epochs", type=in_range(int, 1), default=100, help="Epochs per trainer.")
    return parse_common(parser, argv, world_size=4, least=3)


# --------- Launching ranks (not in the tutorials) --------------------
def backend_options(args, **kwargs):
    # TCP only: shared memory busy-polls (private: pytorch/pytorch#33982).
    return rpc.TensorPipeRpcBackendOptions(rpc_timeout=args.timeout, _transports=["uv"], **kwargs)


met, done, ending = threading.Event(), set(), threading.Lock()


@contextlib.contextmanager
def meeting(rank, args):
    timer = threading.Timer(5 * args.timeout, stop, (rank, args, "not all ranks met"))
    timer.start()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "You are using a Backend")
        yield
    timer.cancel()
    met.set()
    threading.Thread(target=watch, args=(rank, args), daemon=True).start()


def check_peers(rank, args):
    for peer in [0] if rank else range(1, args.world_size):
        name = worker_name(peer, args.world_size)
        try:
            if rank:
                socket.create_connection((args.master_addr, args.master_port), args.timeout).close()
            elif met.is_set():
                rpc.rpc_sync(name, os.getpid, timeout=args.timeout)
        except Exception:
            stop(rank, args, f"cannot reach rank {peer} ({name})")


def watch(rank, args):
    while rank or len(done) < args.world_size:
        check_peers(rank, args)
        time.sleep(1)
    time.sleep(args.timeout + 2)
    stop(rank, args, "lost a peer in rpc.shutdown()")


def note_done(rank):
    done.add(rank)


def say_done(rank, args):
    rpc.rpc_async(0, note_done, (rank,))


def stop(rank, args, why):
    with ending:
        sys.stdout.flush()
        print(f"Error on rank {rank} ({worker_name(rank, args.world_size)}):", why, file=sys.stderr)
        os._exit(1)


def machine_lock():
    lock = open(__file__)
    fcntl.flock(lock, fcntl.LOCK_EX)
    return lock


def describe(exc):
    where = re.findall(r"id=(\d+), name=(.*?)\):\n(.*)", str(exc))
    line = "rank {} ({}): {}".format(*where[-1]) if where else f"{type(exc).__name__}: {exc}"
    return line.split("\n")[0]


def run_rank(rank, args):
    try:
        if socket.gethostbyname(args.master_addr).startswith("127.") or args.ifname:
            os.environ["GLOO_SOCKET_IFNAME"] = os.environ["TP_SOCKET_IFNAME"] = args.ifname or "lo"
        os.environ.update(MASTER_ADDR=args.master_addr, MASTER_PORT=str(args.master_port))
        torch.manual_seed(args.seed + rank)
        torch.empty(30 * 2**20, dtype=torch.uint8)  # freed: raises glibc's trim threshold
        run_worker(rank, args.world_size, args)
        ending.acquire()  # done: no more lines
        if rank == 0:
            time.sleep(1)  # peers' shutdown uses its store
    except socket.gaierror:
        stop(rank, args, f"cannot resolve --master_addr {args.master_addr}")
    except Exception as exc:
        time.sleep(1)
        check_peers(rank, args)
        stop(rank, args, traceback.format_exc() if args.debug else describe(exc))


def in_range(kind, low, high=math.inf):
    def number(text):
        if low <= kind(text) <= high:
            return kind(text)
        raise argparse.ArgumentTypeError(f"{text} is not in [{low}, {high}]")
    return number


def parse_common(parser, argv, world_size, least, most=math.inf):
    add, env = parser.add_argument, os.environ.get
    add("--world_size", "--world-size", type=in_range(int, least, most),
        default=env("WORLD_SIZE", world_size), help="Processes in all.")
    add("--rank", type=int, default=env("RANK"), help="Run only this rank (None: all).")
    add("--master_addr", default=env("MASTER_ADDR", "localhost"), help="Rank 0's address.")
    add("--master_port", type=in_range(int, 1, 65535), default=env("MASTER_PORT"),
        help="Rank 0's port (None: 29500; one command: a free one).")
    add("--ifname", help="Interface (None: lo if rank 0 is local).")
    add("--timeout", type=in_range(float, 1, 86400), default=60, help="Seconds to wait (meet: 5x).")
    add("--debug", action="store_true", help="On a failure: traceback, torch's log.")
    add("--seed", type=in_range(int, 0), default=1, help="Seeds every draw.")
    args = parser.parse_args(argv)
    if not 0 <= (args.rank or 0) < args.world_size:
        parser.error(f"--rank must be in [0, --world_size={args.world_size})")
    return args


def main():
    args = parse_args()
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    if not args.debug:
        logging.disable()
    if args.rank is not None:
        args.master_port = args.master_port or 29500
        return run_rank(args.rank, args)
    with socket.socket() as free:
        free.bind(("", 0))
        args.master_port = args.master_port or free.getsockname()[1]
    try:  # forked: spawn re-imports torch
        mp.start_processes(run_rank, (args,), args.world_size, start_method="fork")
    except mp.ProcessExitedException as exc:
        how = exc.signal_name or f"exit code {exc.exit_code}"
        sys.exit(f"Rank {exc.error_index} ended ({how}).")


if __name__ == "__main__":
    main()
