"""Combining Distributed DataParallel with the Distributed RPC framework.

A sparse part (an embedding table) lives on a parameter server and is used
over RPC; a dense part (one nn.Linear) is replicated on every trainer and kept
in sync by DistributedDataParallel. Roles by rank, for --world_size N >= 3:
ranks 0 .. N-3 are trainers, rank N-2 is the master, rank N-1 the parameter
server (the tutorial's N=4: trainers 0 and 1, master 2, parameter server 3).

One command starts every rank:       python ddp_rpc_hybrid.py
One terminal per rank (tutorial):    python ddp_rpc_hybrid.py --world_size=4 --rank=R   (R = 0, 1, 2, 3)
"""
import argparse
import ipaddress
import os
import signal
import socket
import sys
import threading
import time
import traceback
import warnings
from datetime import timedelta

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
# TCP (uv) rather than TensorPipe's default shared memory, whose reactor
# busy-polls a core in each process: four processes share the machine here.
RPC_TRANSPORTS = ["uv"]


# --------- The model: a remote embedding table and a DDP-replicated layer -----


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

    def __init__(self, remote_emb_module, device):
        super().__init__()
        self.remote_emb_module = remote_emb_module
        # The tutorial always calls .cuda(device); on CPU, DDP takes no device_ids.
        device_ids = [device] if device.type == "cuda" else None
        self.fc = DDP(nn.Linear(EMBEDDING_DIM, NUM_CLASSES).to(device), device_ids=device_ids)
        self.device = device

    def forward(self, indices, offsets):
        emb_lookup = self.remote_emb_module.forward(indices, offsets)
        return self.fc(emb_lookup.to(self.device))


# --------- Trainers --------------------


def get_next_batch(generator, batches, device):
    r"""
    Yield `batches` (indices, offsets, target) triples in nn.EmbeddingBag's
    1-D input form: a batch of 20 to 50 indices cut into bags of 1 to 10 at
    `offsets`, as in the tutorial. The tutorial's targets are random, so there
    is nothing to learn; here each bag draws its indices from a range of the
    table that belongs to its class, so the class can be learned.
    """
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


def trainer_ranks(world_size):
    return range(world_size - 2)


def trainer_device(rank, world_size):
    """One GPU per trainer, as in the tutorial, where the machine has one for each; else the CPU."""
    # The tutorial's maintained copy simply exits with fewer GPUs than trainers;
    # two trainers sharing a GPU would make NCCL fail, so they train on CPU.
    if torch.cuda.device_count() >= len(trainer_ranks(world_size)):
        return torch.device("cuda", rank)
    return torch.device("cpu")


def _run_trainer(remote_emb_module, rank, args):
    r"""
    Each trainer runs a forward pass which involves an embedding lookup on the
    parameter server and running nn.Linear locally. During the backward pass,
    DDP is responsible for aggregating the gradients for the dense part
    (nn.Linear) and distributed autograd ensures gradients updates are
    propagated to the parameter server.
    """
    device = trainer_device(rank, args.world_size)

    # Setup the model.
    model = HybridModel(remote_emb_module, device)

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
        lr=args.lr,
    )

    criterion = nn.CrossEntropyLoss()
    # Each trainer draws its own batches, as DDP expects of data-parallel workers.
    generator = torch.Generator().manual_seed(args.seed + rank)
    batches = get_next_batch(generator, args.epochs * args.batches_per_epoch, device)

    epoch_losses = []
    for epoch in range(args.epochs):
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
        print(f"Training done for epoch {epoch} loss {epoch_losses[-1]:.4f}", flush=True)
    # Returned to the master, which checks that DDP kept the replicas equal.
    fc_weights = {name: tensor.cpu() for name, tensor in model.fc.module.state_dict().items()}
    return epoch_losses, fc_weights


# --------- Master, parameter server and trainers: run_worker --------------------


