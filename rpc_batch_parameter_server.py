"""The tutorial "Implementing Batch RPC Processing Using Asynchronous Executions", part 1
(https://pytorch.org/tutorials/intermediate/rpc_async_execution.html): rank 0 steps the
model once all trainers' gradients are in.

    python rpc_batch_parameter_server.py  # every rank; or one terminal each, --rank=R
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
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
from torch import nn, optim

batch_size, image_w, image_h, num_classes, batch_update_size = 20, 64, 64, 30, 5


class BatchUpdateParameterServer(object):
    def __init__(self, batch_update_size=batch_update_size):
        # Small: the tutorial's ResNet-50 is slow on CPUs.
        self.model = nn.Sequential(nn.AvgPool2d(4), nn.Flatten(), nn.Linear(768, 64), nn.ReLU(),
                                   nn.Linear(64, num_classes))
        self.lock = threading.Lock()
        self.future_model = torch.futures.Future()
        self.batch_update_size = batch_update_size
        self.curr_update_size = 0
        # lr 2, not 0.001: MSE averages over 30 outputs.
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
            # Saved: another thread may replace it.
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
        # Class images: the tutorial's noise teaches nothing.
        self.images = torch.randn(num_classes, 3, image_w, image_h,
                                  generator=torch.Generator().manual_seed(0))

    def get_next_batch(self, batches=6):
        for _ in range(batches):  # new labels each batch: the tutorial's are fixed
            one_hot_indices = torch.randint(num_classes, (batch_size, 1))
            inputs = torch.normal(self.images[one_hot_indices[:, 0]], 1)
            labels = torch.zeros(batch_size, num_classes).scatter_(1, one_hot_indices, 1)
            yield inputs.to(self.device), labels.to(self.device)

    def train(self, batches=6):  # not the tutorial's: for --batches and the Summary
        losses = []
        m = self.ps_rref.rpc_sync().get_model().to(self.device)
        for i, (inputs, labels) in enumerate(self.get_next_batch(batches)):
            loss = self.loss_fn(m(inputs), labels)
            loss.backward()
            losses.append(loss.item())
            if i % 10 == 0:  # the example logs each step, no loss
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
    # All trainers': the example's 5 is its trainer count.
    ps_rref = rpc.RRef(BatchUpdateParameterServer(batch_update_size=len(trainers)))
    futs = []
    for trainer in trainers:  # timeout=0: training outlasts the default
        futs.append(rpc.rpc_async(trainer, run_trainer, args=(ps_rref, batches), timeout=0))
    losses = torch.tensor(torch.futures.wait_all(futs)).mean(0)
    seconds = time.perf_counter() - start  # not in the tutorial: for people and scripts
    print(f"Summary: trainers={len(trainers)} batches={batches} seconds={seconds:.2f} "
          f"first_loss={losses[0]:.4f} final_loss={losses[-1]:.4f}")


def run_worker(rank, world_size, args):  # the example's run()
    torch.set_num_threads(1)  # not the tutorial's: small ops, more only spin
    with meeting(rank, args):
        rpc.init_rpc(worker_name(rank, world_size), rank=rank, world_size=world_size,
                     rpc_backend_options=backend_options(args))
    if rank == 0:
        run_ps([worker_name(r, world_size) for r in range(1, world_size)], args.batches)
    say_done(rank, args)  # not in the tutorial: rank 0 watches until all are done
    rpc.shutdown()


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
