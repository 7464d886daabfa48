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
import contextlib
import fcntl
import ipaddress
import json
import multiprocessing.connection
import multiprocessing.forkserver
import multiprocessing.util
import os
import re
import shutil
import signal
import socket
import struct
import sys
import threading
import time
import traceback
import warnings
from datetime import timedelta

if __name__ == "__main__" and "--debug" not in sys.argv:
    # Before torch loads: its C++ log would repeat each failure as warnings, errors and stack dumps.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
if __name__ == "__mp_main__":  # a rank that _launch_all (below) started, still starting: it has nothing to say yet
    signal.signal(signal.SIGINT, lambda *_: os._exit(130))

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
# TCP (uv) only: the shared-memory transport busy-polls and starves other runs on the machine (README,
# "Sharing a machine"); the choice is a private option until pytorch/pytorch#33982.
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


# This trainer's device: init_ddp_process_group picks it, _run_trainer (an RPC from the master) trains on it
# once the DDP group is up.
trainer_device = torch.device("cpu")
ddp_ready = threading.Event()


def pick_trainer_device(rank, num_trainers, store):
    """GPU i for the i-th trainer on each host (the tutorial's cuda:rank) if every trainer has one; else the CPU."""
    # All trainers must agree on one backend, so each tells the others its host and how many GPUs it has.
    store.set(f"trainer{rank}_host", f"{torch.cuda.device_count()} {socket.gethostname()}")
    hosts = [store.get(f"trainer{r}_host").decode().split(" ", 1) for r in range(num_trainers)]
    # A trainer's index among the trainers on its host: what torchrun's LOCAL_RANK says, found without it.
    local_ranks = [sum(host == hosts[r][1] for _, host in hosts[:r]) for r in range(num_trainers)]
    if all(local_rank < int(gpus) for local_rank, (gpus, _) in zip(local_ranks, hosts)):
        return torch.device("cuda", local_ranks[rank])
    if rank == 0 and any(int(gpus) for gpus, _ in hosts):
        # The tutorial needs a GPU per trainer; two trainers on one GPU would make NCCL fail.
        print("All trainers train on CPU, with gloo: not every trainer has a GPU of its own.")
    return torch.device("cpu")


def _run_trainer(remote_emb_module, rank, args):
    r"""
    Each trainer runs a forward pass which involves an embedding lookup on the
    parameter server and running nn.Linear locally. During the backward pass,
    DDP is responsible for aggregating the gradients for the dense part
    (nn.Linear) and distributed autograd ensures gradients updates are
    propagated to the parameter server.
    """
    # The master calls as soon as RPC is up; the DDP group forms just after (see run_worker).
    if not ddp_ready.wait(2 * args.timeout):
        raise RuntimeError(f"trainer{rank}'s DDP process group was not set up within {2 * args.timeout:g} s")
    device = trainer_device
    if device.type == "cuda":  # the current device is per thread, and RPC runs this in one of its own
        torch.cuda.set_device(device)

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
        # The tutorial prints neither loss nor trainer; a one-command run shows every trainer's lines together.
        print(f"Training done for epoch {epoch} loss {epoch_losses[-1]:.4f} (trainer{rank})")
    # Returned to the master, which checks that DDP kept the replicas equal.
    fc_weights = {name: tensor.cpu() for name, tensor in model.fc.module.state_dict().items()}
    return epoch_losses, fc_weights


# --------- Master, parameter server and trainers: run_worker --------------------


def run_master(world_size, args):
    # Setup embedding table remotely on the parameter server.
    remote_emb_module = RemoteModule(
        worker_name(world_size - 1, world_size),  # "ps", as in the tutorial: a bare worker name places it on CPU
        nn.EmbeddingBag,
        args=(NUM_EMBEDDINGS, EMBEDDING_DIM),
        kwargs={"mode": "sum"},
    )

    # Run the training loop on trainers.
    start = time.perf_counter()
    futs = []
    for trainer_rank in trainer_ranks(world_size):
        trainer_name = worker_name(trainer_rank, world_size)
        # timeout=0: training outlasts any RPC timeout; the peer watch (below) ends the run if a trainer dies.
        fut = rpc.rpc_async(trainer_name, _run_trainer, args=(remote_emb_module, trainer_rank, args), timeout=0)
        futs.append(fut)

    # Wait for all training to finish. (Ctrl-C still works meanwhile: the rank's main thread takes it.)
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
          f"fc_norm={fc_norm:.6f} fc_in_sync={str(in_sync).lower()}")


