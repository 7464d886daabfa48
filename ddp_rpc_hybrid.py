"""The tutorial "Combining Distributed DataParallel with Distributed RPC Framework"
(https://pytorch.org/tutorials/advanced/rpc_ddp_tutorial.html): the trainers (ranks 0 to N-3)
keep a layer in sync with DDP and look up an embedding table on the parameter server (rank N-1)
over RPC; the master (rank N-2) drives them.

    python ddp_rpc_hybrid.py               # every rank, here
    python ddp_rpc_hybrid.py --rank=R      # or one terminal per rank, R = 0, 1, 2, 3
    torchrun --nproc_per_node=4 ddp_rpc_hybrid.py
"""
import argparse
import contextlib
import datetime
import os
import re
import signal
import socket
import sys
import threading
import time
import traceback
import warnings
from multiprocessing import resource_tracker

if __name__ == "__main__":  # before torch starts threads, which inherit it: see main
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])
    if "--debug" not in sys.argv:
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # no C++ log lines

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


# --------- The model --------------------
class HybridModel(torch.nn.Module):
    r"""
    The model consists of a sparse part and a dense part.
    1) The dense part is an nn.Linear module that is replicated across all
       trainers using DistributedDataParallel.
    2) The sparse part is a Remote Module that holds an nn.EmbeddingBag on the
       parameter server.
    This remote model can get a Remote Reference to the embedding table on the
    parameter server.
    """

    def __init__(self, remote_emb_module, device):
        super().__init__()
        self.remote_emb_module = remote_emb_module
        # The tutorial's device is a rank (cuda:rank): the CPU unless there is a GPU per trainer.
        if isinstance(device, int) and torch.cuda.device_count() < dist.get_world_size():
            device = "cpu"
        self.device = torch.device(device)
        # No device_ids, which a CPU module must not have: DDP takes the module's device.
        self.fc = DDP(torch.nn.Linear(16, 8).to(self.device))

    def forward(self, indices, offsets):
        emb_lookup = self.remote_emb_module.forward(indices, offsets)
        return self.fc(emb_lookup.to(self.device))


# --------- Trainer --------------------
# epochs, batches_per_epoch and lr: the tutorial's fixed 100, 10 and 0.05.
def _run_trainer(remote_emb_module, rank, epochs=100, batches_per_epoch=10, lr=0.05):
    r"""
    Each trainer runs a forward pass which involves an embedding lookup on the
    parameter server and running nn.Linear locally. During the backward pass,
    DDP is responsible for aggregating the gradients for the dense part
    (nn.Linear) and distributed autograd ensures gradients updates are
    propagated to the parameter server.
    """

    # Setup the model.
    model = HybridModel(remote_emb_module, rank)

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

    def get_next_batch():
        # As the tutorial's, 20 to 50 indices cut into bags of 1 to 10, but each bag holds indices
        # from its class's part of the table: the tutorial's random targets teach nothing.
        for _ in range(batches_per_epoch):
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
        # The tutorial prints neither the loss nor the trainer.
        print(f"Training done for epoch {epoch} loss {epoch_losses[-1]:.4f} (trainer{rank})")
    # Not in the tutorial: for the master's Summary and its check of DDP.
    fc_weights = {name: tensor.cpu() for name, tensor in model.fc.module.state_dict().items()}
    return epoch_losses, fc_weights


# --------- Master, parameter server and trainers --------------------
def run_worker(rank, world_size, args):
    r"""
    A wrapper function that initializes RPC, calls the function, and shuts down
    RPC.
    """
    torch.manual_seed(args.seed + rank)  # the tutorial seeds nothing: --seed fixes the weights
    # The tutorial's ranks 0 and 1; here all below the master, for any world size.
    trainers = range(world_size - 2)
    # --master_port replaces the tutorial's MASTER_ADDR and ports 29500 (DDP) and 29501 (RPC):
    # torch's store serves both groups.
    with deadline(rank, args):
        if rank in trainers:
            # Initialize process group for Distributed DataParallel on trainers. The timeout
            # bounds its collectives, else 30 minutes.
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
            # timeout=0 (none): training outlasts an RPC timeout; the loop below watches instead.
            fut = rpc.rpc_async(trainer_name, _run_trainer, args=(remote_emb_module, trainer_rank),
                                kwargs={"epochs": args.epochs}, timeout=0)
            futs.append(fut)

        # Wait for all training to finish: not with the tutorial's fut.wait() for each in turn,
        # which sits on one trainer while another failed.
        while not all(fut.done() for fut in futs):
            time.sleep(1)
            torch.futures.wait_all([fut for fut in futs if fut.done()])  # raises an error
            tell_peers(rank, args)
        results = torch.futures.wait_all(futs)
        # Not in the tutorial: did DDP keep the replicas equal?
        first = results[0][1]
        in_sync = all(torch.equal(fc[key], first[key]) for _, fc in results for key in first)
        in_sync = str(in_sync).lower() if len(results) > 1 else "n/a"  # one trainer: no other
        losses = " ".join(f"trainer{i}_loss={loss[-1]:.4f}" for i, (loss, _) in enumerate(results))
        print(f"Summary: epochs={args.epochs} seconds={time.perf_counter() - start:.2f} {losses} "
              f"fc_in_sync={in_sync}")
    # else: trainers and the parameter server wait for RPCs

    # block until all rpcs finish (not rpc.shutdown() alone: it waits forever for a dead peer)
    wait_for_peers(rank, args)
    rpc.shutdown(timeout=args.timeout)


def worker_name(rank, world_size):
    roles = {world_size - 1: "ps", world_size - 2: "master"}
    return roles.get(rank, f"trainer{rank}")


