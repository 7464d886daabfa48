"""Distributed RNN training with PyTorch's RPC framework: model parallelism.

The tutorial "Getting Started with Distributed RPC Framework", part 2
(https://pytorch.org/tutorials/intermediate/rpc_tutorial.html). The model is split across two processes: the
parameter server ("ps", rank 0) holds the embedding table and the decoder, the trainer (rank 1) holds the LSTM
and drives training. RNNModel stitches the three parts together over RPC, and distributed autograd plus a
DistributedOptimizer train all three at once.

One command starts both ranks:       python rpc_rnn_model_parallel.py
One terminal per rank:               python rpc_rnn_model_parallel.py --rank=0
                                     python rpc_rnn_model_parallel.py --rank=1
torchrun:                            torchrun --nproc_per_node=2 rpc_rnn_model_parallel.py
"""
import argparse
import contextlib
import fcntl
import itertools
import os
import re
import signal
import socket
import struct
import sys
import threading
import time
import traceback
import warnings

if __name__ == "__main__" and "--debug" not in sys.argv:
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # before torch loads: no C++ warnings as peers go

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
import torch.nn as nn
import torch.optim as optim
from torch.distributed.optim import DistributedOptimizer
from torch.distributed.rpc import RRef


# --------- Distributed modules --------------------
class EmbeddingTable(nn.Module):
    r"""
    Encoding layers of the RNNModel
    """

    def __init__(self, ntoken, ninp, dropout, seed):
        super().__init__()
        # The tutorial calls .cuda() unconditionally, which fails without a GPU.
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        # The tutorial's uniform(-0.1, 0.1) barely learns in 50 steps: PyTorch's default N(0, 1), drawn from a
        # generator of its own, so the order in which the parameter server builds the parts changes nothing.
        self.encoder.weight.data.normal_(generator=torch.Generator().manual_seed(seed))
        self.encoder.to(self.device)

    def forward(self, input):
        # Back to the CPU, where the trainer's LSTM runs: RPC carries CUDA tensors only with a device map.
        return self.drop(self.encoder(input.to(self.device)).cpu())


class Decoder(nn.Module):
    r"""
    Decoding layers of the RNNModel
    """

    def __init__(self, ntoken, nhid, dropout, seed):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        # nn.Linear's default bounds rather than the tutorial's, from a generator of its own (see EmbeddingTable).
        bound, generator = nhid ** -0.5, torch.Generator().manual_seed(seed)
        self.decoder.weight.data.uniform_(-bound, bound, generator=generator)
        self.decoder.bias.data.uniform_(-bound, bound, generator=generator)

    def forward(self, output):
        return self.decoder(self.drop(output))


# --------- Helper Methods --------------------
# The tutorial's _remote_method calls local_value() on the trainer, which does not own the RRef (and takes its
# arguments in another order than its callers): it fails. These two, from pytorch/examples, run it on the owner.
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

    def __init__(self, ps, ntoken, ninp, nhid, nlayers, dropout=0.5, seed=0):
        super().__init__()
        # setup embedding table remotely
        self.emb_table_rref = rpc.remote(ps, EmbeddingTable, args=(ntoken, ninp, dropout, seed))
        # setup LSTM locally (nn.LSTM's own dropout only acts between layers)
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout if nlayers > 1 else 0.0)
        # setup decoder remotely
        self.decoder_rref = rpc.remote(ps, Decoder, args=(ntoken, nhid, dropout, seed + 1))

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
    """(data, target) pairs of shape (batch, nindices): sequences counting up by 1 modulo ntoken from seeded
    starts, so the next token is learnable; batches continue the sequences, so the hidden state carries on."""
    # The tutorial draws uninitialised memory (torch.LongTensor(batch, nindices)) and a target of shape
    # (batch, ntoken) that lines up with the output only by accident: nothing there can be learned.
    start = torch.randint(0, ntoken, (nindices,), generator=generator)
    for i in range(batches):
        tokens = (start + torch.arange(i * batch, (i + 1) * batch + 1).unsqueeze(1)) % ntoken
        yield tokens[:-1], tokens[1:]


