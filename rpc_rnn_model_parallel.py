"""The tutorial "Getting Started with Distributed RPC Framework", part 2
(https://pytorch.org/tutorials/intermediate/rpc_tutorial.html): an RNN split between the parameter
server (rank 0: embedding table and decoder) and the trainer (rank 1: the LSTM).

    python rpc_rnn_model_parallel.py  # both ranks; or one terminal each, with --rank=0 and 1
"""
import argparse
import contextlib
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


# The tutorial's part 1 helpers: run a function on an RRef's owner.
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
                # As the tutorial's detach_(), but out of place.
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


def run_worker(rank, world_size, args):  # args: the flags; the tutorial's RNN has none
    # One RPC thread: the two parts are built in the order asked, as --seed needs.
    with meeting(rank, args):
        rpc.init_rpc(worker_name(rank, world_size), rank=rank, world_size=world_size,
                     rpc_backend_options=backend_options(args, num_worker_threads=1))
    if rank == 1:
        run_trainer(args.epochs)  # as defined: the tutorial calls _run_trainer()
    # else: the parameter server does nothing
    say_done(rank, args)  # not in the tutorial: rank 0 watches until all are done
    rpc.shutdown()


def parse_args(argv=None):  # the tutorial's RNN takes no flags
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
