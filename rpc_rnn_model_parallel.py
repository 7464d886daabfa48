"""The tutorial "Getting Started with Distributed RPC Framework", part 2
(https://pytorch.org/tutorials/intermediate/rpc_tutorial.html): an RNN split between the parameter
server (rank 0: embedding table and decoder) and the trainer (rank 1: the LSTM).

    python rpc_rnn_model_parallel.py  # both ranks; or one terminal each, with --rank=0 and 1
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
import torch.nn as nn
import torch.optim as optim
from torch.distributed.optim import DistributedOptimizer
from torch.distributed.rpc import RRef


# The tutorial's uniform(-0.1, 0.1) weights barely learn in 50 steps: both keep PyTorch's own.
class EmbeddingTable(nn.Module):
    def __init__(self, ntoken, ninp, dropout):
        super().__init__()
        # On the GPU if there is one: the tutorial's unconditional .cuda() fails without.
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp).to(self.device)

    def forward(self, input):
        return self.drop(self.encoder(input.to(self.device)).cpu())


class Decoder(nn.Module):
    def __init__(self, ntoken, nhid, dropout):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.decoder = nn.Linear(nhid, ntoken)

    def forward(self, output):
        return self.decoder(self.drop(output))


# The tutorial's _remote_method(method_rref, ...) is handed a method first and fails: a function
# has no local_value(). These two, as in pytorch/examples' rnn.py, run it on the RRef's owner.
def _call_method(method, rref, *args, **kwargs):
    return method(rref.local_value(), *args, **kwargs)


def _remote_method(method, rref, *args, **kwargs):
    args = [method, rref] + list(args)
    return rpc.rpc_sync(rref.owner(), _call_method, args=args, kwargs=kwargs)


def _parameter_rrefs(module):
    param_rrefs = []
    for param in module.parameters():
        param_rrefs.append(RRef(param))
    return param_rrefs


class RNNModel(nn.Module):
    def __init__(self, ps, ntoken, ninp, nhid, nlayers, dropout=0.5):
        super().__init__()
        # setup embedding table remotely
        self.emb_table_rref = rpc.remote(ps, EmbeddingTable, args=(ntoken, ninp, dropout))
        # setup LSTM locally
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout)
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


def run_trainer(epochs=10):  # the tutorial's 10
    batch = 5
    ntoken = 10
    # One wider LSTM layer, no dropout: the tutorial's sizes 2 and 3, 4 layers, 0.5 barely learn.
    ninp, nhid, nlayers, dropout = 128, 256, 1, 0.0
    nindices = 3
    hidden = (torch.randn(nlayers, nindices, nhid), torch.randn(nlayers, nindices, nhid))

    model = RNNModel("ps", ntoken, ninp, nhid, nlayers, dropout)

    opt = DistributedOptimizer(optim.SGD, model.parameter_rrefs(), lr=0.05)

    criterion = torch.nn.CrossEntropyLoss()

    def get_next_batch():
        # Columns that count up: the tutorial's data is uninitialised memory, nothing to learn.
        for _ in range(5):
            start = torch.randint(0, ntoken, (nindices,))
            tokens = (start + torch.arange(batch + 1).unsqueeze(1)) % ntoken
            yield tokens[:-1], tokens[1:]

    start = time.perf_counter()
    for epoch in range(epochs):
        losses = []
        for data, target in get_next_batch():
            with dist_autograd.context() as context_id:
                hidden = (hidden[0].detach(), hidden[1].detach())
                output, hidden = model(data, hidden)
                # Logits last: CrossEntropyLoss reads dim 1, the tutorial's nindices, as classes.
                loss = criterion(output.view(-1, ntoken), target.reshape(-1))
                dist_autograd.backward(context_id, [loss])
                opt.step(context_id)  # no zero_grad: each context holds its own grads
            losses.append(loss.item())
        epoch_loss = sum(losses) / len(losses)
        print(f"Training epoch {epoch} loss {epoch_loss:.4f}")  # the loss too: it shows learning
    seconds = time.perf_counter() - start
    # Not in the tutorial: a last line for people and scripts.
    print(f"Summary: epochs={epochs} seconds={seconds:.2f} final_loss={epoch_loss:.4f}")


def worker_name(rank, world_size):
    return "trainer" if rank == 1 else "ps"


def run_worker(rank, world_size, args):  # args: the flags; the tutorial has none
    # One RPC thread: the two parts are built in the order asked, as --seed needs.
    with meeting(rank, args):
        rpc.init_rpc(worker_name(rank, world_size), rank=rank, world_size=world_size,
                     rpc_backend_options=backend_options(args, num_worker_threads=1))
    if rank == 1:
        run_trainer(args.epochs)
    # else: the parameter server does nothing
    wait_for_peers(rank, args)  # rpc.shutdown() alone hangs on a dead peer
    rpc.shutdown(timeout=args.timeout)


def parse_args(argv=None):  # the tutorial has no flags
    parser = argparse.ArgumentParser(
        description="A distributed RNN, model parallel",
        epilog="Rank 0 is the parameter server, rank 1 the trainer.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)
    parser.add_argument("--epochs", type=in_range(int, 1), default=10, help="Training epochs.")
    return parse_common(parser, argv, world_size=2, least=2, most=2)


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
