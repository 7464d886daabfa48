"""Combining Distributed DataParallel with the Distributed RPC framework.

The tutorial "Combining Distributed DataParallel with Distributed RPC Framework"
(https://pytorch.org/tutorials/advanced/rpc_ddp_tutorial.html). The parameter server ("ps") holds an embedding
table, used over RPC; each trainer holds a replica of one nn.Linear, kept in sync by DistributedDataParallel; the
master creates the table and drives training on the trainers. For --world_size N >= 3 (the tutorial's 4), ranks
0..N-3 are trainers, N-2 the master, N-1 the ps.

One command starts every rank:       python ddp_rpc_hybrid.py
One terminal per rank:               python ddp_rpc_hybrid.py --rank=R   (R = 0, 1, 2, 3)
torchrun:                            torchrun --nproc_per_node=4 ddp_rpc_hybrid.py
"""
import argparse
import contextlib
import datetime
import fcntl
import itertools
import os
import re
import signal
import socket
import struct
import sys
import threading
import time
import traceback
import warnings

if __name__ == "__main__" and "--debug" not in sys.argv:
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # before torch loads: no C++ warnings as peers go

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
        # The tutorial always calls .cuda(device); on the CPU, DDP takes no device_ids. process_group: see ddp_device.
        device_ids = [device] if device.type == "cuda" else None
        self.fc = DDP(nn.Linear(EMBEDDING_DIM, NUM_CLASSES).to(device), device_ids=device_ids,
                      process_group=process_group)
        self.device = device

    def forward(self, indices, offsets):
        emb_lookup = self.remote_emb_module.forward(indices, offsets)
        return self.fc(emb_lookup.to(self.device))


def ddp_device(rank, args):
    """Where DDP runs: every trainer on its own GPU with NCCL, or every one on the CPU with the tutorial's Gloo (DDP
    needs one device type in all replicas). A collective: the trainers learn over Gloo which of them have their GPU."""
    # The tutorial's cuda:rank; LOCAL_RANK where set (torchrun, or by hand), so that each host counts its own GPUs.
    # A one-command run numbers them by rank, whatever LOCAL_RANK it inherited (all on one GPU: NCCL refuses).
    index = rank if args.rank is None else int(os.environ.get("LOCAL_RANK", rank))
    has_gpu = [None] * dist.get_world_size()
    dist.all_gather_object(has_gpu, index < torch.cuda.device_count())
    if all(has_gpu):
        device = torch.device("cuda", index)
        torch.cuda.set_device(device)  # the current device is per thread, and RPC runs this in one of its own
        # NCCL, the backend for GPUs, where the tutorial keeps Gloo; it needs a GPU in every process, only now known.
        process_group = dist.new_group(backend="nccl")
        print(f"trainer{rank}: DDP on {device} with nccl")  # not in the tutorial, whose device is always cuda:rank
        return device, process_group
    without = [f"trainer{trainer}" for trainer, ok in enumerate(has_gpu) if not ok]
    why = f" (no GPU for {', '.join(without)})" if any(has_gpu) else ""  # some have one: say why it is not used
    print(f"trainer{rank}: DDP on cpu with gloo{why}")
    return torch.device("cpu"), None  # None: DDP uses the default group, the tutorial's Gloo


def get_next_batch(generator, batches, device):
    """Yield (indices, offsets, target): 20 to 50 indices cut into bags of 1 to 10 at offsets, as in the tutorial,
    but each bag's indices come from its class's range of the table: the tutorial's random targets teach nothing."""
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


def _run_trainer(remote_emb_module, rank, args):
    r"""
    Each trainer runs a forward pass which involves an embedding lookup on the
    parameter server and running nn.Linear locally. During the backward pass,
    DDP is responsible for aggregating the gradients for the dense part
    (nn.Linear) and distributed autograd ensures gradients updates are
    propagated to the parameter server.
    """
    try:
        device, process_group = ddp_device(rank, args)

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
        opt = DistributedOptimizer(optim.SGD, model_parameter_rrefs, lr=args.lr)  # --lr: the tutorial's 0.05

        criterion = nn.CrossEntropyLoss()
        # Each trainer draws its own batches (the tutorial: Python's random module), as DDP expects of its workers.
        generator = torch.Generator().manual_seed(args.seed + rank)
        batches = get_next_batch(generator, args.epochs * args.batches_per_epoch, device)

        epoch_losses = []
        for epoch in range(args.epochs):  # the tutorial's 100 epochs of 10 batches, as flags
            losses = []
            for _ in range(args.batches_per_epoch):
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
            # The tutorial prints neither loss nor trainer; a one-command run shows every trainer's lines together.
            print(f"Training done for epoch {epoch} loss {epoch_losses[-1]:.4f} (trainer{rank})")
        # Not in the tutorial: returned to the master, which checks that DDP kept the replicas equal.
        fc_weights = {name: tensor.cpu() for name, tensor in model.fc.module.state_dict().items()}
        return epoch_losses, fc_weights
    except Exception as exc:  # torch would print this RPC's traceback here: one line instead (--debug: both)
        if not args.debug:
            fail(rank, args, describe(exc))
        raise


