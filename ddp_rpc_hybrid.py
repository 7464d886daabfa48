"""Combining Distributed DataParallel with the Distributed RPC framework.

The tutorial "Combining Distributed DataParallel with Distributed RPC Framework"
(https://pytorch.org/tutorials/advanced/rpc_ddp_tutorial.html). The parameter server ("ps") holds
an embedding table, used over RPC; each trainer holds a replica of one nn.Linear, kept in sync by
DistributedDataParallel; the master creates the table and drives training on the trainers. For
--world_size N >= 3 (the tutorial's 4), ranks 0..N-3 are trainers, N-2 the master, N-1 the ps.

One command starts every rank:       python ddp_rpc_hybrid.py
One terminal per rank:               python ddp_rpc_hybrid.py --rank=R   (R = 0, 1, 2, 3)
torchrun:                            torchrun --nproc_per_node=4 ddp_rpc_hybrid.py
"""
import argparse
import contextlib
import datetime
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
import warnings

if __name__ == "__main__" and "--debug" not in sys.argv:
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # before torch loads: no C++ log lines

import psutil
import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
import torch.nn as nn
import torch.optim as optim
from torch.distributed.nn import RemoteModule
from torch.distributed.optim import DistributedOptimizer
from torch.distributed.rpc import RRef
from torch.nn.parallel import DistributedDataParallel as DDP

NUM_EMBEDDINGS = 100
EMBEDDING_DIM = 16
NUM_CLASSES = 8


# --------- The model: a remote embedding table and a DDP-replicated layer --------------------
class HybridModel(nn.Module):
    r"""
    The model consists of a sparse part and a dense part.
    1) The dense part is an nn.Linear module that is replicated across all
       trainers using DistributedDataParallel.
    2) The sparse part is a Remote Module that holds an nn.EmbeddingBag on the
       parameter server.
    This remote model can get a Remote Reference to the embedding table on the
    parameter server.
    """

    def __init__(self, remote_emb_module, device, process_group=None):
        super().__init__()
        self.remote_emb_module = remote_emb_module
        # The tutorial's device is a rank, always cuda:rank; here also a string or torch.device,
        # and on the CPU (a rank on a machine without GPUs, too) DDP takes no device_ids.
        if isinstance(device, int):
            device = f"cuda:{device}" if torch.cuda.is_available() else "cpu"
        device = torch.device(device)
        device_ids = [device] if device.type == "cuda" else None
        # process_group: the trainers' NCCL group where they have GPUs (see ddp_device).
        self.fc = DDP(nn.Linear(EMBEDDING_DIM, NUM_CLASSES).to(device), device_ids=device_ids,
                      process_group=process_group)
        self.device = device

    def forward(self, indices, offsets):
        emb_lookup = self.remote_emb_module.forward(indices, offsets)
        return self.fc(emb_lookup.to(self.device))


def ddp_device(rank, gpu=None):
    """Not in the tutorial, whose trainers always use cuda:rank. DDP needs one device type in all
    replicas: every trainer on its own GPU with NCCL, or all on the CPU with the tutorial's Gloo.
    A collective: the trainers learn over Gloo which of them have their GPU."""
    # gpu: the GPU index on this trainer's host; else LOCAL_RANK where set (torchrun), else rank.
    index = int(os.environ.get("LOCAL_RANK", rank)) if gpu is None else gpu
    has_gpu = [None] * dist.get_world_size()
    dist.all_gather_object(has_gpu, index < torch.cuda.device_count())
    if all(has_gpu):
        device = torch.device("cuda", index)
        torch.cuda.set_device(device)  # per thread, and RPC runs this in one of its own
        # NCCL, the backend for GPUs, where the tutorial keeps Gloo.
        process_group = dist.new_group(backend="nccl")
        print(f"trainer{rank}: DDP on {device} with nccl")
        return device, process_group
    without = [f"trainer{trainer}" for trainer, ok in enumerate(has_gpu) if not ok]
    why = f" (no GPU for {', '.join(without)})" if any(has_gpu) else ""
    print(f"trainer{rank}: DDP on cpu with gloo{why}")
    return torch.device("cpu"), None  # None: DDP uses the default group, the tutorial's Gloo


