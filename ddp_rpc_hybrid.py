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

import psutil
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

    def get_next_batch():
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
    # One port for the tutorial's 29500 (DDP) and 29501 (RPC): one store serves both.
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

        # Until all finish or one fails (the tutorial's fut.wait() in turn sits on one trainer).
        while not all(fut.done() for fut in futs):
            time.sleep(1)
            torch.futures.wait_all([fut for fut in futs if fut.done()])  # raises an error
            check_peers(rank, args)
        results = torch.futures.wait_all(futs)
        first = results[0][1]  # did DDP keep the replicas equal?
        in_sync = all(torch.equal(fc[key], first[key]) for _, fc in results for key in first)
        in_sync = str(in_sync).lower() if len(results) > 1 else "n/a"
        losses = " ".join(f"trainer{i}_loss={loss[-1]:.4f}" for i, (loss, _) in enumerate(results))
        print(f"Summary: epochs={args.epochs} seconds={time.perf_counter() - start:.2f} {losses} "
              f"fc_in_sync={in_sync}")
    wait_for_peers(rank, args)  # rpc.shutdown() alone hangs on a dead peer
    rpc.shutdown(timeout=args.timeout)


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


@contextlib.contextmanager
def meeting(rank, args):
    # Torch's own meeting fails unexplained when ranks of two world sizes or scripts meet.
    ours, size = " ".join(args.names), args.world_size
    for peer in range(size if args.store else 0):  # each rank's roles, or why it stopped
        args.store.set(str(rank), ours)
        theirs = args.store.get(str(peer)).decode()
        n = len(theirs.split())
        if theirs != ours:
            stop(rank, args, theirs if theirs.startswith("rank ") else
                 f"ranks of --world_size {min(n, size)} and {max(n, size)} met" if n != size else
                 f"ranks of two scripts met at port {args.master_port}")
    args.met = False  # the ranks agree: a failure from here on is torch's meeting's
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "You are using a Backend")  # init_rpc's own use of it
        yield
    args.timer.cancel()
    args.met = True


done, ending = set(), threading.Lock()  # the ranks that said they are done; one line per rank


def note_done(rank):
    done.add(rank)


def check_peers(rank, args, timeout=None):
    timeout = timeout or args.timeout
    for peer, name in enumerate(args.names):
        try:
            if peer == 0 < rank:  # its store answers while all its RPC threads are busy
                socket.create_connection((args.master_addr, args.master_port), timeout).close()
            elif peer != rank and args.met:
                rpc.rpc_sync(name, os.getpid, timeout=timeout)
        except (OSError, RuntimeError):
            stop(rank, args, f"lost contact with rank {peer} ({name})")


def wait_for_peers(rank, args):
    # rpc.shutdown() waits forever for a peer that died, even one lost within it
    while len(done) < args.world_size:
        for name in args.names:  # not waited for: a busy rank 0 reads it later
            rpc.rpc_async(name, note_done, (rank,))
        check_peers(rank, args)  # at once: a failed first connection aborts TensorPipe (moolib#34)
        time.sleep(1)
    timer = threading.Timer(args.timeout, stop, (rank, args, "lost a peer in rpc.shutdown()"))
    timer.daemon = True
    timer.start()


def stop(rank, args, why, tell=True):
    if not ending.acquire(blocking=False):
        os._exit(1)  # another thread said why
    line = f"rank {rank} ({args.names[rank]}): {why}"
    print("Error on", line, file=sys.stderr)
    with contextlib.suppress(RuntimeError):
        if tell and args.store and args.met is None and args.rank is not None:  # ranks meeting
            args.store.set(str(rank), line)
            args.store.add("stopped", 1)
            while rank == 0 and args.store.add("stopped", 0) < args.world_size:
                time.sleep(0.1)  # its store lives here: until every rank has read it
    time.sleep(2)  # so that peers still checking name the rank that stopped first
    os._exit(1)  # sys.exit waits for threads stuck on lost peers


@contextlib.contextmanager
def machine_lock():
    with open(__file__) as lock:  # ranks on one machine, e.g. downloading into one folder
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def describe(exc):
    head, _, tail = str(exc).partition("\nTraceback")  # torch's report of an RPC's
    where, cause = re.findall(r"id=(\d+), name=(.*?)\)", head), re.findall(r"^\S.*", tail, re.M)
    if where and cause:
        return "rank {} ({}): {}".format(*where[-1], cause[0])
    return f"{type(exc).__name__}: {head}".splitlines()[0]