def run_master(world_size, args):
    # Setup embedding table remotely on the parameter server.
    remote_emb_module = RemoteModule(
        f"{worker_name(world_size - 1, world_size)}/cpu",
        nn.EmbeddingBag,
        args=(NUM_EMBEDDINGS, EMBEDDING_DIM),
        kwargs={"mode": "sum"},
    )

    # Run the training loop on trainers.
    start = time.perf_counter()
    futs = []
    for trainer_rank in trainer_ranks(world_size):
        trainer_name = worker_name(trainer_rank, world_size)
        # timeout=0: training outlasts any RPC timeout; the peer watch (plumbing below)
        # ends the run if a trainer dies instead.
        fut = rpc.rpc_async(trainer_name, _run_trainer, args=(remote_emb_module, trainer_rank, args), timeout=0)
        futs.append(fut)

    # Wait for all training to finish.
    results = [fut.wait() for fut in futs]
    seconds = time.perf_counter() - start

    final_losses = " ".join(f"trainer{rank}_loss={losses[-1]:.4f}" for rank, (losses, _) in enumerate(results))
    first_weights = results[0][1]
    in_sync = all(all(torch.equal(weights[name], first_weights[name]) for name in first_weights)
                  for _, weights in results)
    # A norm, not a plain sum: SGD on a cross-entropy loss never changes the
    # sum of the last layer's weights (its gradient rows add up to zero).
    fc_norm = torch.cat([tensor.flatten() for tensor in first_weights.values()]).norm()
    print(f"Summary: epochs={args.epochs} seconds={seconds:.2f} {final_losses} "
          f"fc_norm={fc_norm:.6f} fc_in_sync={str(in_sync).lower()}", flush=True)


def init_ddp_process_group(rank, world_size, args):
    """The trainers' own process group for DDP, on a port of its own (--ddp_port)."""
    num_trainers = len(trainer_ranks(world_size))
    backend = "nccl" if trainer_device(rank, world_size).type == "cuda" else "gloo"  # the tutorial's GPUs, else CPU
    where = f"{args.master_addr}:{args.ddp_port}"
    try:
        dist.init_process_group(backend=backend, init_method=f"tcp://{where}", rank=rank,
                                world_size=num_trainers, timeout=timedelta(seconds=args.timeout))
    except Exception as exc:
        if "EADDRINUSE" in str(exc) or "address already in use" in str(exc).lower():
            raise RankFailure(f"port {args.ddp_port} on {args.master_addr} (the trainers' DDP process group) "
                              f"is already in use: pick a free one with --ddp_port for every rank.") from exc
        raise RankFailure(f"the {num_trainers} trainers (ranks 0..{num_trainers - 1}) did not all meet at {where} "
                          f"for DDP within {args.timeout:g} s ({str(exc).strip().splitlines()[0]}). Start every "
                          f"trainer with the same --world_size, --master_addr and --ddp_port.") from exc


def run_worker(rank, world_size, args):
    r"""
    A wrapper function that initializes RPC, calls the function, and shuts down
    RPC.
    """
    torch.manual_seed(args.seed + rank)
    # The tutorial hard-codes ports 29500 (DDP) and 29501 (RPC); here RPC uses
    # --master_port and DDP --ddp_port, by default the next one.
    if rank == world_size - 2:
        _init_rpc(worker_name(rank, world_size), rank, world_size, args)
        run_master(world_size, args)
    elif rank in trainer_ranks(world_size):
        # Initialize process group for Distributed DataParallel on trainers.
        init_ddp_process_group(rank, world_size, args)
        # Initialize RPC. Trainers just wait for RPCs from master.
        _init_rpc(worker_name(rank, world_size), rank, world_size, args)
    else:
        # parameter server does nothing but waits for RPCs
        _init_rpc(worker_name(rank, world_size), rank, world_size, args)

    # block until all rpcs finish
    _shutdown(rank, world_size, args)
    if dist.is_initialized():
        dist.destroy_process_group()


# --------- Roles by rank --------------------


def worker_name(rank, world_size):
    if rank == world_size - 1:
        return "ps"
    if rank == world_size - 2:
        return "master"
    return f"trainer{rank}"


def run_rank(rank, args):
    """What one process does: the last rank serves the table, the one before drives, the rest train."""
    run_worker(rank, args.world_size, args)


# --------- Starting, watching and stopping ranks --------------------
# Plumbing the tutorial leaves out: bounded waits, clean failures, several
# machines and launchers. This section is the same, to the letter, in all four
# example scripts (tests/test_plumbing.py checks); each script supplies
# RPC_TRANSPORTS, worker_name(rank, world_size) and run_rank(rank, args) above.