def get_next_batch(generator, batches, device):
    """Yield (indices, offsets, target): 20 to 50 indices cut into bags of 1 to 10, as in the
    tutorial, but each bag's indices come from its class's part of the table: the tutorial's
    random targets teach nothing."""
    per_class = NUM_EMBEDDINGS // NUM_CLASSES
    for _ in range(batches):
        num_indices = int(torch.randint(20, 51, (), generator=generator))
        offsets = []
        start = 0
        while start < num_indices:
            offsets.append(start)
            start += int(torch.randint(1, 11, (), generator=generator))
        bag_sizes = torch.diff(torch.tensor(offsets + [num_indices]))
        target = torch.randint(0, NUM_CLASSES, (len(offsets),), generator=generator)
        indices = target.repeat_interleave(bag_sizes) * per_class
        indices += torch.randint(0, per_class, (num_indices,), generator=generator)
        yield indices, torch.tensor(offsets), target.to(device)


# epochs, batches_per_epoch and lr: the tutorial's fixed 100, 10 and 0.05.
def _run_trainer(remote_emb_module, rank, gpu=None, epochs=100, batches_per_epoch=10, lr=0.05,
                 seed=None):
    r"""
    Each trainer runs a forward pass which involves an embedding lookup on the
    parameter server and running nn.Linear locally. During the backward pass,
    DDP is responsible for aggregating the gradients for the dense part
    (nn.Linear) and distributed autograd ensures gradients updates are
    propagated to the parameter server.
    """
    device, process_group = ddp_device(rank, gpu)

    # Setup the model.
    model = HybridModel(remote_emb_module, device, process_group)

    # Retrieve all model parameters as rrefs for DistributedOptimizer.

    # Retrieve parameters for embedding table.
    model_parameter_rrefs = model.remote_emb_module.remote_parameters()

    # model.fc.parameters() only includes local parameters.
    # NOTE: Cannot call model.parameters() here,
    # because this will call remote_emb_module.parameters(),
    # which supports remote_parameters() but not parameters().
    for param in model.fc.parameters():
        model_parameter_rrefs.append(RRef(param))

    # Setup distributed optimizer
    opt = DistributedOptimizer(
        optim.SGD,
        model_parameter_rrefs,
        lr=lr,
    )

    criterion = torch.nn.CrossEntropyLoss()
    # Each trainer draws its own batches, as DDP expects; with a seed, the same ones each run.
    generator = None if seed is None else torch.Generator().manual_seed(seed + rank)
    batches = get_next_batch(generator, epochs * batches_per_epoch, device)

    epoch_losses = []
    for epoch in range(epochs):
        losses = []
        for _ in range(batches_per_epoch):
            indices, offsets, target = next(batches)
            # create distributed autograd context
            with dist_autograd.context() as context_id:
                output = model(indices, offsets)
                loss = criterion(output, target)

                # Run distributed backward pass
                dist_autograd.backward(context_id, [loss])

                # Run distributed optimizer
                opt.step(context_id)

                # Not necessary to zero grads as each iteration creates a different
                # distributed autograd context which hosts different grads
            losses.append(loss.item())
        epoch_losses.append(sum(losses) / len(losses))
        # The tutorial prints no loss and no trainer: a one-command run shows every trainer's lines.
        print(f"Training done for epoch {epoch} loss {epoch_losses[-1]:.4f} (trainer{rank})")
    # Not in the tutorial: returned to the master, which checks that DDP kept the replicas equal.
    fc_weights = {name: tensor.cpu() for name, tensor in model.fc.module.state_dict().items()}
    return epoch_losses, fc_weights