def init_ddp_process_group(rank, world_size, args, store):
    """The trainers' own process group for DDP, on the store where all ranks met: one port, one interface."""
    global trainer_device
    num_trainers = len(trainer_ranks(world_size))
    backend = "the backend"
    try:
        # The tutorial passes init_method="tcp://..." on a second port; a prefix keeps DDP's keys apart from RPC's.
        store = dist.PrefixStore("ddp/", store)
        trainer_device = pick_trainer_device(rank, num_trainers, store)
        # The tutorial uses gloo even on GPUs; NCCL is PyTorch's backend for CUDA tensors.
        backend = "nccl" if trainer_device.type == "cuda" else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(trainer_device)
        dist.init_process_group(backend=backend, store=store, rank=rank, world_size=num_trainers,
                                timeout=timedelta(seconds=args.timeout),
                                device_id=trainer_device if backend == "nccl" else None)
    except Exception as exc:
        cause = (str(exc).strip().splitlines() or [""])[0] or type(exc).__name__
        raise RankFailure(f"the {num_trainers} trainers' DDP process group ({backend} on {trainer_device}) could not be "
                          f"set up: {cause}. Across machines, check --ifname and that the trainers can reach each "
                          f"other (README, \"Running on several machines\").") from exc
    print(f"trainer{rank}: DDP on {trainer_device} with {backend}")
    ddp_ready.set()


def run_worker(rank, world_size, args):
    r"""
    A wrapper function that initializes RPC, calls the function, and shuts down
    RPC.
    """
    torch.manual_seed(args.seed + rank)
    # The tutorial hard-codes ports 29500 (DDP) and 29501 (RPC); here both meet on --master_port.
    if rank == world_size - 2:
        _init_rpc(worker_name(rank, world_size), rank, world_size, args)
        run_master(world_size, args)
    elif rank in trainer_ranks(world_size):
        # Initialize RPC first (the tutorial starts with DDP): its meeting picks the network interface, and
        # its store then serves the DDP group too. Trainers just wait for RPCs from master.
        store = _init_rpc(worker_name(rank, world_size), rank, world_size, args)
        # Initialize process group for Distributed DataParallel on trainers.
        init_ddp_process_group(rank, world_size, args, store)
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
# What the tutorials leave out: bounded waits, one paragraph per failure, several
# machines, launchers. The same text in all four scripts; each script supplies
# RPC_TRANSPORTS, worker_name(rank, world_size) and run_rank(rank, args) above.


class RankFailure(Exception):
    """A failure explained in words: the message is the whole report."""


def _pick_interface(rank, args):
    """Gloo and TensorPipe advertise the hostname's address (often 127.0.0.1): name the interface instead."""
    names = [name for _, name in socket.if_nameindex()]
    try:
        address = socket.gethostbyname(args.master_addr)
    except OSError as exc:
        raise RankFailure(f"--master_addr {args.master_addr} does not resolve to an address here ({exc.strerror}): "
                          f"fix --master_addr (rank 0's address as this machine sees it).") from exc
    if args.ifname is None and not ipaddress.ip_address(address).is_loopback:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:
                probe.connect((address, args.master_port))  # UDP: picks the route, sends nothing
            except OSError as exc:
                raise RankFailure(f"this machine has no route to --master_addr {args.master_addr} ({exc.strerror}): "
                                  f"fix --master_addr, or name the interface that reaches it with --ifname.") from exc
            local = socket.inet_aton(probe.getsockname()[0])
            for name in names:  # SIOCGIFADDR: the interface that has the route's address
                with contextlib.suppress(OSError):
                    if fcntl.ioctl(probe, 0x8915, struct.pack("256s", name.encode()))[20:24] == local:
                        args.ifname = name
                        print(f"Rank {rank}: using network interface {name} to reach {args.master_addr}")
    if args.ifname is not None and args.ifname not in names:
        raise RankFailure(f"there is no network interface --ifname {args.ifname} here; this machine has {', '.join(names)}.")
    if args.ifname:
        os.environ["GLOO_SOCKET_IFNAME"] = os.environ["NCCL_SOCKET_IFNAME"] = os.environ["TP_SOCKET_IFNAME"] = args.ifname


