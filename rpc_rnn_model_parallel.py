"""Distributed RNN training with PyTorch's RPC framework: model parallelism.

The tutorial "Getting Started with Distributed RPC Framework", part 2
(https://pytorch.org/tutorials/intermediate/rpc_tutorial.html). The model is split across two
processes: the parameter server ("ps", rank 0) holds the embedding table and the decoder, the
trainer (rank 1) holds the LSTM and drives training. RNNModel stitches the three parts together
over RPC, and distributed autograd plus a DistributedOptimizer train all three at once.

One command starts both ranks:       python rpc_rnn_model_parallel.py
One terminal per rank:               python rpc_rnn_model_parallel.py --rank=0
                                     python rpc_rnn_model_parallel.py --rank=1
torchrun:                            torchrun --nproc_per_node=2 rpc_rnn_model_parallel.py
"""
import argparse
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
import warnings

if __name__ == "__main__" and "--debug" not in sys.argv:
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # before torch loads: no C++ log lines

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
def own_generator(seed):
    """Not in the tutorial: with a seed, each part draws its initial weights from a generator of its
    own, so the order in which the parameter server builds the parts changes nothing."""
    return None if seed is None else torch.Generator().manual_seed(seed)


class EmbeddingTable(nn.Module):
    r"""
    Encoding layers of the RNNModel
    """

    def __init__(self, ntoken, ninp, dropout, seed=None):
        super().__init__()
        # The tutorial calls .cuda() unconditionally, which fails without a GPU.
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        # The tutorial's uniform(-0.1, 0.1) barely learns in 50 steps: PyTorch's default N(0, 1).
        self.encoder.weight.data.normal_(generator=own_generator(seed))
        self.encoder.to(self.device)

    def forward(self, input):
        # Back to the CPU, where the LSTM runs: RPC carries CUDA tensors only with a device map.
        return self.drop(self.encoder(input.to(self.device)).cpu())


class Decoder(nn.Module):
    r"""
    Decoding layers of the RNNModel
    """

    def __init__(self, ntoken, nhid, dropout, seed=None):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        # nn.Linear's default bounds, not the tutorial's uniform(-0.1, 0.1) (see EmbeddingTable).
        bound, generator = nhid ** -0.5, own_generator(seed)
        self.decoder.weight.data.uniform_(-bound, bound, generator=generator)
        self.decoder.bias.data.uniform_(-bound, bound, generator=generator)

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

    def __init__(self, ps, ntoken, ninp, nhid, nlayers, dropout=0.5, seed=None):
        super().__init__()
        # setup embedding table remotely
        self.emb_table_rref = rpc.remote(ps, EmbeddingTable, args=(ntoken, ninp, dropout, seed))
        # setup LSTM locally (nn.LSTM's own dropout only acts between layers)
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout if nlayers > 1 else 0.0)
        # setup decoder remotely
        seed = None if seed is None else seed + 1
        self.decoder_rref = rpc.remote(ps, Decoder, args=(ntoken, nhid, dropout, seed))

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
    """(data, target) pairs of shape (batch, nindices): sequences counting up by 1 modulo ntoken,
    so the next token is learnable; each batch continues them, so the hidden state carries on."""
    # The tutorial draws uninitialised memory (torch.LongTensor(batch, nindices)) and a target of
    # shape (batch, ntoken) that matches the output only by accident: nothing there can be learned.
    start = torch.randint(0, ntoken, (nindices,), generator=generator)
    for i in range(batches):
        tokens = (start + torch.arange(i * batch, (i + 1) * batch + 1).unsqueeze(1)) % ntoken
        yield tokens[:-1], tokens[1:]