def parse_args(argv=None):  # the tutorial has no flags
    parser = argparse.ArgumentParser(
        description="DDP trainers, a remote embedding table and a master, over RPC",
        epilog="Ranks 0 to N-3 are trainers, N-2 the master, N-1 the parameter server.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)
    parser.add_argument("--epochs", type=int, default=100, help="Training epochs on each trainer.")
    args = parse_common(parser, argv, world_size=4)
    if args.world_size < 3:
        parser.error("--world_size must be at least 3: a trainer, the master and the server")
    return args


# --------- Launching ranks (not in the tutorials) --------------------
def backend_options(args, **kwargs):
    # TCP only: shared memory busy-polls (private: pytorch/pytorch#33982).
    return rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://{args.master_addr}:{args.master_port}", rpc_timeout=args.timeout,
        _transports=["uv"], **kwargs)


@contextlib.contextmanager
def deadline(rank, args):
    # torch waits 30 min for a lost rank, forever on a silent port
    timer = threading.Timer(5 * args.timeout, fail, (
        rank, args, f"not all {args.world_size} ranks met at port {args.master_port}"))
    timer.start()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "You are using a Backend")
        yield
    tell_peers(rank, args)  # a failed first connection aborts TensorPipe (moolib#34)
    timer.cancel()


done_ranks = set()


def rank_done(rank, done):
    if done:
        done_ranks.add(rank)


def tell_peers(rank, args, done=False):
    for peer in range(args.world_size):
        name = worker_name(peer, args.world_size)
        to = rpc.get_worker_info(name)  # raises before init_rpc
        try:
            rpc.rpc_sync(to, rank_done, (rank, done))
        except RuntimeError:
            fail(rank, args, f"lost contact with rank {peer} ({name})")


def wait_for_peers(rank, args):
    # rpc.shutdown() waits forever for a dead peer
    while len(done_ranks) < args.world_size:
        time.sleep(1)
        tell_peers(rank, args, True)


def describe(exc, args):
    head, _, tail = str(exc).partition("\nTraceback")  # torch's report of an RPC's
    if tail:
        where = re.findall(r"id=(\d+), name=(.*?)\)", head)[-1]
        return "rank {} ({}): {}".format(*where, re.search(r"\n(\S.*)", tail)[1])
    if isinstance(exc, socket.gaierror):
        return f"{args.master_addr}: {exc.strerror}"
    return f"{type(exc).__name__}: {head}".splitlines()[0]


def fail(rank, args, why):
    print(f"Error on rank {rank} ({worker_name(rank, args.world_size)}): {why}", file=sys.stderr)
    os._exit(1)  # sys.exit waits for threads stuck on lost peers


def run_rank(rank, args):
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C ends it even in torch's waits
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
    if mp.parent_process() and not mp.parent_process().is_alive():
        os._exit(1)  # its launcher died before torch watched
    for stream in sys.stdout, sys.stderr:  # whole lines even unbuffered
        stream.reconfigure(line_buffering=True, write_through=False)
    try:
        if not args.ifname:  # else torch binds the hostname's address
            with socket.socket(type=socket.SOCK_DGRAM) as probe:
                probe.connect((args.master_addr, 1))  # UDP: sends nothing
                ours = probe.getsockname()[0]
            addrs = psutil.net_if_addrs()
            args.ifname = next(name for name in addrs if ours in [a.address for a in addrs[name]])
        os.environ["GLOO_SOCKET_IFNAME"] = os.environ["TP_SOCKET_IFNAME"] = args.ifname
        run_worker(rank, args.world_size, args)
    except Exception as exc:
        if "timeout" not in str(exc):  # a peer ended? name it
            with contextlib.suppress(RuntimeError):
                tell_peers(rank, args)
        fail(rank, args, traceback.format_exc() if args.debug else describe(exc, args))


def parse_common(parser, argv, world_size):
    add, env = parser.add_argument, os.environ.get  # torchrun's
    add("--world_size", "--world-size", type=int, default=env("WORLD_SIZE", world_size))
    add("--rank", type=int, default=env("RANK"), help="Run only this rank.")
    add("--master_addr", default=env("MASTER_ADDR", "localhost"), help="Address of rank 0.")
    add("--master_port", type=int, default=env("MASTER_PORT", 29500),
        help="Port of rank 0 (one command: a free one).")
    add("--ifname")
    add("--timeout", type=float, default=60, help="Seconds to wait for a peer, 5x to meet.")
    add("--debug", action="store_true", help="Tracebacks, C++ log.")
    add("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    if args.rank is not None and not 0 <= args.rank < args.world_size:
        parser.error(f"--rank must be in [0, {args.world_size})")
    return args


def main():
    args = parse_args()
    if args.rank is not None:
        print(f"Rank {args.rank} waits {5 * args.timeout:g} s for all", file=sys.stderr)
        return run_rank(args.rank, args)
    if args.master_port == 29500:  # held: no other program takes it
        held = socket.socket()
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind(("", 0))
        args.master_port = held.getsockname()[1]
    print(f"Starting {args.world_size} ranks on port {args.master_port}", flush=True)
    try:
        resource_tracker.ensure_running()  # unblocks Ctrl-C (CPython bpo-33613)
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])  # the ranks inherit it
        ranks = mp.start_processes(run_rank, (args,), args.world_size, join=False)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])  # raises one that came
        while not ranks.join(grace_period=2):
            pass
    except (mp.ProcessExitedException, KeyboardInterrupt) as exc:
        for process in mp.active_children():
            process.kill()
        sys.exit(f"{str(exc) or 'Interrupted'}: stopped every rank.")


if __name__ == "__main__":
    main()