_watching, _finished, _report_lock = threading.Event(), threading.Event(), threading.Lock()
_states = None  # from the launcher: each rank's 0 (starting), 1 (watching its peers), 2 (reported), 3 (gone)
# Flags that may differ from rank to rank; every other flag must be the same on every rank of a run.
RANK_OWN_FLAGS = {"rank", "master_addr", "ifname", "timeout", "debug", "data_dir", "download", "save_model"}


@contextlib.contextmanager
def _deadline(rank, args, why):
    """Past --timeout, print why() as the report and end the process: for waits torch leaves unbounded."""
    timer = threading.Timer(args.timeout, lambda: _exit_with_report(rank, args, why()))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _init_rpc(name, rank, world_size, args, num_worker_threads=16):
    """rpc.init_rpc, with every wait bounded by --timeout (init_rpc alone: 30 minutes, and days in its group).
    Returns the store the ranks met on."""
    _pick_interface(rank, args)
    where = f"{args.master_addr}:{args.master_port}"
    waiting = f"Rank {rank}: waiting up to {args.timeout:g} s for all {world_size} processes to meet at {where}"
    serve = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"  # torchrun serves its own
    why = (f"waited {args.timeout:g} s for rank 0 at {where}, and no rank 0 answered. Start rank 0 with the same "
           f"--master_addr and --master_port, and check that {where} is reachable and that no other program listens "
           f"there.")
    if not serve:
        print(waiting)  # a client waits from the start; rank 0 only once it listens
    try:
        with _deadline(rank, args, lambda: why):  # the store's own timeouts miss a listener that never answers
            # A client tries to connect twice, each time for the timeout it is given: half of --timeout.
            store = dist.TCPStore(args.master_addr, args.master_port, world_size, serve,
                                  timedelta(seconds=args.timeout / (1 if serve else 2)), wait_for_workers=False,
                                  multi_tenant=True)
            if serve:
                print(waiting)
            store.set_timeout(timedelta(seconds=args.timeout))
            if rank == 0:
                store.set("world_size", str(world_size))
            theirs = int(store.get("world_size"))  # the first answer: a rank 0 is there
            why = (f"waited {args.timeout:g} s for all {world_size} processes to meet at {where}, and not all came. "
                   f"Start ranks 0..{world_size - 1} with the same --world_size, --master_addr and --master_port "
                   f"within --timeout of each other, and check that {where} is reachable.")
            if theirs != world_size or store.add(f"rank{rank}", 1) > 1:
                raise RankFailure(f"the group at {where} is not this run's: its --world_size is {theirs} (this rank's: "
                                  f"{world_size}), or its rank {rank} is taken. Start every rank of a run with the same "
                                  f"--world_size, and give each run its own --master_port.")
            flags = {key: value for key, value in vars(args).items() if key not in RANK_OWN_FLAGS}
            store.set(f"flags{rank}", json.dumps(flags, default=str))
            store.set(f"pid{rank}", str(os.getpid()))  # which process is which rank, for whoever must stop one
            store.wait([f"rank{peer}" for peer in range(world_size)])
            ranks_flags = [json.loads(store.get(f"flags{peer}")) for peer in range(world_size)]
            differ = [f"rank {peer} has --{key} {value}, rank 0 --{key} {ranks_flags[0].get(key)}"
                      for peer, theirs in enumerate(ranks_flags) for key, value in theirs.items()
                      if value != ranks_flags[0].get(key)]
            store.set(f"compared{rank}", "1")
            if differ and serve:  # the store goes with this process: let every rank read the flags first
                store.wait([f"compared{peer}" for peer in range(world_size)])
    except dist.DistError as exc:
        if "address already in use" in str(exc).lower():
            raise RankFailure(f"port {args.master_port} on {args.master_addr} is already in use, so rank 0 cannot "
                              f"listen there: stop what holds it, or give every rank another --master_port.") from exc
        raise RankFailure(why) from exc
    if differ:
        raise RankFailure(f"the ranks were started with different flags: {'; '.join(differ)}. Start every rank with "
                          f"the same flags; only --{', --'.join(sorted(RANK_OWN_FLAGS & vars(args).keys()))} may differ.")
    # init_rpc's rendezvous shares the store above (multi_tenant) and finds every rank already there.
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = args.master_addr, str(args.master_port)
    options = rpc.TensorPipeRpcBackendOptions(init_method="env://", rpc_timeout=args.timeout, _transports=RPC_TRANSPORTS,
                                           num_worker_threads=num_worker_threads)
    why = (f"all {world_size} processes met at {where}, but RPC did not start within {args.timeout:g} s: a rank "
           f"stopped, or a firewall blocks the ports that TensorPipe and Gloo listen on (README, \"Running on several "
           f"machines\").")
    with _deadline(rank, args, lambda: why):  # init_rpc's own group waits about 24 days for a rank that died
        rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=options)

    def watch():  # a rank hears of a dead peer only when it calls it: so call every peer each second
        while not _finished.wait(1.0):
            lost = _lost_peers(rank, world_size, args)
            if lost and not _finished.is_set():
                _exit_with_report(rank, args, lost, shared=True)

    threading.Thread(target=watch, daemon=True).start()
    _watching.set()
    if _states is not None:
        _states[rank] = 1
    return store