# --------- Master, parameter server and trainers: run_worker --------------------
def run_worker(rank, world_size, args):
    r"""A wrapper function that initializes RPC, calls the function, and shuts down RPC."""
    torch.manual_seed(args.seed + rank)  # the tutorial seeds nothing; with this, --seed fixes the initial weights
    trainers = range(world_size - 2)  # the tutorial's ranks 0 and 1; here all below the master, for any world size
    # The tutorial sets MASTER_ADDR and ports 29500 (DDP) and 29501 (RPC). Here both meet on --master_port: torch's
    # store serves the two groups at once (DDP's keys under a prefix), so one free port, or --master_addr, does.
    if rank in trainers:
        # Initialize process group for Distributed DataParallel on trainers (Gloo; ddp_device may add NCCL's).
        with deadline(rank, args, rpc_group=False):
            # Not in the tutorial: a timeout, or a collective waits 30 minutes for a trainer whose machine vanished.
            dist.init_process_group(backend="gloo", rank=rank, world_size=len(trainers),
                                    init_method=f"tcp://{args.master_addr}:{args.master_port}",
                                    timeout=datetime.timedelta(seconds=args.meet_timeout))

    # Initialize RPC on every rank (the tutorial repeats this call in each of the three branches).
    with deadline(rank, args):
        rpc.init_rpc(worker_name(rank, world_size), rank=rank, world_size=world_size,
                     rpc_backend_options=backend_options(args))

    if rank == world_size - 2:
        # Setup embedding table remotely on the parameter server.
        remote_emb_module = RemoteModule("ps", nn.EmbeddingBag, args=(NUM_EMBEDDINGS, EMBEDDING_DIM),
                                         kwargs={"mode": "sum"})

        # Run the training loop on trainers.
        start = time.perf_counter()
        futs = []
        for trainer_rank in trainers:
            trainer_name = worker_name(trainer_rank, world_size)
            # timeout=0 (none): training outlasts any RPC timeout; wait_for_peers below watches the trainers instead.
            fut = rpc.rpc_async(trainer_name, _run_trainer, args=(remote_emb_module, trainer_rank, args), timeout=0)
            futs.append(fut)

        # Wait for all training to finish (the tutorial: fut.wait() for each; this also notices a vanished trainer).
        results = wait_for_peers(rank, args, futs)
        # Not in the tutorial: a check that DDP kept the replicas equal, and one key=value line for people and scripts.
        first = results[0][1]
        in_sync = all(torch.equal(weights[name], first[name]) for _, weights in results for name in first)
        in_sync = str(in_sync).lower() if len(results) > 1 else "n/a"  # one trainer: no other replica to compare
        # A norm, not a sum: SGD on a cross-entropy loss never changes the sum of the last layer's weights.
        fc_norm = torch.cat([tensor.flatten() for tensor in first.values()]).norm()
        final_losses = " ".join(f"trainer{i}_loss={losses[-1]:.4f}" for i, (losses, _) in enumerate(results))
        print(f"Summary: epochs={args.epochs} seconds={time.perf_counter() - start:.2f} {final_losses} "
              f"fc_norm={fc_norm:.6f} fc_in_sync={in_sync}")
    # else: trainers just wait for the master's RPCs, and the parameter server does nothing but serve

    # block until all rpcs finish (the tutorial's rpc.shutdown() alone waits forever for a peer that died)
    wait_for_peers(rank, args)
    rpc.shutdown(timeout=args.timeout)
    if dist.is_initialized():
        dist.destroy_process_group()  # not in the tutorial: NCCL warns at exit without it


def worker_name(rank, world_size):
    return "ps" if rank == world_size - 1 else "master" if rank == world_size - 2 else f"trainer{rank}"


def parse_args(argv=None):  # the tutorial has no flags: world size 4, 100 epochs of 10 batches, lr 0.05
    parser = argparse.ArgumentParser(description="DDP trainers, a remote embedding table and a master, over RPC",
                                     epilog="For --world_size N: ranks 0 to N-3 are DDP trainers, rank N-2 the "
                                     "master, rank N-1 the parameter server, so N must be at least 3 (one "
                                     "trainer); the tutorial's 4 has two.",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)
    add_common_flags(parser, world_size=4)
    parser.add_argument("--epochs", type=int, default=100, help="Training epochs on each trainer.")
    parser.add_argument("--batches_per_epoch", type=int, default=10, help="Batches in each epoch.")
    parser.add_argument("--lr", type=float, default=0.05, help="Learning rate of SGD.")
    args = parser.parse_args(argv)
    check_common_args(parser, args)
    if args.world_size < 3:
        parser.error(f"--world_size must be at least 3 (at least one trainer, the master and the parameter server), "
                     f"got {args.world_size}")
    for flag in ("epochs", "batches_per_epoch", "lr"):
        if getattr(args, flag) <= 0:
            parser.error(f"--{flag} must be positive, got {getattr(args, flag)}")
    return args