def run_trainer(args):
    batch = 5  # sequence length, as in the tutorial
    nindices = 3  # sequences side by side, as in the tutorial
    ntoken, ninp, nhid, nlayers = args.ntoken, args.ninp, args.nhid, args.nlayers

    # Initialize hidden state (the tutorial draws it at random; a sequence model starts from zeros)
    hidden = (torch.zeros(nlayers, nindices, nhid), torch.zeros(nlayers, nindices, nhid))

    # Create distributed model
    model = RNNModel("ps", ntoken, ninp, nhid, nlayers, args.dropout, args.seed)

    # Setup distributed optimizer
    opt = DistributedOptimizer(optim.SGD, model.parameter_rrefs(), lr=args.lr)

    # The output (batch, nindices, ntoken) and target (batch, nindices) are flattened below to the (N, C) logits
    # and (N,) classes that CrossEntropyLoss takes; the tutorial's shapes do not match.
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
        # The tutorial prints only "Training epoch N": the loss shows that it learns.
        print(f"Training epoch {epoch} loss {sum(losses) / len(losses):.4f}")
    seconds = time.perf_counter() - start  # not in the tutorial: one key=value line for people and scripts alike
    print(f"Summary: epochs={args.epochs} seconds={seconds:.2f} final_loss={sum(losses) / len(losses):.4f}")


def worker_name(rank, world_size):
    return "trainer" if rank == 1 else "ps"


def run_worker(rank, world_size, args):
    r"""A wrapper function that initializes RPC, calls the function, and shuts down RPC."""
    torch.manual_seed(args.seed + rank)  # the tutorial seeds nothing; with this, --seed repeats a run
    # The tutorial sets MASTER_ADDR and MASTER_PORT; the options name rank 0's address and bound every wait.
    options = backend_options(args)
    with deadline(rank, args):  # one init_rpc for both roles, where the tutorial has one in each branch
        rpc.init_rpc(worker_name(rank, world_size), rank=rank, world_size=world_size, rpc_backend_options=options)
    if rank == 1:
        run_trainer(args)
    # else: the parameter server does nothing but wait for the trainer's RPCs
    # The tutorial's rpc.shutdown() alone waits forever for a peer that died: wait_for_peers first, and a time limit.
    wait_for_peers(rank, args)
    rpc.shutdown(timeout=args.timeout)


def parse_args(argv=None):  # the tutorial has no flags: world size 2, 10 epochs of 5 batches, fixed sizes
    parser = argparse.ArgumentParser(description="RPC-based distributed RNN (model parallel) training",
                                     epilog="Rank 0 is the parameter server (embedding table and decoder), rank 1 "
                                     "the trainer (LSTM): --world_size must be 2.",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)
    add_common_flags(parser, world_size=2)
    parser.add_argument("--epochs", type=int, default=10, help="Training epochs.")
    parser.add_argument("--batches_per_epoch", type=int, default=5, help="Batches in each epoch.")
    # The tutorial's sizes (ninp 2, nhid 3, 4 layers, dropout 0.5) do not learn in 50 steps (loss 2.36 -> 2.35): one
    # wider LSTM layer without dropout does.
    parser.add_argument("--ntoken", type=int, default=10, help="Vocabulary size.")
    parser.add_argument("--ninp", type=int, default=128, help="Embedding size.")
    parser.add_argument("--nhid", type=int, default=256, help="LSTM hidden size.")
    parser.add_argument("--nlayers", type=int, default=1, help="LSTM layers.")
    parser.add_argument("--dropout", type=float, default=0.0, help="Dropout of the embedding, decoder and LSTM.")
    parser.add_argument("--lr", type=float, default=0.05, help="Learning rate of SGD.")  # the tutorial's 0.05
    args = parser.parse_args(argv)
    check_common_args(parser, args)
    if args.world_size != 2:
        parser.error(f"--world_size must be 2 (the parameter server and one trainer), got {args.world_size}")
    for flag in ("epochs", "batches_per_epoch"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be positive, got {getattr(args, flag)}")
    if not 0 <= args.dropout < 1:
        parser.error(f"--dropout must be in [0, 1), got {args.dropout}")
    return args


# --------- Launching ranks, bounding waits, reporting failures --------------------
# Not in the tutorials; the same text in all four scripts, which each supply worker_name and run_worker above.
def backend_options(args, **kwargs):
    # TCP only: the shared-memory transport busy-polls a core per process (a private option: pytorch/pytorch#33982).
    return rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://{args.master_addr}:{args.master_port}",
                                           rpc_timeout=args.timeout, _transports=["uv"], **kwargs)