def _lost_peers(rank, world_size, args):
    """A report naming every peer that does not answer within --timeout, or None."""
    try:
        pings = {peer: rpc.rpc_async(worker_name(peer, world_size), time.monotonic, timeout=args.timeout)
                 for peer in range(world_size) if peer != rank}
    except RuntimeError:  # RPC has just shut down: the run ended well
        return None
    lost = []
    for peer, ping in pings.items():
        try:
            ping.wait()
        except Exception:
            lost.append(f"rank {peer} ({worker_name(peer, world_size)})")
    return lost and (f"lost contact with {', '.join(lost)}: the process died or its machine became unreachable. "
                     f"Look at that rank's own output for the cause, then start all ranks again.")


def _shutdown(rank, world_size, args):
    """rpc.shutdown() alone would wait forever for a dead peer: wait here, where the peer watch runs."""
    store = dist.TCPStore(args.master_addr, args.master_port, timeout=timedelta(seconds=args.timeout))
    store.set(f"done{rank}", "1")
    while not store.check([f"done{peer}" for peer in range(world_size)]):
        time.sleep(0.1)
    _finished.set()
    _watching.clear()  # an error from here on is this rank's own, not a lost peer
    rpc.shutdown(timeout=args.timeout)
    store.set(f"closed{rank}", "1")
    if rank == 0:  # the store lives in this process, and rpc.shutdown on other ranks may still use it
        store.wait([f"closed{peer}" for peer in range(world_size)])


def _describe(exc):
    """One line for an unexpected exception; for one raised inside an RPC, the remote cause and its rank."""
    try:
        text = str(exc).strip()
    except Exception:
        return type(exc).__name__
    remote = re.search(r"On WorkerInfo\(id=(\d+), name=(.*?)\):\n(.*)", text)
    if remote:  # torch sends the callee's repr(exception) and its traceback: keep the first
        return (f"an RPC that ran on rank {remote[1]} ({remote[2]}) raised {remote[3]}. Its traceback is in rank "
                f"{remote[1]}'s output (torch prints it there).")
    if text:
        return f"{type(exc).__name__}: {text.splitlines()[0]}"
    return type(exc).__name__ + "".join(f" at {f.filename}:{f.lineno}" for f in traceback.extract_tb(exc.__traceback__)[-1:])