def run_trainer(args):
    batch = 5
    ntoken = 10
    # The tutorial's ninp 2, nhid 3, 4 layers and dropout 0.5 do not learn in 50 steps (loss 2.36 ->
    # 2.35): one wider LSTM layer without dropout does.
    ninp, nhid, nlayers, dropout = 128, 256, 1, 0.0
    nindices = 3

    # Initialize hidden state (the tutorial draws it at random; a sequence model starts from zeros)
    hidden = (torch.zeros(nlayers, nindices, nhid), torch.zeros(nlayers, nindices, nhid))

    # Create distributed model
    model = RNNModel("ps", ntoken, ninp, nhid, nlayers, dropout, seed=args.seed)

    # Setup distributed optimizer
    opt = DistributedOptimizer(optim.SGD, model.parameter_rrefs(), lr=args.lr)

    # The output (batch, nindices, ntoken) and target (batch, nindices) are flattened below to the
    # (N, C) logits and (N,) classes that CrossEntropyLoss takes: the tutorial's do not match.
    criterion = torch.nn.CrossEntropyLoss()
    generator = torch.Generator().manual_seed(args.seed)
    steps = args.epochs * args.batches_per_epoch
    batches = get_next_batch(generator, ntoken, batch, nindices, steps)

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
        # The tutorial prints only "Training epoch N": the loss shows that it learns.
        epoch_loss = sum(losses) / len(losses)
        print(f"Training epoch {epoch} loss {epoch_loss:.4f}")
    seconds = time.perf_counter() - start  # not in the tutorial: a line for people and scripts
    print(f"Summary: epochs={args.epochs} seconds={seconds:.2f} final_loss={epoch_loss:.4f}")


def worker_name(rank, world_size):
    return "trainer" if rank == 1 else "ps"


def run_worker(rank, world_size, args):
    r"""A wrapper function that initializes RPC, calls the function, and shuts down RPC."""
    torch.manual_seed(args.seed + rank)  # the tutorial seeds nothing: --seed repeats a run
    # The tutorial sets MASTER_ADDR and MASTER_PORT; the options name rank 0 and a timeout.
    # One init_rpc for both roles, where the tutorial has one in each branch.
    with deadline(rank, args):
        rpc.init_rpc(worker_name(rank, world_size), rank=rank, world_size=world_size,
                     rpc_backend_options=backend_options(args))
    if rank == 1:
        run_trainer(args)
    # else: the parameter server does nothing but wait for the trainer's RPCs
    # The tutorial's rpc.shutdown() alone waits forever for a peer that died: wait_for_peers first.
    wait_for_peers(rank, args)
    rpc.shutdown(timeout=args.timeout)


def parse_args(argv=None):  # the tutorial has no flags: world size 2, 10 epochs of 5 batches
    parser = argparse.ArgumentParser(
        description="RPC-based distributed RNN (model parallel) training",
        epilog="Rank 0 is the parameter server (embedding table and decoder), rank 1 the trainer "
        "(LSTM): --world_size must be 2.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)
    add = parser.add_argument
    add("--epochs", type=int, default=10, help="Training epochs.")
    add("--batches_per_epoch", type=int, default=5, help="Batches in each epoch.")
    add("--lr", type=float, default=0.05, help="Learning rate of SGD.")
    args = parse_common(parser, argv, world_size=2)
    if args.world_size != 2:
        parser.error(f"--world_size must be 2 (the parameter server and one trainer), "
                     f"got {args.world_size}")
    for flag in ("epochs", "batches_per_epoch"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be positive, got {getattr(args, flag)}")
    return args


# --------- Launching ranks, bounding waits, reporting failures --------------------
# Not in the tutorials; the same in all four.
def backend_options(args, **kwargs):
    # TCP only: shared memory busy-polls (private: pytorch/pytorch#33982).
    return rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://{args.master_addr}:{args.master_port}", rpc_timeout=args.timeout,
        _transports=["uv"], **kwargs)


@contextlib.contextmanager
def deadline(rank, args):
    # torch waits 30 min for a missing rank, forever on a silent port
    where = f"not all {args.world_size} ranks met at port {args.master_port} (check --world_size)"
    timer = threading.Timer(5 * args.timeout, fail, [rank, args, where])
    timer.start()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "You are using a Backend")
            yield
        for peer in range(args.world_size):
            rpc.get_worker_info(worker_name(peer, args.world_size))
    except Exception as exc:
        fail(rank, args, f"port {args.master_port} is in use" if "EADDRINUSE" in str(exc)
             else f"{where}: {describe(exc)}")
    finally:
        timer.cancel()


