"""The tutorial "Getting Started with Distributed RPC Framework", part 2
(https://pytorch.org/tutorials/intermediate/rpc_tutorial.html): an RNN split between the parameter
server (rank 0: embedding table and decoder) and the trainer (rank 1: the LSTM).

    python rpc_rnn_model_parallel.py             # both ranks, here
    python rpc_rnn_model_parallel.py --rank=0    # or one terminal per rank
    python rpc_rnn_model_parallel.py --rank=1
    torchrun --nproc_per_node=2 rpc_rnn_model_parallel.py
"""
import argparse
import contextlib
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
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
import torch.nn as nn
import torch.optim as optim
from torch.distributed.optim import DistributedOptimizer
from torch.distributed.rpc import RRef


# --------- Distributed modules --------------------
# The tutorial's uniform(-0.1, 0.1) weights barely learn in 50 steps: both keep PyTorch's own.
class EmbeddingTable(nn.Module):
    r"""
    Encoding layers of the RNNModel
    """

    def __init__(self, ntoken, ninp, dropout):
        super().__init__()
        # The tutorial calls .cuda() unconditionally, which fails without a GPU.
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp).to(self.device)

    def forward(self, input):
        # Back to the CPU, where the LSTM runs: RPC carries CUDA tensors only with a device map.
        return self.drop(self.encoder(input.to(self.device)).cpu())


class Decoder(nn.Module):
    r"""
    Decoding layers of the RNNModel
    """

    def __init__(self, ntoken, nhid, dropout):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.decoder = nn.Linear(nhid, ntoken)

    def forward(self, output):
        return self.decoder(self.drop(output))


# --------- Helper Methods --------------------
# The tutorial's _remote_method calls local_value() on the trainer, which does not own the RRef:
# it fails. These two, from pytorch/examples, run the method on the owner.
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


# --------- Training --------------------
def run_trainer(epochs=10):  # epochs: the tutorial's fixed 10
    batch = 5
    ntoken = 10
    # The tutorial's ninp 2, nhid 3, 4 layers and dropout 0.5 barely learn in 50 steps (loss 2.36 ->
    # 2.35): one wider LSTM layer without dropout does.
    ninp, nhid, nlayers, dropout = 128, 256, 1, 0.0
    nindices = 3

    # Initialize hidden state: zeros, where the tutorial draws it at random
    hidden = (torch.zeros(nlayers, nindices, nhid), torch.zeros(nlayers, nindices, nhid))

    # Create distributed model
    model = RNNModel("ps", ntoken, ninp, nhid, nlayers, dropout)

    # Setup distributed optimizer
    opt = DistributedOptimizer(optim.SGD, model.parameter_rrefs(), lr=0.05)

    criterion = torch.nn.CrossEntropyLoss()

    def get_next_batch():
        # The tutorial's data is uninitialised memory, its target of another shape: nothing to
        # learn. Here each of the nindices columns counts up by 1 modulo ntoken.
        for _ in range(5):
            start = torch.randint(0, ntoken, (nindices,))
            tokens = (start + torch.arange(batch + 1).unsqueeze(1)) % ntoken
            yield tokens[:-1], tokens[1:]

    start = time.perf_counter()
    for epoch in range(epochs):
        losses = []
        for data, target in get_next_batch():
            # Create distributed autograd context
            with dist_autograd.context() as context_id:
                # Detach the hidden state so backward stops at this batch
                hidden = (hidden[0].detach(), hidden[1].detach())
                output, hidden = model(data, hidden)
                # As the (N, C) scores and (N,) classes that CrossEntropyLoss takes
                loss = criterion(output.view(-1, ntoken), target.reshape(-1))
                # Run distributed backward pass
                dist_autograd.backward(context_id, [loss])
                # Run distributed optimizer
                opt.step(context_id)
                # Not necessary to zero grads since they are
                # accumulated into the distributed autograd context
                # which is reset every iteration.
            losses.append(loss.item())
        # The tutorial prints only "Training epoch N": the loss shows that it learns.
        epoch_loss = sum(losses) / len(losses)
        print(f"Training epoch {epoch} loss {epoch_loss:.4f}")
    seconds = time.perf_counter() - start  # not in the tutorial: a line for people and scripts
    print(f"Summary: epochs={epochs} seconds={seconds:.2f} final_loss={epoch_loss:.4f}")


def worker_name(rank, world_size):
    return "trainer" if rank == 1 else "ps"


def run_worker(rank, world_size, args):
    r"""A wrapper function that initializes RPC, calls the function, and shuts down RPC."""
    torch.manual_seed(args.seed + rank)  # the tutorial seeds nothing: --seed repeats a run
    # The options replace the tutorial's MASTER_ADDR and MASTER_PORT. One RPC thread: the parameter
    # server builds the two parts in the order asked, so that --seed repeats a run.
    with deadline(rank, args):  # one init_rpc for both roles, where the tutorial has one in each
        rpc.init_rpc(worker_name(rank, world_size), rank=rank, world_size=world_size,
                     rpc_backend_options=backend_options(args, num_worker_threads=1))
    if rank == 1:
        run_trainer(args.epochs)
    # else: the parameter server waits for the trainer's requests
    # Not in the tutorial, whose rpc.shutdown() alone waits forever for a dead peer.
    wait_for_peers(rank, args)
    rpc.shutdown(timeout=args.timeout)


def parse_args(argv=None):  # the tutorial has no flags
    parser = argparse.ArgumentParser(
        description="RPC-based distributed RNN (model parallel) training",
        epilog="Rank 0 is the parameter server, rank 1 the trainer.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)
    parser.add_argument("--epochs", type=int, default=10, help="Training epochs.")
    args = parse_common(parser, argv, world_size=2)
    if args.world_size != 2:
        parser.error("--world_size must be 2: the parameter server and the trainer")
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