# --------- Launching ranks, bounding waits, reporting failures --------------------
# Not in the tutorials; the same text in all four scripts, which each supply worker_name and run_worker above.
def backend_options(args, **kwargs):
    # TCP only: the shared-memory transport busy-polls a core per process (a private option: pytorch/pytorch#33982).
    return rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://{args.master_addr}:{args.master_port}",
                                           rpc_timeout=args.timeout, _transports=["uv"], **kwargs)


@contextlib.contextmanager
def deadline(rank, args, rpc_group=True):
    """Around init_rpc (or, rpc_group=False, init_process_group), which waits 30 minutes for a missing rank, forever
    on a silent port; after init_rpc, a check that every rank runs this script: another's would answer its RPCs."""
    where = f"not all {args.world_size} ranks of this script met at {args.master_addr}:{args.master_port}"
    (timer := threading.Timer(args.meet_timeout, fail, (rank, args, f"{where} within {args.meet_timeout:g} s: check "
                              "--world_size and --master_port."))).start()
    try:
        with warnings.catch_warnings():  # init_rpc's own use of a Gloo Backend as a ProcessGroup: not ours to fix
            warnings.filterwarnings("ignore", message="You are using a Backend .* as a ProcessGroup")
            yield
        if rpc_group:  # every rank runs this script: another script's ranks would answer its RPCs
            for peer in range(args.world_size):
                rpc.get_worker_info(worker_name(peer, args.world_size))  # raises for a name that no rank has
    except Exception as exc:  # also: the rank that hosted the meeting gave up (ranks of another --world_size came)
        fail(rank, args, f"{where}: {traceback.format_exc() if args.debug else describe(exc)}")
    timer.cancel()


_ranks_done, _all_done = itertools.count(1), torch.futures.Future()  # on rank 0: ranks done so far, and when all are


@rpc.functions.async_execution  # on rank 0: answers once every rank is done, holding no RPC thread meanwhile
def _rank_done(world_size):
    if next(_ranks_done) == world_size:  # next() on a count is atomic: two ranks done at once count as two
        _all_done.set_result(None)
    return _all_done


def wait_for_peers(rank, args, futures=None):
    """Before rpc.shutdown(), which waits forever for a peer that died: every rank tells rank 0 it is done and waits
    for the answer, which comes when all are (given futures of RPCs with no time limit: their results). Meanwhile it
    asks every peer each second if it answers: a peer whose process ended fails at once, a vanished one at --timeout."""
    done, futures = threading.Event(), futures or [rpc.rpc_async(0, _rank_done, args=(args.world_size,), timeout=0)]
    torch.futures.collect_all(futures).add_done_callback(lambda _: done.set())
    while not done.wait(timeout=1):
        for peer in set(range(args.world_size)) - {rank}:
            try:
                rpc.rpc_sync(peer, os.getpid)
            except RuntimeError:
                fail(rank, args, f"lost contact with rank {peer} ({worker_name(peer, args.world_size)}); see its output.")
    return [fut.wait() for fut in futures]  # (raises what a future failed with)


def describe(exc):
    """One line for an exception; for one raised inside an RPC, the rank it ran on and the remote exception."""
    text = str(exc).strip() or type(exc).__name__
    # The callee's repr(exception), then its traceback (torch prints it on the callee too); innermost first.
    if remote := re.findall(r"On WorkerInfo\(id=(\d+), name=(.*?)\):\n(.*)", text):
        return "an RPC that ran on rank {} ({}) raised {}".format(*remote[-1])
    lost = re.search("end of file|connection reset|closed by peer|broken pipe|no such process", text, re.I)
    return f"{type(exc).__name__}: {text.splitlines()[0]}" + " (a peer's process ended; see its output)" * bool(lost)


def fail(rank, args, message):
    print(f"Error on rank {rank} ({worker_name(rank, args.world_size)}): {message}", file=sys.stderr, flush=True)
    os._exit(1)  # RPC's threads may still wait on a peer that is gone