# --------- Master, parameter server and trainers: run_worker --------------------
def run_worker(rank, world_size, args):
    r"""
    A wrapper function that initializes RPC, calls the function, and shuts down
    RPC.
    """
    torch.manual_seed(args.seed + rank)  # the tutorial seeds nothing: --seed fixes the weights
    # The tutorial's ranks 0 and 1; here all below the master, for any world size.
    trainers = range(world_size - 2)
    # The tutorial sets MASTER_ADDR and ports 29500 (DDP) and 29501 (RPC). Here both meet on
    # --master_port: torch's store serves the two groups at once.
    with deadline(rank, args):
        if rank in trainers:
            # Initialize process group for Distributed DataParallel on trainers (Gloo;
            # ddp_device may add NCCL's). The timeout bounds its collectives, else 30 minutes.
            dist.init_process_group(backend="gloo", rank=rank, world_size=len(trainers),
                                    init_method=f"tcp://{args.master_addr}:{args.master_port}",
                                    timeout=datetime.timedelta(seconds=5 * args.timeout))
        # Initialize RPC (the tutorial repeats this call in each of its three branches).
        rpc.init_rpc(worker_name(rank, world_size), rank=rank, world_size=world_size,
                     rpc_backend_options=backend_options(args))

    if rank == world_size - 2:
        # Setup embedding table remotely on the parameter server.
        remote_emb_module = RemoteModule(
            "ps",
            torch.nn.EmbeddingBag,
            args=(NUM_EMBEDDINGS, EMBEDDING_DIM),
            kwargs={"mode": "sum"},
        )

        # Run the training loop on trainers.
        start = time.perf_counter()
        futs = []
        for trainer_rank in trainers:
            trainer_name = worker_name(trainer_rank, world_size)
            # A one-command run numbers the GPUs by rank, whatever LOCAL_RANK it inherited.
            kwargs = dict(gpu=trainer_rank if args.rank is None else None, epochs=args.epochs,
                          batches_per_epoch=args.batches_per_epoch, lr=args.lr, seed=args.seed)
            # timeout=0 (none): training outlasts an RPC timeout; wait_for_peers watches instead.
            fut = rpc.rpc_async(trainer_name, _run_trainer, args=(remote_emb_module, trainer_rank),
                                kwargs=kwargs, timeout=0)
            futs.append(fut)

        # Wait for all training to finish (the tutorial's fut.wait(), watching the trainers).
        results = wait_for_peers(rank, args, futs)
        # Not in the tutorial: a check that DDP kept the replicas equal, and a Summary line.
        first = results[0][1]
        in_sync = all(torch.equal(fc[key], first[key]) for _, fc in results for key in first)
        in_sync = str(in_sync).lower() if len(results) > 1 else "n/a"  # one trainer: no other
        # A norm, not a sum: SGD on a cross-entropy loss never changes the last layer's sum.
        fc_norm = torch.cat([tensor.flatten() for tensor in first.values()]).norm()
        losses = " ".join(f"trainer{i}_loss={loss[-1]:.4f}" for i, (loss, _) in enumerate(results))
        print(f"Summary: epochs={args.epochs} seconds={time.perf_counter() - start:.2f} {losses} "
              f"fc_norm={fc_norm:.6f} fc_in_sync={in_sync}")
    # else: trainers wait for the master's RPCs, and the parameter server does nothing but serve

    # block until all rpcs finish (rpc.shutdown() alone waits forever for a lost peer)
    wait_for_peers(rank, args)
    rpc.shutdown(timeout=args.timeout)
    if dist.is_initialized():
        dist.destroy_process_group()  # not in the tutorial: NCCL warns at exit without it


def worker_name(rank, world_size):
    roles = {world_size - 1: "ps", world_size - 2: "master"}
    return roles.get(rank, f"trainer{rank}")


def parse_args(argv=None):  # the tutorial has no flags: world size 4, 100 epochs of 10 batches
    parser = argparse.ArgumentParser(
        description="DDP trainers, a remote embedding table and a master, over RPC",
        epilog="For --world_size N: ranks 0 to N-3 are DDP trainers, rank N-2 the master, rank N-1 "
        "the parameter server, so N must be at least 3 (one trainer); the tutorial's 4 has two.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)
    add = parser.add_argument
    add("--epochs", type=int, default=100, help="Training epochs on each trainer.")
    add("--batches_per_epoch", type=int, default=10, help="Batches in each epoch.")
    add("--lr", type=float, default=0.05, help="Learning rate of SGD.")
    args = parse_common(parser, argv, world_size=4)
    if args.world_size < 3:
        parser.error(f"--world_size must be at least 3 (at least one trainer, the master and the "
                     f"parameter server), got {args.world_size}")
    for flag in ("epochs", "batches_per_epoch", "lr"):
        if getattr(args, flag) <= 0:
            parser.error(f"--{flag} must be positive, got {getattr(args, flag)}")
    return args


# --------- Launching ranks, bounding waits, reporting failures --------------------
# Not in the tutorials; the same in all four.
def backend_options(args, **kwargs):
    # TCP only: shared memory busy-polls (private: pytorch/pytorch#33982).
    return rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://{args.master_addr}:{args.master_port}", rpc_timeout=args.timeout,
        _transports=["uv"], **kwargs)