done_ranks = set()


def rank_done(rank, done):
    if done:
        done_ranks.add(rank)


def wait_for_peers(rank, args, futures=()):
    # rpc.shutdown() waits forever for a dead peer
    while len(done_ranks) < args.world_size:
        time.sleep(1)
        for peer in range(args.world_size):
            try:
                rpc.rpc_sync(peer, rank_done, args=(rank, all(f.done() for f in futures)))
            except RuntimeError:
                fail(rank, args, f"lost contact with rank {peer}")
    return [future.wait() for future in futures]


def describe(exc):
    lines = str(exc).strip().splitlines() or [""]
    if "On WorkerInfo" in lines[0]:  # from an RPC
        return " ".join(lines[:2])
    return f"{type(exc).__name__}: {lines[0]}"


def fail(rank, args, why):
    print(f"Error on rank {rank} ({worker_name(rank, args.world_size)}): {why}", file=sys.stderr)
    os._exit(1)  # sys.exit waits for threads stuck on lost peers


def run_rank(rank, args):
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C ends a rank even in torch's waits
    for stream in sys.stdout, sys.stderr:  # whole lines even unbuffered
        stream.reconfigure(line_buffering=True, write_through=False)
    # Else peers get the hostname's address: often 127.0.0.1
    if args.ifname is None and not socket.gethostbyname(args.master_addr).startswith("127."):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((args.master_addr, 1))  # UDP: sends nothing
            ours = probe.getsockname()[0]
        args.ifname = next(name for name, addrs in psutil.net_if_addrs().items()
                           if ours in [addr.address for addr in addrs])
        print(f"Rank {rank}: interface {args.ifname}")
    if args.ifname:
        for name in "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME":
            os.environ[name] = args.ifname
    try:
        run_worker(rank, args.world_size, args)
    except Exception as exc:
        fail(rank, args, traceback.format_exc() if args.debug else describe(exc))


def parse_common(parser, argv, world_size):
    add = parser.add_argument
    add("--world_size", "--world-size", type=int, default=world_size, help="All ranks.")
    add("--rank", type=int, help="Run only this rank.")
    add("--master_addr", default="localhost", help="Address of rank 0.")
    add("--master_port", type=int, default=0, help="0: 29500 with --rank, else free.")
    add("--ifname", help="Network interface.")
    add("--timeout", type=float, default=60, help="Seconds to wait for a peer or RPC (5x to meet).")
    add("--debug", action="store_true", help="Tracebacks, C++ log.")
    add("--seed", type=int, default=1, help="Seed.")
    names = "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"
    parser.set_defaults(**{name.lower(): os.environ[name] for name in names if name in os.environ})
    args = parser.parse_args(argv)
    if args.rank is not None and not 0 <= args.rank < args.world_size:
        parser.error(f"--rank must be in [0, {args.world_size})")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.rank is not None:
        args.master_port = args.master_port or 29500
        print(f"Rank {args.rank} waits {5 * args.timeout:g} s for all at "
              f"{args.master_addr}:{args.master_port}", file=sys.stderr)
        return run_rank(args.rank, args)
    if not args.master_port:  # held: no other program gets it
        held = socket.socket()
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind(("", 0))
        args.master_port = held.getsockname()[1]
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    print(f"Starting {args.world_size} ranks on port {args.master_port}", flush=True)
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited
        ranks = mp.start_processes(run_rank, (args,), args.world_size, join=False, daemon=True)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        while not ranks.join():
            pass
    except mp.ProcessExitedException as exc:
        sys.exit(f"{exc}: stopped every rank.")
    except KeyboardInterrupt:
        sys.exit("Interrupted: stopped every rank.")


if __name__ == "__main__":
    main()
