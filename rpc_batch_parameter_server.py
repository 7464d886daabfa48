"""The tutorial "Implementing Batch RPC Processing Using Asynchronous Executions", part 1
(https://pytorch.org/tutorials/intermediate/rpc_async_execution.html): rank 0 steps the
model once every trainer has sent its gradients.

    python rpc_batch_parameter_server.py  # every rank; or one terminal each, with --rank=R
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
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
from torch import nn, optim

batch_size, image_w, image_h, num_classes, batch_update_size = 20, 64, 64, 30, 5


class BatchUpdateParameterServer(object):
    def __init__(self, batch_update_size=batch_update_size):
        # A small net: the tutorial's ResNet-50 takes seconds a batch on CPUs.
        self.model = nn.Sequential(nn.AvgPool2d(4), nn.Flatten(), nn.Linear(768, 64), nn.ReLU(),
                                   nn.Linear(64, num_classes))
        self.lock = threading.Lock()
        self.future_model = torch.futures.Future()
        self.batch_update_size = batch_update_size
        self.curr_update_size = 0
        # lr 2, not 0.001: MSE over 30 outputs has small gradients.
        self.optimizer = optim.SGD(self.model.parameters(), lr=2, momentum=0.9)
        for p in self.model.parameters():
            p.grad = torch.zeros_like(p)

    def get_model(self):
        return self.model

    @staticmethod
    @rpc.functions.async_execution
    def update_and_fetch_model(ps_rref, grads):
        self = ps_rref.local_value()
        with self.lock:
            self.curr_update_size += 1
            for p, g in zip(self.model.parameters(), grads):
                p.grad += g
            # This call's: another thread may replace it.
            fut = self.future_model
            if self.curr_update_size >= self.batch_update_size:
                for p in self.model.parameters():
                    p.grad /= self.batch_update_size
                self.curr_update_size = 0
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=False)  # the tutorial's None breaks +=
                fut.set_result(self.model)
                self.future_model = torch.futures.Future()
        return fut


class Trainer(object):
    def __init__(self, ps_rref):
        self.ps_rref, self.loss_fn = ps_rref, torch.nn.MSELoss()
        self.device = "cuda" if torch.cuda.is_available() else "cpu"  # the tutorial's cuda
        # An image per class, shared by the trainers: the tutorial's noise teaches nothing.
        self.images = torch.randn(num_classes, 3, image_w, image_h,
                                  generator=torch.Generator().manual_seed(0))

    def get_next_batch(self, batches=6):
        for _ in range(batches):  # labels drawn each batch: the tutorial's stay fixed
            one_hot_indices = torch.randint(num_classes, (batch_size, 1))
            inputs = torch.normal(self.images[one_hot_indices[:, 0]], 1)
            labels = torch.zeros(batch_size, num_classes).scatter_(1, one_hot_indices, 1)
            yield inputs.to(self.device), labels.to(self.device)

    def train(self, batches=6):
        losses = []
        m = self.ps_rref.rpc_sync().get_model().to(self.device)
        for i, (inputs, labels) in enumerate(self.get_next_batch(batches)):
            loss = self.loss_fn(m(inputs), labels)
            loss.backward()
            losses.append(loss.item())
            if i % 10 == 0:  # with the loss; the example logs every step
                print(f"{rpc.get_worker_info().name} batch {i} loss {loss:.4f}")
            m = rpc.rpc_sync(
                self.ps_rref.owner(),
                BatchUpdateParameterServer.update_and_fetch_model,
                args=(self.ps_rref, [p.grad for p in m.cpu().parameters()]),
            ).to(self.device)
        return losses


def run_trainer(ps_rref, batches=6):
    trainer = Trainer(ps_rref)
    return trainer.train(batches)


def run_ps(trainers, batches=6):
    start = time.perf_counter()
    # All trainers': the tutorial's fixed 5 fits its 5 trainers only.
    ps_rref = rpc.RRef(BatchUpdateParameterServer(batch_update_size=len(trainers)))
    futs = []
    for trainer in trainers:  # timeout=0, none: training outlasts the default
        futs.append(rpc.rpc_async(trainer, run_trainer, args=(ps_rref, batches), timeout=0))
    losses = torch.tensor(torch.futures.wait_all(futs)).mean(0)
    seconds = time.perf_counter() - start
    print(f"Summary: trainers={len(trainers)} batches={batches} seconds={seconds:.2f} "
          f"first_loss={losses[0]:.4f} final_loss={losses[-1]:.4f}")


def run_worker(rank, world_size, args):  # the example's run()
    torch.set_num_threads(1)  # small ops: more threads only spin
    with meeting(rank, args):
        rpc.init_rpc(worker_name(rank, world_size), rank=rank, world_size=world_size,
                     rpc_backend_options=backend_options(args))
    if rank == 0:
        run_ps([worker_name(r, world_size) for r in range(1, world_size)], args.batches)
    wait_for_peers(rank, args)  # rpc.shutdown() hangs on a dead peer
    rpc.shutdown(timeout=args.timeout)


def worker_name(rank, world_size):
    return f"trainer{rank}" if rank else "ps"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--batches", type=in_range(int, 1), default=40,
                        help="Batches per trainer (the tutorial's 6 show little).")
    return parse_common(parser, argv, world_size=batch_update_size + 1, least=2)


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