def _exit_with_report(rank, args, message, exc=None, code=1, shared=False):
    """Print one paragraph (with --debug, the traceback too), then end the process whatever else happens.
    shared: the peers see the same cause (a lost peer, a Ctrl-C to every process) and will report it too."""
    try:
        _report_lock.acquire()  # one report per process, from whichever thread comes first
        try:  # an unexpected exception most often means that a peer died under it
            lost = not message and _watching.is_set() and _lost_peers(rank, args.world_size, args)
            message, shared = message or lost or _describe(exc), shared or bool(lost)
        except Exception:
            message = message or type(exc).__name__
        if exc is not None and args.debug:
            traceback.print_exception(exc)
        hint = "" if args.debug or code != 1 else "\n(Run with --debug to see the traceback and torch's own log.)"
        print(f"\nError on rank {rank} ({worker_name(rank, args.world_size)}): {message}{hint}", file=sys.stderr)
        sys.stdout.flush(), sys.stderr.flush()
        if not args.debug:  # the paragraph is this rank's last word: torch's threads may still print as peers go
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stderr.fileno())
        # Stay reachable while peers have yet to report the same cause, so that they say what they saw, not
        # that this rank vanished: in a one-command run until each has (the launcher's states tell), else 2 s.
        launched = _states is not None  # shared memory: it outlives a killed launcher
        if launched:
            _states[rank] = 2
        end = time.monotonic() + (10 if launched else 2 if code == 1 and args.world_size > 2 else 0)
        while shared and _watching.is_set() and time.monotonic() < end and (
                not launched or 1 in [state for peer, state in enumerate(_states) if peer != rank]):
            time.sleep(0.05)
    finally:
        os._exit(code)  # rpc's threads cannot be trusted to wind down after a failure


def _run_rank_reporting(rank, args):
    try:
        with warnings.catch_warnings():  # rpc's own use of a gloo Backend as a ProcessGroup: not ours to fix
            warnings.filterwarnings("ignore", message="You are using a Backend .* as a ProcessGroup")
            run_rank(rank, args)
    except KeyboardInterrupt as exc:
        _exit_with_report(rank, args, "interrupted.", exc, code=130, shared=True)
    except RankFailure as exc:
        _exit_with_report(rank, args, str(exc), exc)
    except BaseException as exc:
        _exit_with_report(rank, args, None, exc)


def _rank_main(rank, args, states=None):
    """One rank's process, started by the launcher below or from the command line."""
    global _states
    _states = states
    for stream in (sys.stdout, sys.stderr):  # whole lines, even with PYTHONUNBUFFERED=1: ranks never merge
        stream.reconfigure(line_buffering=True, write_through=False)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the launched rank's quiet start-up handler ends here
    if states is not None:  # stop with the launcher (the kernel's parent-death signal would come from the fork server)
        def stop_with_launcher(launcher=multiprocessing.parent_process().sentinel):
            multiprocessing.connection.wait([launcher])  # its end of the pipe closes when it dies
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

        threading.Thread(target=stop_with_launcher, daemon=True).start()
    # The rank runs in a thread of its own: the main thread then takes Ctrl-C at once, where torch's waits
    # (Future.wait, init_rpc) would hold it until they return.
    worker = threading.Thread(target=_run_rank_reporting, args=(rank, args), daemon=True)
    worker.start()
    try:
        worker.join()
    except KeyboardInterrupt as exc:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # one report: a second signal would cut it short, silently
        # In a rank it launched: did this come because the launcher died? (Its pipe is closed then.)
        parent = multiprocessing.parent_process()
        orphan = parent is not None and bool(multiprocessing.connection.wait([parent.sentinel], 0.5))
        _exit_with_report(rank, args, "the launcher is gone (it was killed), so this rank stops too." if orphan
                          else "interrupted.", exc, code=130, shared=True)


