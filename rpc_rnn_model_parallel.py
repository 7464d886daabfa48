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
from multiprocessing import resource_tracker

if __name__ == "__main__":  # before torch starts threads that would inherit it; main() unblocks
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])
    if "--debug" not in sys.argv:
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # no C++ log lines

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
    # One wider LSTM layer, no dropout: the tutorial's 2, 3, 4 layers, 0.5 barely learn.
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
        print(f"Training epoch {epoch} loss {epoch_loss:.4f}")  # with the loss
    seconds = time.perf_counter() - start
    print(f"Summary: epochs={epochs} seconds={seconds:.2f} final_loss={epoch_loss:.4f}")


def worker_name(rank, world_size):
    return "trainer" if rank == 1 else "ps"


def run_worker(rank, world_size, args):
    # One RPC thread: the two parts are built in the order asked, as --seed needs.
    with deadline(rank, args):
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
    parser.add_argument("--epochs", type=number(int, 1), default=10, help="Training epochs.")
    return parse_common(parser, argv, world_size=2, least=2, most=2)


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
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's holds it
    if rank == 0 and not agent:  # in our words: torch's for a port in use vary by release
        try:
            bound(args.master_port).close()
        except OSError as exc:
            fail(rank, args, f"cannot listen on port {args.master_port} ({exc.strerror})")
    # torch's own meeting fails unexplained on two world sizes
    store = dist.TCPStore(args.master_addr, args.master_port, is_master=rank == 0 and not agent,
                          timeout=datetime.timedelta(seconds=9 * args.timeout), multi_tenant=True)
    store.add("came", 1)  # before rank 0 reads sizes
    store.set(str(rank), str(args.world_size))
    for peer in range(args.world_size):
        sizes = sorted({int(store.get(str(peer))), args.world_size})
        if len(sizes) > 1:
            store.add("told", 1)
            while rank == 0 and store.add("told", 0) < max(store.add("came", 0), args.world_size):
                time.sleep(0.1)  # the store lives here: all read it first
            fail(rank, args, "ranks of --world_size {} and {} met".format(*sizes))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "You are using a Backend")  # torch's own use of it
        yield
    try:
        tell_peers(rank, args)  # a failed first connection aborts TensorPipe (moolib#34)
    except RuntimeError:  # get_worker_info's: no peer of that name
        fail(rank, args, f"ranks of two scripts met at port {args.master_port}")
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
    # and for a peer lost within it
    timer = threading.Timer(args.timeout, fail, (rank, args, "lost a peer in rpc.shutdown()"))
    timer.daemon = True
    timer.start()


@contextlib.contextmanager
def one_at_a_time():
    with open(__file__) as lock:  # ranks on one machine, e.g. downloading into one folder
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def bound(port):  # SO_REUSEADDR, as torch's store binds: rank 0 can still listen on it
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("", port))
    return sock


def describe(exc, args):
    head, _, tail = str(exc).partition("\nTraceback")  # torch's report of an RPC's
    where, cause = re.findall(r"id=(\d+), name=(.*?)\)", head), re.findall(r"^\S.*", tail, re.M)
    if where and cause:
        return "rank {} ({}): {}".format(*where[-1], cause[0])
    if isinstance(exc, socket.gaierror):
        return f"cannot resolve --master_addr {args.master_addr} ({exc.strerror})"
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
            args.ifname = next(name for name, addrs in psutil.net_if_addrs().items()
                               if ours in [a.address for a in addrs])
        os.environ["GLOO_SOCKET_IFNAME"] = os.environ["TP_SOCKET_IFNAME"] = args.ifname
        torch.manual_seed(args.seed + rank)  # --seed repeats a run
        # Freeing 30 MB raises glibc's trim threshold: the parameter server unmapped 25 MB a batch.
        torch.empty(30 * 2**20, dtype=torch.uint8)
        run_worker(rank, args.world_size, args)
    except Exception as exc:
        if "timeout" not in str(exc):  # a peer ended? name it
            with contextlib.suppress(RuntimeError):
                tell_peers(rank, args)
        fail(rank, args, traceback.format_exc() if args.debug else describe(exc, args))


def number(kind, low, high=math.inf):  # argparse type naming its range
    def parse(text):
        if low <= kind(text) <= high:
            return kind(text)
        raise argparse.ArgumentTypeError(f"{text} is not in [{low}, {high}]")
    parse.__name__ = kind.__name__  # for argparse's "invalid int value"
    return parse


def parse_common(parser, argv, world_size, least, most=math.inf):
    add, env = parser.add_argument, os.environ.get  # torchrun's
    add("--world_size", "--world-size", type=number(int, least, most),
        default=env("WORLD_SIZE", world_size), help="Processes in all, every role.")
    add("--rank", type=int, default=env("RANK"), help="Run only this rank (None: all).")
    add("--master_addr", default=env("MASTER_ADDR", "localhost"), help="Address of rank 0.")
    add("--master_port", type=number(int, 1, 65535), default=env("MASTER_PORT"),
        help="Rank 0's port (None: 29500, or a free one for one command).")
    add("--ifname", choices=list(psutil.net_if_addrs()), metavar="IFNAME",
        help="Network interface (None: the one that reaches rank 0).")
    add("--timeout", type=number(float, 1, 86400), default=60,
        help="Seconds (1-86400) to wait for a peer, 5x to meet.")
    add("--debug", action="store_true", help="Tracebacks and torch's log on a failure.")
    add("--seed", type=number(int, 0, 2**32 - 1), default=1, help="Seeds all random draws.")
    args = parser.parse_args(argv)
    if args.rank is not None and not 0 <= args.rank < args.world_size:
        parser.error(f"--rank must be in [0, {args.world_size}) at --world_size {args.world_size}")
    return args


def main():
    args = parse_args()
    if args.rank is not None:
        args.master_port = args.master_port or 29500
        print(f"Rank {args.rank} waits {5 * args.timeout:g} s for all {args.world_size} ranks at "
              f"{args.master_addr}:{args.master_port}", file=sys.stderr)
        return run_rank(args.rank, args)
    if not args.master_port:  # a free one, held till we exit
        held = bound(0)
        args.master_port = held.getsockname()[1]
    print(f"Starting {args.world_size} ranks on port {args.master_port}", flush=True)
    try:
        resource_tracker.ensure_running()  # now: its start unblocks SIGINT (CPython bpo-33613)
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])  # the ranks inherit it
        ranks = mp.start_processes(run_rank, (args,), args.world_size, join=False)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])  # raises one that came
        logging.getLogger("torch.multiprocessing.spawn").addFilter(  # our line says it
            lambda record: "Terminating" not in record.msg)
        while not ranks.join(grace_period=2):
            pass
    except (mp.ProcessExitedException, KeyboardInterrupt) as exc:
        for process in mp.active_children():
            process.kill()
        if isinstance(exc, KeyboardInterrupt):
            sys.exit("Interrupted: stopped every rank.")
        how = exc.signal_name or f"exit code {exc.exit_code}"
        sys.exit(f"Rank {exc.error_index} ended ({how}): stopped every rank.")


if __name__ == "__main__":
    main()