class RankFailure(Exception):
    """A failure explained in words; the message is the whole report."""


def _loopback(addr):
    try:
        return ipaddress.ip_address(socket.gethostbyname(addr)).is_loopback
    except OSError:
        return False


def _interface_towards(addr, port):
    """Name and address of the local interface that routes to addr (Linux)."""
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((addr, int(port)))  # UDP: picks a route, sends nothing
        local_ip = probe.getsockname()[0]
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
            except OSError:
                continue
            if socket.inet_ntoa(packed[20:24]) == local_ip:
                return name, local_ip
    return None, local_ip


def _set_rendezvous_env(rank, args):
    os.environ["MASTER_ADDR"] = args.master_addr
    os.environ["MASTER_PORT"] = str(args.master_port)
    ifname = args.ifname
    if ifname is None and not _loopback(args.master_addr):
        # Gloo and TensorPipe otherwise advertise whatever the hostname
        # resolves to, often 127.0.0.1 on cloud images, and peers on other
        # machines then fail to connect ("connectFullMesh failed").
        try:
            ifname, local_ip = _interface_towards(args.master_addr, args.master_port)
        except OSError as exc:
            raise RankFailure(f"cannot reach --master_addr {args.master_addr} from this machine ({exc}).")
        if ifname:
            print(f"Rank {rank}: using network interface {ifname} ({local_ip}) to reach {args.master_addr}")
    if ifname:
        os.environ["GLOO_SOCKET_IFNAME"] = ifname
        os.environ["TP_SOCKET_IFNAME"] = ifname


def _init_rpc(name, rank, world_size, args):
    # rpc.init_rpc's rendezvous waits 30 minutes for missing peers; a watchdog
    # bounds it by --timeout instead.
    where = f"{args.master_addr}:{args.master_port}"
    watchdog = threading.Timer(
        args.timeout,
        _exit_with_report,
        args=(rank, world_size, f"waited {args.timeout:g} s for all {world_size} processes of the RPC group to meet at {where}, "
                    f"and not all arrived. Start every rank with the same --world_size, --master_addr and "
                    f"--master_port (ranks 0..{world_size - 1}), check that {where} is reachable, or raise --timeout."),
    )
    watchdog.daemon = True
    watchdog.start()
    options = rpc.TensorPipeRpcBackendOptions(
        init_method="env://",
        rpc_timeout=args.timeout,
        _transports=RPC_TRANSPORTS,  # chosen per script, with the reason, at its top
    )
    try:
        rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=options)
    except Exception as exc:
        if "EADDRINUSE" in str(exc) or "address already in use" in str(exc).lower():
            raise RankFailure(
                f"port {args.master_port} on {args.master_addr} is already in use, so rank 0 cannot listen "
                f"there. Another run (or another program) holds it: stop it, or pick a free port with "
                f"--master_port for every rank."
            ) from exc
        if "connectFullMesh" in str(exc):
            raise RankFailure(
                f"the processes met at {where} but could not connect to each other ({str(exc).splitlines()[0]}). "
                f"On several machines, pass --ifname with the interface that reaches the others, and let TCP "
                f"through the firewalls between them."
            ) from exc
        raise
    finally:
        watchdog.cancel()
    _start_peer_watch(rank, world_size, args)


_peer_watch_stop = threading.Event()
_DONE_KEY = "rpc_example_done/{}"


def _store(args):
    return dist.TCPStore(args.master_addr, args.master_port, is_master=False, timeout=timedelta(seconds=args.timeout))


def _lost_peers(rank, world_size, args, store):
    """Peers that do not answer an RPC while the group is still at work."""
    lost = []
    for peer in range(world_size):
        if peer == rank:
            continue
        try:
            rpc.rpc_sync(worker_name(peer, world_size), time.time, timeout=args.timeout)
        except Exception:
            lost.append(peer)
    if lost:
        # Once every rank has said it is done (in _shutdown), a peer that is
        # gone has simply finished. Not before: ranks that only serve others
        # say so as soon as they start, and can still die mid-run.
        try:
            if store.check([_DONE_KEY.format(peer) for peer in range(world_size)]):
                return []
        except Exception:  # the store lives in rank 0: no answer means rank 0 is gone
            pass
    return lost