def pick_interface(rank, args):
    """Gloo and TensorPipe announce the address the hostname resolves to, often 127.0.0.1: for a --master_addr on
    another machine, use the interface that reaches it (SIOCGIFADDR reads an interface's address)."""
    if args.ifname is None and not socket.gethostbyname(args.master_addr).startswith("127."):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((args.master_addr, args.master_port))  # UDP: finds the route, sends nothing
            ours = socket.inet_aton(probe.getsockname()[0])
            for _, name in socket.if_nameindex():
                with contextlib.suppress(OSError):  # an interface without an address
                    if fcntl.ioctl(probe, 0x8915, struct.pack("256s", name.encode()))[20:24] == ours:
                        args.ifname = name
        print(f"Rank {rank}: using network interface {args.ifname} to reach {args.master_addr}")
    if args.ifname:
        os.environ["GLOO_SOCKET_IFNAME"] = os.environ["TP_SOCKET_IFNAME"] = os.environ["NCCL_SOCKET_IFNAME"] = args.ifname


def run_rank(rank, args):
    """One process: the tutorial's run_worker, and one line instead of a traceback if it fails."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C ends a rank at once, even inside a wait in torch
    if mp.parent_process() and not mp.parent_process().is_alive():  # a launcher killed while this rank started,
        return  # before torch.multiprocessing armed the signal that the launcher's death sends its ranks
    for stream in (sys.stdout, sys.stderr):  # whole lines, even with PYTHONUNBUFFERED=1: ranks never merge
        stream.reconfigure(line_buffering=True, write_through=False)
    try:
        pick_interface(rank, args)
        run_worker(rank, args.world_size, args)
    except Exception as exc:
        fail(rank, args, traceback.format_exc() if args.debug else describe(exc))


def add_common_flags(parser, world_size):
    parser.add_argument("--world_size", "--world-size", type=int, default=world_size, help="Processes, all roles.")
    parser.add_argument("--rank", type=int, help="Run only this rank (a terminal or machine each); else all here.")
    parser.add_argument("--master_addr", default="localhost", help="Address of rank 0.")
    parser.add_argument("--master_port", type=int, help="Port of rank 0; 29500 with --rank, else a free one.")
    parser.add_argument("--ifname", help="Network interface to use; found from --master_addr if it is not local.")
    parser.add_argument("--timeout", type=float, help="Longest wait for a peer or an RPC, in seconds (default: 60; "
                        "ranks started by hand with --rank wait 300 s for each other).")
    parser.add_argument("--debug", action="store_true", help="On a failure, the traceback and torch's own log too.")
    parser.add_argument("--seed", type=int, default=1, help="Random seed.")
    parser.set_defaults(**{name.lower(): os.environ[name] for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
                           if name in os.environ})  # set by torchrun (and other launchers); a flag overrides them


def check_common_args(parser, args):
    if args.rank is not None and not 0 <= args.rank < args.world_size:
        parser.error(f"--rank must be in [0, {args.world_size}) for --world_size {args.world_size}, got {args.rank}")
    args.master_port = args.master_port or (29500 if args.rank is not None else None)
    by_hand = args.rank is not None and "RANK" not in os.environ  # one terminal per rank: a person starts the rest
    args.timeout, args.meet_timeout = args.timeout or 60.0, args.timeout or (300 if by_hand else 60)


def main(argv=None):
    args = parse_args(argv)
    if args.rank is not None:  # one rank per process, its peers perhaps not started yet: say what it waits for
        print(f"Rank {args.rank} waits up to {args.meet_timeout:g} s for all {args.world_size} ranks at "
              f"{args.master_addr}:{args.master_port}", file=sys.stderr)
        return run_rank(args.rank, args)
    if args.master_port is None:  # a free port, held until the run ends by a socket bound to it, never listening:
        (port := socket.socket()).setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (rank 0 can still listen)
        port.bind(("", 0))  # the OS gives it to no one else
        args.master_port = port.getsockname()[1]
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # `kill` stops the ranks as Ctrl-C does
    print(f"Starting {args.world_size} ranks; rank 0 listens on {args.master_addr}:{args.master_port}", flush=True)
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited: a Ctrl-C while a rank starts cannot cut it off
        ranks = mp.start_processes(run_rank, args=(args,), nprocs=args.world_size, join=False, daemon=True)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # (run_rank gives each rank the default action)
        while not ranks.join(grace_period=3):  # when a rank fails, the others have 3 s to say why, then SIGTERM
            pass
    except mp.ProcessExitedException as exc:
        sys.exit(f"Rank {exc.error_index} ({worker_name(exc.error_index, args.world_size)}) ended with "
                 f"{exc.signal_name or f'exit code {exc.exit_code}'}: stopped every rank.")
    except KeyboardInterrupt:
        print("Interrupted: stopping every rank.", file=sys.stderr)
        sys.exit(130)  # the daemonic ranks are terminated as this process exits


if __name__ == "__main__":
    main()
