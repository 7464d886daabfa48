"""Distributed RNN training with PyTorch's RPC framework: model parallelism.

The model is split across two processes. The parameter server ("ps", rank 0)
holds the embedding table and the decoder; the trainer (rank 1) holds the LSTM
and drives training. RNNModel stitches the three parts together over RPC, and
distributed autograd plus a DistributedOptimizer train all three at once.

One command starts both ranks:       python rpc_rnn_model_parallel.py
One terminal per rank (tutorial):    python rpc_rnn_model_parallel.py --world_size=2 --rank=0
                                     python rpc_rnn_model_parallel.py --world_size=2 --rank=1
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
from torch.distributed.optim import DistributedOptimizer
from torch.distributed.rpc import RRef

PS_NAME = "ps"
TRAINER_NAME = "trainer"
# TCP (uv) only: the shared-memory transport busy-polls and starves other runs on the machine (README,
# "Sharing a machine"); the choice is a private option until pytorch/pytorch#33982.
RPC_TRANSPORTS = ["uv"]


# --------- Distributed modules --------------------


class EmbeddingTable(nn.Module):
    r"""
    Encoding layers of the RNNModel
    """

    def __init__(self, ntoken, ninp, dropout):
        super().__init__()
        # The tutorial calls .cuda() unconditionally, which fails on a machine
        # without a GPU: use one when there is one, the CPU otherwise.
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.drop = nn.Dropout(dropout)
        # The tutorial re-initialises the weights to uniform(-0.1, 0.1), as the
        # word language model does for thousands of steps; in this example's 50
        # SGD steps that small start barely learns, so PyTorch's default stays.
        self.encoder = nn.Embedding(ntoken, ninp).to(self.device)

    def forward(self, input):
        # Back to the CPU, where the trainer's LSTM runs: RPC carries CUDA tensors only with a device map.
        return self.drop(self.encoder(input.to(self.device)).cpu())


class Decoder(nn.Module):
    r"""
    Decoding layers of the RNNModel
    """

    def __init__(self, ntoken, nhid, dropout):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.decoder = nn.Linear(nhid, ntoken)  # default init, as for the embedding table

    def forward(self, output):
        return self.decoder(self.drop(output))


# --------- Helper Methods --------------------


def _call_method(method, rref, *args, **kwargs):
    r"""
    a helper function to call a method on the given RRef
    """
    return method(rref.local_value(), *args, **kwargs)


def _remote_method(method, rref, *args, **kwargs):
    r"""
    a helper function to run method on the owner of rref and fetch back the
    result using RPC
    """
    # The tutorial's version calls rref.local_value() on the caller, which only
    # works on the RRef's owner; this runs the method where the object lives.
    args = [method, rref] + list(args)
    return rpc.rpc_sync(rref.owner(), _call_method, args=args, kwargs=kwargs)


def _parameter_rrefs(module):
    r"""
    Create one RRef for each parameter in the given local module, and return a
    list of RRefs.
    """
    param_rrefs = []
    for param in module.parameters():
        param_rrefs.append(RRef(param))
    return param_rrefs


# --------- The distributed RNN model --------------------


class RNNModel(nn.Module):
    r"""
    A distributed RNN model which puts embedding table and decoder parameters on
    a remote parameter server, and locally holds parameters for the LSTM module.
    The structure of the RNN model is borrowed from the word language model
    example. See https://github.com/pytorch/examples/blob/main/word_language_model/model.py
    """

    def __init__(self, ps, ntoken, ninp, nhid, nlayers, dropout=0.5):
        super().__init__()
        # setup embedding table remotely
        self.emb_table_rref = rpc.remote(ps, EmbeddingTable, args=(ntoken, ninp, dropout))
        # rpc.remote returns before the table is built, and the decoder's constructor draws from the same random
        # generator on the parameter server: wait for the table, so that --seed gives the same weights every run.
        # (RRef has no public wait; _get_future() is the creation future that torch's own profiler waits on.)
        self.emb_table_rref._get_future().wait()
        # setup LSTM locally (nn.LSTM's own dropout only acts between layers)
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout if nlayers > 1 else 0.0)
        # setup decoder remotely
        self.decoder_rref = rpc.remote(ps, Decoder, args=(ntoken, nhid, dropout))

    def forward(self, input, hidden):
        # pass input to the remote embedding table and fetch emb tensor back
        emb = _remote_method(EmbeddingTable.forward, self.emb_table_rref, input)
        output, hidden = self.rnn(emb, hidden)
        # pass output to the remote decoder and get the decoded output back
        decoded = _remote_method(Decoder.forward, self.decoder_rref, output)
        return decoded, hidden

    def parameter_rrefs(self):
        remote_params = []
        # get RRefs of embedding table
        remote_params.extend(_remote_method(_parameter_rrefs, self.emb_table_rref))
        # create RRefs for local parameters
        remote_params.extend(_parameter_rrefs(self.rnn))
        # get RRefs of decoder
        remote_params.extend(_remote_method(_parameter_rrefs, self.decoder_rref))
        return remote_params


# --------- Training --------------------


def get_next_batch(generator, ntoken, batch, nindices, batches):
    r"""
    Yield (data, target) pairs of shape (batch, nindices): nindices sequences
    side by side, each `batch` steps long (nn.LSTM's default sequence-first
    layout). Each sequence counts up by 1 modulo ntoken from its own seeded
    start, so the next token is learnable; the target is the input shifted by
    one step. Consecutive batches continue the same sequences, which is why the
    hidden state is carried from batch to batch.
    """
    # The tutorial draws torch.LongTensor(batch, nindices) % ntoken, which is
    # uninitialised memory, and a target of shape (batch, ntoken) that lines up
    # with the output only by accident: nothing there can be learned.
    start = torch.randint(0, ntoken, (nindices,), generator=generator)
    for i in range(batches):
        steps = torch.arange(i * batch, (i + 1) * batch + 1).unsqueeze(1)
        tokens = (start + steps) % ntoken
        yield tokens[:-1], tokens[1:]


def run_trainer(args):
    batch = 5  # sequence length, as in the tutorial
    nindices = 3  # sequences side by side, as in the tutorial
    ntoken, ninp, nhid, nlayers = args.ntoken, args.ninp, args.nhid, args.nlayers

    # Initialize hidden state. The tutorial draws it at random; a sequence
    # model starts from zeros.
    hidden = (torch.zeros(nlayers, nindices, nhid), torch.zeros(nlayers, nindices, nhid))

    # Create distributed model
    model = RNNModel(PS_NAME, ntoken, ninp, nhid, nlayers, args.dropout)

    # Setup distributed optimizer
    opt = DistributedOptimizer(optim.SGD, model.parameter_rrefs(), lr=args.lr)

    # nn.CrossEntropyLoss takes logits of shape (N, C) and class indices of
    # shape (N,): the (batch, nindices, ntoken) output and (batch, nindices)
    # target are flattened to that below.
    criterion = torch.nn.CrossEntropyLoss()
    generator = torch.Generator().manual_seed(args.seed)
    batches = get_next_batch(generator, ntoken, batch, nindices, args.epochs * args.batches_per_epoch)

    start = time.perf_counter()
    for epoch in range(args.epochs):
        losses = []
        for _ in range(args.batches_per_epoch):
            data, target = next(batches)
            # Create distributed autograd context
            with dist_autograd.context() as context_id:
                # Detach the hidden state so backward stops at this batch
                hidden = (hidden[0].detach(), hidden[1].detach())
                output, hidden = model(data, hidden)
                loss = criterion(output.view(-1, ntoken), target.reshape(-1))
                # Run distributed backward pass
                dist_autograd.backward(context_id, [loss])
                # Run distributed optimizer
                opt.step(context_id)
                # Not necessary to zero grads since they are
                # accumulated into the distributed autograd context
                # which is reset every iteration.
            losses.append(loss.item())
        epoch_loss = sum(losses) / len(losses)
        print(f"Training epoch {epoch} loss {epoch_loss:.4f}")
    seconds = time.perf_counter() - start
    print(f"Summary: epochs={args.epochs} seconds={seconds:.2f} final_loss={epoch_loss:.4f}")


def run_worker(rank, world_size, args):
    r"""
    A wrapper function that initializes RPC, calls the function, and shuts down
    RPC.
    """
    torch.manual_seed(args.seed + rank)
    if rank == 1:
        _init_rpc(TRAINER_NAME, rank, world_size, args)
        run_trainer(args)
    else:
        _init_rpc(PS_NAME, rank, world_size, args)
        # parameter server does nothing but waits for the trainer's RPCs
    # block until all rpcs finish
    _shutdown(rank, world_size, args)


# --------- Roles by rank --------------------


def worker_name(rank, world_size):
    return TRAINER_NAME if rank == 1 else PS_NAME


def run_rank(rank, args):
    """What one process does: rank 0 hosts the embedding table and decoder, rank 1 trains."""
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
        description="RPC-based distributed RNN (model parallel) training",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,  # a mistyped flag fails instead of matching a longer one
    )
    _add_common_flags(parser, world_size=2)
    parser.add_argument("--seed", type=int, default=1, help="Random seed (model init and data).")
    parser.add_argument("--epochs", type=_positive(int), default=10, help="Training epochs.")
    parser.add_argument("--batches_per_epoch", type=_positive(int), default=5, help="Batches in each epoch.")
    # The tutorial's sizes (ninp 2, nhid 3, 4 layers, dropout 0.5) do not learn
    # in its 50 SGD steps at lr 0.05 (loss 2.36 -> 2.35); one wider LSTM layer
    # without dropout does (stacked layers learn far slower at this rate).
    parser.add_argument("--ntoken", type=_positive(int), default=10, help="Vocabulary size.")
    parser.add_argument("--ninp", type=_positive(int), default=128, help="Embedding size.")
    parser.add_argument("--nhid", type=_positive(int), default=256, help="LSTM hidden size.")
    parser.add_argument("--nlayers", type=_positive(int), default=1, help="LSTM layers.")
    parser.add_argument("--dropout", type=float, default=0.0, help="Dropout of the embedding, decoder and between LSTM layers.")
    parser.add_argument("--lr", type=_positive(float), default=0.05, help="Learning rate of SGD.")
    args = parser.parse_args(argv)
    _check_common_args(parser, args, min_world_size=2, roles="the parameter server and the trainer")
    if args.world_size != 2:
        parser.error(f"--world_size must be 2 (the tutorial's parameter server and one trainer), got {args.world_size}")
    if not 0 <= args.dropout < 1:
        parser.error(f"--dropout must be in [0, 1), got {args.dropout}")
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