def _start_peer_watch(rank, world_size, args):
    # A rank only notices a dead peer when it next sends it an RPC; a rank
    # that waits for others (as in rpc.shutdown) would wait forever. So every
    # rank pings its peers once a second until all are done.
    store = _store(args)

    def watch():
        while not _peer_watch_stop.wait(1.0):
            lost = _lost_peers(rank, world_size, args, store)
            if lost and not _peer_watch_stop.is_set():
                _exit_with_report(rank, world_size, _lost_message(lost, world_size))

    threading.Thread(target=watch, name="peer-watch", daemon=True).start()


def _lost_message(lost, world_size):
    names = ", ".join(f"rank {peer} ({worker_name(peer, world_size)})" for peer in lost)
    return (f"lost contact with {names}: the process died or its machine became unreachable. "
            f"Look at that rank's own output for the cause, then start all ranks again.")


def _shutdown(rank, world_size, args):
    """Wait until every rank is done, then leave the RPC group."""
    # The tutorials call rpc.shutdown() alone; its barrier waits forever for
    # a peer that died. This waits for the same thing while the peer watch
    # runs, and only then lets rpc.shutdown() (now quick) run.
    store = _store(args)
    store.set(_DONE_KEY.format(rank), "1")
    keys = [_DONE_KEY.format(peer) for peer in range(world_size)]
    while not store.check(keys):
        time.sleep(0.2)
    _peer_watch_stop.set()
    rpc.shutdown(timeout=args.timeout)


def _exit_with_report(rank, world_size, message, exc=None):
    """Print one short paragraph (and the traceback with --debug) and end the process."""
    if exc is not None and os.environ.get("RPC_EXAMPLE_DEBUG"):
        traceback.print_exception(exc)
    print(f"\nError on rank {rank} ({worker_name(rank, world_size)}): {message}\n"
          f"(Pass --debug or set RPC_EXAMPLE_DEBUG=1 to see the Python traceback.)", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)  # rpc and its threads cannot be trusted to wind down after a failure


def _quiet_known_warnings():
    """Hide two known-harmless warnings that torch.distributed prints on every run."""
    # rpc's own internal use of a gloo Backend object:
    warnings.filterwarnings("ignore", message=r"You are using a Backend .* as a ProcessGroup")
    # DistributedOptimizer still runs on the deprecated TorchScript functional
    # optimizers, and torch forces that warning on with simplefilter("always"),
    # so no filter reaches it: drop it where it is shown.
    show = warnings.showwarning

    def showwarning(message, *args, **kwargs):
        if "`TorchScript` support for functional optimizers is deprecated" not in str(message):
            show(message, *args, **kwargs)

    warnings.showwarning = showwarning


def _rank_main(rank, args, parent_pid=None):
    """Entry point of one rank's process, from the launcher or the command line."""
    if args.debug:
        os.environ["RPC_EXAMPLE_DEBUG"] = "1"
    _quiet_known_warnings()
    if parent_pid is not None:
        # A launcher killed with SIGKILL cannot stop its ranks; they stop themselves.
        def exit_with_parent():
            while os.getppid() == parent_pid:
                time.sleep(1)
            os._exit(1)

        threading.Thread(target=exit_with_parent, daemon=True).start()
    try:
        _set_rendezvous_env(rank, args)
        run_rank(rank, args)
    except KeyboardInterrupt:
        print(f"Rank {rank}: interrupted.", file=sys.stderr, flush=True)
        os._exit(130)
    except RankFailure as exc:
        _exit_with_report(rank, args.world_size, str(exc), exc)
    except Exception as exc:
        lost = _lost_peers(rank, args.world_size, args, _store(args)) if rpc.api._is_current_rpc_agent_set() else []
        message = _lost_message(lost, args.world_size) if lost else f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}"
        _exit_with_report(rank, args.world_size, message, exc)