def run_rank(rank, args):
    if mp.parent_process() and os.getppid() != mp.parent_process().pid:
        os._exit(1)  # its launcher ended before torch's parent-death signal was set
    for stream in sys.stdout, sys.stderr:  # whole lines even unbuffered
        stream.reconfigure(line_buffering=True, write_through=False)
    args.names = [worker_name(peer, args.world_size) for peer in range(args.world_size)]
    args.met = args.store = None
    # Torch waits 30 minutes for a rank that never comes, forever on a port that never answers.
    args.timer = threading.Timer(5 * args.timeout, stop, (
        rank, args, f"not all {args.world_size} ranks met at port {args.master_port}", False))
    args.timer.start()
    try:
        with socket.socket(type=socket.SOCK_DGRAM) as probe:  # UDP: connecting sends nothing
            probe.connect((args.master_addr, 1))
            at = probe.getsockname()[0]
        # The interface that reaches rank 0: else torch binds the hostname's address.
        args.ifname = args.ifname or next(name for name, addrs in psutil.net_if_addrs().items()
                                          if at in [a.address for a in addrs])
        os.environ.update(GLOO_SOCKET_IFNAME=args.ifname, TP_SOCKET_IFNAME=args.ifname,
                          MASTER_ADDR=args.master_addr, MASTER_PORT=str(args.master_port))
        if "RANK" not in os.environ:  # else torchrun's agent holds the port
            args.store = dist.TCPStore(args.master_addr, args.master_port, is_master=rank == 0,
                                       timeout=datetime.timedelta(days=1), multi_tenant=True)
        torch.manual_seed(args.seed + rank)  # --seed repeats a run
        # Freeing 30 MB raises glibc's trim threshold: the parameter server unmapped 25 MB a batch.
        torch.empty(30 * 2**20, dtype=torch.uint8)
        run_worker(rank, args.world_size, args)
        if args.store:  # every rank's rpc.shutdown() uses rank 0's store to its end: it ends last
            args.store.add("ended", 1)
            while rank == 0 and args.store.add("ended", 0) < args.world_size:
                time.sleep(0.1)
    except socket.gaierror as exc:
        stop(rank, args, f"cannot resolve --master_addr {args.master_addr} ({exc.strerror})")
    except Exception as exc:
        time.sleep(1)  # a peer that has just ended is gone by then, and refuses
        check_peers(rank, args, 5)
        stop(rank, args, traceback.format_exc() if args.debug else describe(exc))


def in_range(kind, low, high=math.inf):  # an argparse type naming its range
    def parse(text):
        if low <= kind(text) <= high:
            return kind(text)
        raise argparse.ArgumentTypeError(f"{text} is not in [{low}, {high}]")
    parse.__name__ = kind.__name__  # for argparse's "invalid int value"
    return parse


def parse_common(parser, argv, world_size, least, most=math.inf):
    add, env = parser.add_argument, os.environ.get  # torchrun's
    add("--world_size", "--world-size", type=in_range(int, least, most),
        default=env("WORLD_SIZE", world_size), help="Processes in all, every role.")
    add("--rank", type=int, default=env("RANK"), help="Run only this rank (None: all).")
    add("--master_addr", default=env("MASTER_ADDR", "localhost"), help="Address of rank 0.")
    add("--master_port", type=in_range(int, 1, 65535), default=env("MASTER_PORT"),
        help="Rank 0's port (None: 29500, or a free one for one command).")
    add("--ifname", choices=list(psutil.net_if_addrs()), metavar="IFNAME",
        help="Network interface (None: the one that reaches rank 0).")
    add("--timeout", type=in_range(float, 1, 86400), default=60,
        help="Seconds (1-86400) to wait for a peer, 5x to meet.")
    add("--debug", action="store_true", help="Tracebacks and torch's log on a failure.")
    add("--seed", type=in_range(int, 0, 2**32 - 1), default=1, help="Seeds all random draws.")
    args = parser.parse_args(argv)
    if args.rank is not None and not 0 <= args.rank < args.world_size:
        parser.error(f"--rank must be in [0, {args.world_size}) at --world_size {args.world_size}")
    return args


def main():
    args = parse_args()
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C ends every rank at once, even in torch
    if args.rank is not None:
        args.master_port = args.master_port or 29500
        print(f"Rank {args.rank} waits {5 * args.timeout:g} s for all {args.world_size} ranks at "
              f"{args.master_addr}:{args.master_port}", file=sys.stderr)
        return run_rank(args.rank, args)
    held = socket.socket()  # a free port, held till we exit; rank 0's store binds it too
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    held.bind(("", 0))
    args.master_port = args.master_port or held.getsockname()[1]
    print(f"Starting {args.world_size} ranks on port {args.master_port}", flush=True)
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)  # our line says it
    try:  # forked: at once, with torch loaded
        mp.start_processes(run_rank, (args,), args.world_size, start_method="fork")
    except mp.ProcessExitedException as exc:
        how = exc.signal_name or f"exit code {exc.exit_code}"
        sys.exit(f"Rank {exc.error_index} ended ({how}): stopped every rank.")


if __name__ == "__main__":
    main()