_held = None  # while the launcher starts ranks: the stop signals that came, acted on once every rank has started


def _interrupt(signum, frame):  # Ctrl-C, or `kill`, to the launcher: stop every rank
    for each in (signal.SIGINT, signal.SIGTERM):  # first, so that a second Ctrl-C cannot stop the stopping
        signal.signal(each, signal.SIG_IGN)
    if _held is not None:  # a rank cut off mid-spawn would print multiprocessing's own traceback
        _held.append(signum)
    else:
        raise KeyboardInterrupt(signal.Signals(signum).name)


def _launch_all(args):
    """Every rank in a process of its own, as mp.spawn starts them; when one fails, or on Ctrl-C, all stop."""
    reserved = socket.socket()  # bound until the run ends, never listening: the OS gives its port to no one else
    if args.master_port is None:  # a free port, so that two runs never meet
        reserved.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # rank 0 can still listen on it
        reserved.bind(("", 0))  # every address: held on one only, a listener on another could still be given it
        args.master_port = reserved.getsockname()[1]
    global _held
    _held = []  # a stop signal from here on waits until every rank has started, so that none is left behind
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _interrupt)
    print(f"Starting {args.world_size} ranks; rank 0 listens on {args.master_addr}:{args.master_port}", flush=True)
    # For the ranks only (glibc reads these at start-up): one malloc arena, and large blocks kept rather than
    # returned, cut the parameter server's page faults per batch from 5,393 to 290 and its time by about a quarter.
    for name, value in (("MALLOC_ARENA_MAX", "1"), ("MALLOC_MMAP_THRESHOLD_", "33554432"),
                        ("MALLOC_TRIM_THRESHOLD_", "268435456")):
        os.environ.setdefault(name, value)
    # The ranks fork from one server that imports this script, and so torch, once; it never touches CUDA.
    # It starts in the current folder and ignores this process's sys.path: PYTHONPATH tells it where the script is.
    here = os.path.dirname(os.path.abspath(__file__))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
    context = mp.get_context("forkserver")
    context.set_forkserver_preload([os.path.splitext(os.path.basename(__file__))[0]])
    states, ranks, failure, code = context.Array("b", args.world_size, lock=False), [], None, 0
    hold = ()  # the states of the ranks that the launcher waits for before it stops them
    try:
        ranks = mp.start_processes(_rank_main, args=(args, states), nprocs=args.world_size, join=False,
                                   start_method="forkserver").processes
        held, _held = _held, None
        if held:
            raise KeyboardInterrupt(signal.Signals(held[0]).name)
        left = {rank.sentinel: index for index, rank in enumerate(ranks)}
        while left and failure is None:
            for sentinel in multiprocessing.connection.wait(list(left)):
                index = left.pop(sentinel)
                ranks[index].join()  # the sentinel can be ready a moment before the exit status is
                exit_code, states[index] = ranks[index].exitcode, 3  # 3: gone, so no rank waits for its report
                if exit_code and failure is None:
                    how = signal.Signals(-exit_code).name if exit_code < 0 else f"exit code {exit_code}"
                    failure = f"Rank {index} ({worker_name(index, args.world_size)}) ended with {how}: stopped every rank."
                    # Ranks that watch their peers report the loss within seconds; the others have nothing to say.
                    code, hold = 1, (1,)
    except KeyboardInterrupt as exc:
        print("Interrupted: stopping every rank.", file=sys.stderr)
        code = 130
        if exc.args == ("SIGINT",):  # Ctrl-C reached the ranks too: let each say so
            hold = (0, 1)
    finally:
        _held = None
        for signum in (signal.SIGINT, signal.SIGTERM):  # nor a Ctrl-C after a failure
            signal.signal(signum, signal.SIG_IGN)
        end = time.monotonic() + 10
        while any(rank.is_alive() and states[i] in hold for i, rank in enumerate(ranks)) and time.monotonic() < end:
            time.sleep(0.05)
        children = multiprocessing.active_children()
        for stop in ("terminate", "kill"):  # all at once, not one after another
            end = time.monotonic() + 3
            for child in children:
                if child.is_alive():
                    getattr(child, stop)()
            for child in children:
                child.join(max(0.0, end - time.monotonic()))
    reserved.close()
    # Every rank is gone: end the fork server at once, or it would spend about 0.5 s of CPU unloading torch only to
    # exit. (Python offers no public handle on it.) The script ends with os._exit, which skips multiprocessing's
    # clean-up: remove its folder, which holds the fork server's socket.
    server = getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)
    if server:
        with contextlib.suppress(ProcessLookupError):
            os.kill(server, signal.SIGTERM)  # it keeps the default action: end without clean-up
    shutil.rmtree(multiprocessing.util.get_temp_dir(), ignore_errors=True)
    if failure:
        print(failure, file=sys.stderr)
    return code