def _launch_all(args):
    """Start every rank as a child process; if one fails or we are stopped, stop them all."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank_main, args=(rank, args, os.getpid()), name=worker_name(rank, args.world_size))
             for rank in range(args.world_size)]

    def stop_on_sigterm(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop_on_sigterm)
    for proc in procs:
        proc.start()
    try:
        while any(p.exitcode is None for p in procs) and not any(p.exitcode for p in procs):
            time.sleep(0.2)
        failed = next((p for p in procs if p.exitcode), None)
        if failed is None:
            return 0
        # Give the others a moment to report what they saw, then stop them.
        deadline = time.monotonic() + 3
        while any(p.exitcode is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.2)
        print(f"{failed.name} failed (exit code {failed.exitcode}); stopping every rank.", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("Interrupted: stopping every rank.", file=sys.stderr)
        return 130
    finally:
        for proc in procs:
            if proc.exitcode is None:
                proc.terminate()
        for proc in procs:
            proc.join(3)
            if proc.exitcode is None:
                proc.kill()
                proc.join()


def _add_common_flags(parser, world_size):
    """The command line that all four example scripts share (CONVENTIONS.md)."""
    parser.add_argument("--world_size", "--world-size", type=int, default=world_size,
                        help="Total number of participating processes, all roles counted.")
    parser.add_argument("--rank", type=int, default=None,
                        help="Run only this rank (one terminal or machine each). Without it, every rank is started here.")
    parser.add_argument("--master_addr", "--master-addr", default="localhost", help="Address of rank 0.")
    parser.add_argument("--master_port", "--master-port", type=int, default=29500, help="Port rank 0 listens on.")
    parser.add_argument("--ifname", default=None,
                        help="Network interface for multi-machine runs; None: the one that reaches --master_addr.")
    parser.add_argument("--timeout", type=float, default=60.0, help="Longest wait, in seconds, for a peer or an RPC.")
    parser.add_argument("--debug", action="store_true", help="Show the Python traceback of a failure.")


def _check_common_args(parser, args, min_world_size, roles):
    """Exit 2 with one line for a bad common flag; take torchrun's RANK etc. when --rank is absent."""
    if args.rank is None and "RANK" in os.environ:  # started by torchrun or a similar launcher
        args.rank = int(os.environ["RANK"])
        args.world_size = int(os.environ.get("WORLD_SIZE", args.world_size))
        args.master_addr = os.environ.get("MASTER_ADDR", args.master_addr)
        args.master_port = int(os.environ.get("MASTER_PORT", args.master_port))
    if args.world_size < min_world_size:
        parser.error(f"--world_size must be at least {min_world_size} ({roles}), got {args.world_size}")
    if args.rank is not None and not 0 <= args.rank < args.world_size:
        parser.error(f"--rank must be in [0, {args.world_size}) for --world_size {args.world_size}, got {args.rank}")
    if not 0 < args.master_port < 65536:
        parser.error(f"--master_port must be in 1..65535, got {args.master_port}")
    if args.timeout <= 0:
        parser.error(f"--timeout must be positive, got {args.timeout}")


# --------- Command line --------------------


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="DDP trainers with a remote embedding table on a parameter server, driven by a master over RPC",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _add_common_flags(parser, world_size=4)
    parser.add_argument("--ddp_port", "--ddp-port", type=int, default=None,
                        help="Port of the trainers' DDP process group on --master_addr; None: --master_port + 1.")
    parser.add_argument("--seed", type=int, default=1, help="Random seed (model init and data).")
    parser.add_argument("--epochs", type=int, default=100, help="Training epochs on each trainer.")
    parser.add_argument("--batches_per_epoch", type=int, default=10, help="Batches in each epoch.")
    parser.add_argument("--lr", type=float, default=0.05, help="Learning rate of SGD.")
    args = parser.parse_args(argv)
    _check_common_args(parser, args, min_world_size=3, roles="at least one trainer, the master and the parameter server")
    if args.ddp_port is None:
        args.ddp_port = args.master_port + 1
    if not 0 < args.ddp_port < 65536 or args.ddp_port == args.master_port:
        parser.error(f"--ddp_port must be in 1..65535 and differ from --master_port, got {args.ddp_port}")
    for flag in ("epochs", "batches_per_epoch", "lr"):
        if getattr(args, flag) <= 0:
            parser.error(f"--{flag} must be positive, got {getattr(args, flag)}")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.rank is not None:
        _rank_main(args.rank, args)
        return 0
    return _launch_all(args)


if __name__ == "__main__":
    sys.exit(main())