@contextlib.contextmanager
def deadline(rank, args, rpc_group=True):
    """Around init_rpc (or, rpc_group=False, init_process_group), which waits 30 minutes for a missing rank, forever
    on a silent port; after init_rpc, a check that every rank runs this script: another's would answer its RPCs."""
    where = f"not all {args.world_size} ranks of this script met at {args.master_addr}:{args.master_port}"
    (timer := threading.Timer(args.meet_timeout, fail, (rank, args, f"{where} within {args.meet_timeout:g} s: check "
                              "--world_size and --master_port."))).start()
    try:
        with warnings.catch_warnings():  # init_rpc's own use of a Gloo Backend as a ProcessGroup: not ours to fix
            warnings.filterwarnings("ignore", message="You are using a Backend .* as a ProcessGroup")
            yield
        if rpc_group:  # every rank runs this script: another script's ranks would answer its RPCs
            for peer in range(args.world_size):
                rpc.get_worker_info(worker_name(peer, args.world_size))  # raises for a name that no rank has
    except Exception as exc:  # also: the rank that hosted the meeting gave up (ranks of another --world_size came)
        fail(rank, args, f"{where}: {traceback.format_exc() if args.debug else describe(exc)}")
    timer.cancel()


_ranks_done, _all_done = itertools.count(1), torch.futures.Future()  # on rank 0: ranks done so far, and when all are


@rpc.functions.async_execution  # on rank 0: answers once every rank is done, holding no RPC thread meanwhile
def _rank_done(world_size):
    if next(_ranks_done) == world_size:  # next() on a count is atomic: two ranks done at once count as two
        _all_done.set_result(None)
    return _all_done


def wait_for_peers(rank, args, futures=None):
    """Before rpc.shutdown(), which waits forever for a peer that died: every rank tells rank 0 it is done and waits
    for the answer, which comes when all are (given futures of RPCs with no time limit: their results). Meanwhile it
    asks every peer each second if it answers: a peer whose process ended fails at once, a vanished one at --timeout."""
    done, futures = threading.Event(), futures or [rpc.rpc_async(0, _rank_done, args=(args.world_size,), timeout=0)]
    torch.futures.collect_all(futures).add_done_callback(lambda _: done.set())
    while not done.wait(timeout=1):
        for peer in set(range(args.world_size)) - {rank}:
            try:
                rpc.rpc_sync(peer, os.getpid)
            except RuntimeError:
                fail(rank, args, f"lost contact with rank {peer} ({worker_name(peer, args.world_size)}); see its output.")
    return [fut.wait() for fut in futures]  # (raises what a future failed with)


def describe(exc):
    """One line for an exception; for one raised inside an RPC, the rank it ran on and the remote exception."""
    text = str(exc).strip() or type(exc).__name__
    # The callee's repr(exception), then its traceback (torch prints it on the callee too); innermost first.
    if remote := re.findall(r"On WorkerInfo\(id=(\d+), name=(.*?)\):\n(.*)", text):
        return "an RPC that ran on rank {} ({}) raised {}".format(*remote[-1])
    lost = re.search("end of file|connection reset|closed by peer|broken pipe|no such process", text, re.I)
    return f"{type(exc).__name__}: {text.splitlines()[0]}" + " (a peer's process ended; see its output)" * bool(lost)


def fail(rank, args, message):
    print(f"Error on rank {rank} ({worker_name(rank, args.world_size)}): {message}", file=sys.stderr, flush=True)
    os._exit(1)  # RPC's threads may still wait on a peer that is gone


def pick_interface(rank, args):
    """Gloo and TensorPipe announce the address the hostname resolves to, often 127.0.0.1: for a --master_addr on
    another machine, use the interface that reaches it (SIOCGIFADDR reads an interface's address)."""
    if args.ifname is None and not socket.gethostbyname(args.master_addr).startswith("127."):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((args.master_addr, args.master_port))  # UDP: finds the route, sends nothing
            ours = socket.inet_aton(probe.getsockname()[0])
            for _, name in socket.if_nameindex():
                with contextlib.suppress(OSError):  # an interface without an address
                    if fcntl.ioctl(probe, 0x8915, struct.pack("256s", name.encode()))[20:24] == ours:
                        args.ifname = name
        print(f"Rank {rank}: using network interface {args.ifname} to reach {args.master_addr}")
    if args.ifname:
        os.environ["GLOO_SOCKET_IFNAME"] = os.environ["TP_SOCKET_IFNAME"] = os.environ["NCCL_SOCKET_IFNAME"] = args.ifname


