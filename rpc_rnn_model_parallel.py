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
from torch.distributed.optim import DistributedOptimizer
from torch.distributed.rpc import RRef

PS_NAME = "ps"
TRAINER_NAME = "trainer"
# TCP (uv) rather than TensorPipe's default shared memory, whose reactor
# busy-polls a core in each process: see rpc_parameter_server.py.
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
        # RPC carries CPU tensors: move the lookup's result back before returning it.
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
        print(f"Training epoch {epoch} loss {epoch_loss:.4f}", flush=True)
    seconds = time.perf_counter() - start
    print(f"Summary: epochs={args.epochs} seconds={seconds:.2f} final_loss={epoch_loss:.4f}", flush=True)


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
        description="RPC-based distributed RNN (model parallel) training",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _add_common_flags(parser, world_size=2)
    parser.add_argument("--seed", type=int, default=1, help="Random seed (model init and data).")
    parser.add_argument("--epochs", type=int, default=10, help="Training epochs.")
    parser.add_argument("--batches_per_epoch", type=int, default=5, help="Batches in each epoch.")
    # The tutorial's sizes (ninp 2, nhid 3, 4 layers, dropout 0.5) do not learn
    # in its 50 SGD steps at lr 0.05 (loss 2.36 -> 2.35); one wider LSTM layer
    # without dropout does (stacked layers learn far slower at this rate).
    parser.add_argument("--ntoken", type=int, default=10, help="Vocabulary size.")
    parser.add_argument("--ninp", type=int, default=128, help="Embedding size.")
    parser.add_argument("--nhid", type=int, default=256, help="LSTM hidden size.")
    parser.add_argument("--nlayers", type=int, default=1, help="LSTM layers.")
    parser.add_argument("--dropout", type=float, default=0.0, help="Dropout of the embedding, decoder and between LSTM layers.")
    parser.add_argument("--lr", type=float, default=0.05, help="Learning rate of SGD.")
    args = parser.parse_args(argv)
    _check_common_args(parser, args, min_world_size=2, roles="the parameter server and the trainer")
    if args.world_size != 2:
        parser.error(f"--world_size must be 2 (the tutorial's parameter server and one trainer), got {args.world_size}")
    for flag in ("epochs", "batches_per_epoch", "ntoken", "ninp", "nhid", "nlayers", "lr"):
        if getattr(args, flag) <= 0:
            parser.error(f"--{flag} must be positive, got {getattr(args, flag)}")
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
    sys.exit(main())