@contextlib.contextmanager
def deadline(rank, args):
    # torch waits 30 min for a missing rank, forever on a silent port
    where = f"not all {args.world_size} ranks met at port {args.master_port} (check --world_size)"
    timer = threading.Timer(5 * args.timeout, fail, [rank, args, where])
    timer.start()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "You are using a Backend")
            yield
        for peer in range(args.world_size):
            rpc.get_worker_info(worker_name(peer, args.world_size))
    except Exception as exc:
        fail(rank, args, f"port {args.master_port} is in use" if "EADDRINUSE" in str(exc)
             else f"{where}: {describe(exc)}")
    finally:
        timer.cancel()


done_ranks = set()


def rank_done(rank, done):
    if done:
        done_ranks.add(rank)


def wait_for_peers(rank, args, futures=()):
    # rpc.shutdown() waits forever for a dead peer
    while len(done_ranks) < args.world_size:
        time.sleep(1)
        for peer in range(args.world_size):
            try:
                rpc.rpc_sync(peer, rank_done, args=(rank, all(f.done() for f in futures)))
            except RuntimeError:
                fail(rank, args, f"lost contact with rank {peer}")
    return [future.wait() for future in futures]


def describe(exc):
    lines = str(exc).strip().splitlines() or [""]
    if "On WorkerInfo" in lines[0]:  # from an RPC
        return " ".join(lines[:2])
    return f"{type(exc).__name__}: {lines[0]}"


def fail(rank, args, why):
    print(f"Error on rank {rank} ({worker_name(rank, args.world_size)}): {why}", file=sys.stderr)
    os._exit(1)  # sys.exit waits for threads stuck on lost peers


def run_rank(rank, args):
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C ends a rank even in torch's waits
    for stream in sys.stdout, sys.stderr:  # whole lines even unbuffered
        stream.reconfigure(line_buffering=True, write_through=False)
    # Else peers get the hostname's address: often 127.0.0.1
    if args.ifname is None and not socket.gethostbyname(args.master_addr).startswith("127."):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((args.master_addr, 1))  # UDP: sends nothing
            ours = probe.getsockname()[0]
        args.ifname = next(name for name, addrs in psutil.net_if_addrs().items()
                           if ours in [addr.address for addr in addrs])
        print(f"Rank {rank}: interface {args.ifname}")
    if args.ifname:
        for name in "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME":
            os.environ[name] = args.ifname
    try:
        run_worker(rank, args.world_size, args)
    except Exception as exc:
        fail(rank, args, traceback.format_exc() if args.debug else describe(exc))


def parse_common(parser, argv, world_size):
    add = parser.add_argument
    add("--world_size", "--world-size", type=int, default=world_size, help="All ranks.")
    add("--rank", type=int, help="Run only this rank.")
    add("--master_addr", default="localhost", help="Address of rank 0.")
    add("--master_port", type=int, default=0, help="0: 29500 with --rank, else free.")
    add("--ifname", help="Network interface.")
    add("--timeout", type=float, default=60, help="Seconds to wait for a peer or RPC (5x to meet).")
    add("--debug", action="store_true", help="Tracebacks, C++ log.")
    add("--seed", type=int, default=1, help="Seed.")
    names = "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"
    parser.set_defaults(**{name.lower(): os.environ[name] for name in names if name in os.environ})
    args = parser.parse_args(argv)
    if args.rank is not None and not 0 <= args.rank < args.world_size:
        parser.error(f"--rank must be in [0, {args.world_size})")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.rank is not None:
        args.master_port = args.master_port or 29500
        print(f"Rank {args.rank} waits {5 * args.timeout:g} s for all at "
              f"{args.master_addr}:{args.master_port}", file=sys.stderr)
        return run_rank(args.rank, args)
    if not args.master_port:  # held: no other program gets it
        held = socket.socket()
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind(("", 0))
        args.master_port = held.getsockname()[1]
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    print(f"Starting {args.world_size} ranks on port {args.master_port}", flush=True)
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited
        ranks = mp.start_processes(run_rank, (args,), args.world_size, join=False, daemon=True)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        while not ranks.join():
            pass
    except mp.ProcessExitedException as exc:
        sys.exit(f"{exc}: stopped every rank.")
    except KeyboardInterrupt:
        sys.exit("Interrupted: stopped every rank.")


if __name__ == "__main__":
    main()