def run_rank(rank, args):
    """One process: the tutorial's run_worker, and one line instead of a traceback if it fails."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C ends a rank at once, even inside a wait in torch
    if mp.parent_process() and not mp.parent_process().is_alive():  # a launcher killed while this rank started,
        return  # before torch.multiprocessing armed the signal that the launcher's death sends its ranks
    for stream in (sys.stdout, sys.stderr):  # whole lines, even with PYTHONUNBUFFERED=1: ranks never merge
        stream.reconfigure(line_buffering=True, write_through=False)
    try:
        pick_interface(rank, args)
        run_worker(rank, args.world_size, args)
    except Exception as exc:
        fail(rank, args, traceback.format_exc() if args.debug else describe(exc))


def add_common_flags(parser, world_size):
    parser.add_argument("--world_size", "--world-size", type=int, default=world_size, help="Processes, all roles.")
    parser.add_argument("--rank", type=int, help="Run only this rank (a terminal or machine each); else all here.")
    parser.add_argument("--master_addr", default="localhost", help="Address of rank 0.")
    parser.add_argument("--master_port", type=int, help="Port of rank 0; 29500 with --rank, else a free one.")
    parser.add_argument("--ifname", help="Network interface to use; found from --master_addr if it is not local.")
    parser.add_argument("--timeout", type=float, help="Longest wait for a peer or an RPC, in seconds (default: 60; "
                        "ranks started by hand with --rank wait 300 s for each other).")
    parser.add_argument("--debug", action="store_true", help="On a failure, the traceback and torch's own log too.")
    parser.add_argument("--seed", type=int, default=1, help="Random seed.")
    parser.set_defaults(**{name.lower(): os.environ[name] for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
                           if name in os.environ})  # set by torchrun (and other launchers); a flag overrides them


def check_common_args(parser, args):
    if args.rank is not None and not 0 <= args.rank < args.world_size:
        parser.error(f"--rank must be in [0, {args.world_size}) for --world_size {args.world_size}, got {args.rank}")
    args.master_port = args.master_port or (29500 if args.rank is not None else None)
    by_hand = args.rank is not None and "RANK" not in os.environ  # one terminal per rank: a person starts the rest
    args.timeout, args.meet_timeout = args.timeout or 60.0, args.timeout or (300 if by_hand else 60)


def main(argv=None):
    args = parse_args(argv)
    if args.rank is not None:  # one rank per process, its peers perhaps not started yet: say what it waits for
        print(f"Rank {args.rank} waits up to {args.meet_timeout:g} s for all {args.world_size} ranks at "
              f"{args.master_addr}:{args.master_port}", file=sys.stderr)
        return run_rank(args.rank, args)
    if args.master_port is None:  # a free port, held until the run ends by a socket bound to it, never listening:
        (port := socket.socket()).setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (rank 0 can still listen)
        port.bind(("", 0))  # the OS gives it to no one else
        args.master_port = port.getsockname()[1]
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # `kill` stops the ranks as Ctrl-C does
    print(f"Starting {args.world_size} ranks; rank 0 listens on {args.master_addr}:{args.master_port}", flush=True)
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited: a Ctrl-C while a rank starts cannot cut it off
        ranks = mp.start_processes(run_rank, args=(args,), nprocs=args.world_size, join=False, daemon=True)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # (run_rank gives each rank the default action)
        while not ranks.join(grace_period=3):  # when a rank fails, the others have 3 s to say why, then SIGTERM
            pass
    except mp.ProcessExitedException as exc:
        sys.exit(f"Rank {exc.error_index} ({worker_name(exc.error_index, args.world_size)}) ended with "
                 f"{exc.signal_name or f'exit code {exc.exit_code}'}: stopped every rank.")
    except KeyboardInterrupt:
        print("Interrupted: stopping every rank.", file=sys.stderr)
        sys.exit(130)  # the daemonic ranks are terminated as this process exits


if __name__ == "__main__":
    main()