# --------- Command line --------------------


def _positive(cast):
    def positive(text):  # an argparse type: a number above zero
        if cast(text) <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return cast(text)
    return positive


def _add_common_flags(parser, world_size):
    """The command line that all four scripts share (README, "Running the scripts")."""
    parser.usage = "%(prog)s [flags]   (--help lists them)"  # a bad flag: two lines, not the whole synopsis
    parser.epilog = ("One terminal per rank: start every rank with the same flags; only --rank, --master_addr, "
                     "--ifname, --timeout and --debug (and --data_dir, --download, --save_model where a script has "
                     "them) may differ. Ranks whose flags differ stop with an error naming them.")
    parser.add_argument("--world_size", "--world-size", type=int, default=world_size,
                        help="Processes in the RPC group, all roles counted.")
    parser.add_argument("--rank", type=int, default=None,
                        help="Run only this rank (a terminal or machine each). None: start every rank here.")
    parser.add_argument("--master_addr", default="localhost", help="Address of rank 0.")
    parser.add_argument("--master_port", type=int, default=None,
                        help="Port of rank 0. None: 29500 with --rank, else a free one.")
    parser.add_argument("--ifname", default=None,
                        help="Network interface for runs across machines. None: the one that reaches --master_addr.")
    parser.add_argument("--timeout", type=_positive(float), default=60.0, help="Longest wait for a peer or an RPC, in seconds.")
    parser.add_argument("--debug", action="store_true", help="On a failure, show the traceback and torch's own log.")


def _check_common_args(parser, args, min_world_size, roles):
    """Exit 2 with one line for a bad common flag; without --rank, take torchrun's RANK etc."""
    if args.rank is None and "RANK" in os.environ:
        args.rank, args.world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        args.master_addr, args.master_port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if args.world_size < min_world_size:
        parser.error(f"--world_size must be at least {min_world_size} ({roles}), got {args.world_size}")
    if args.rank is not None and not 0 <= args.rank < args.world_size:
        parser.error(f"--rank must be in [0, {args.world_size}) for --world_size {args.world_size}, got {args.rank}")
    if args.master_port is not None and not 0 < args.master_port < 65536:
        parser.error(f"--master_port must be in 1..65535, got {args.master_port}")
    if args.rank is not None and args.master_port is None:
        args.master_port = 29500


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="DDP trainers with a remote embedding table on a parameter server, driven by a master over RPC",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,  # a mistyped flag fails instead of matching a longer one
    )
    _add_common_flags(parser, world_size=4)
    parser.add_argument("--seed", type=int, default=1, help="Random seed (model init and data).")
    parser.add_argument("--epochs", type=_positive(int), default=100, help="Training epochs on each trainer.")
    parser.add_argument("--batches_per_epoch", type=_positive(int), default=10, help="Batches in each epoch.")
    parser.add_argument("--lr", type=_positive(float), default=0.05, help="Learning rate of SGD.")
    args = parser.parse_args(argv)
    _check_common_args(parser, args, min_world_size=3, roles="at least one trainer, the master and the parameter server")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.rank is not None:
        _rank_main(args.rank, args)
        return 0
    return _launch_all(args)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(code)  # all is done: skip the interpreter's teardown of torch (about 0.7 s of CPU)
