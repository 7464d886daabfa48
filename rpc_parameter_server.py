"""The tutorial "Implementing a Parameter Server Using Distributed RPC Framework"
(https://pytorch.org/tutorials/intermediate/rpc_param_server_tutorial.html): rank 0 holds the
model, every other rank trains it on MNIST over RPC.

    python rpc_parameter_server.py  # every rank; or one terminal each, with --rank=R
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
import torch.nn.functional as F
from torch import optim
from torch.distributed.optim import DistributedOptimizer


# --------- MNIST Network to train, from pytorch/examples -----
class Net(nn.Module):
    def __init__(self, num_gpus=0):
        super().__init__()
        print(f"Using {num_gpus} GPUs to train")
        self.num_gpus = num_gpus
        device = torch.device("cuda:0" if torch.cuda.is_available() and num_gpus > 0 else "cpu")
        print(f"Putting first 2 convs on {str(device)}")
        self.conv1 = nn.Conv2d(1, 32, 3, 1).to(device)
        self.conv2 = nn.Conv2d(32, 64, 3, 1).to(device)
        if "cuda" in str(device) and num_gpus > 1:
            device = torch.device("cuda:1")
        print(f"Putting rest of layers on {str(device)}")
        # nn.Dropout, as pytorch/examples' MNIST now has: Dropout2d warns on 2-D input.
        self.dropout1 = nn.Dropout(0.25).to(device)
        self.dropout2 = nn.Dropout(0.5).to(device)
        self.fc1 = nn.Linear(9216, 128).to(device)
        self.fc2 = nn.Linear(128, 10).to(device)

    def forward(self, x):
        x = self.conv1(x)
        x = F.relu(x)
        x = self.conv2(x)
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        next_device = next(self.fc1.parameters()).device
        x = x.to(next_device)
        x = self.fc1(x)
        x = F.relu(x)
        x = self.dropout2(x)
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


# --------- Helper Methods --------------------
# On the local node, call a method with first arg as the value held by the RRef.
def call_method(method, rref, *args, **kwargs):
    return method(rref.local_value(), *args, **kwargs)


# remote_method(Foo.bar, rref, arg1) calls <Foo instance>.bar(arg1) on the owner of rref.
def remote_method(method, rref, *args, **kwargs):
    args = [method, rref] + list(args)
    return rpc.rpc_sync(rref.owner(), call_method, args=args, kwargs=kwargs)


# --------- Parameter Server --------------------
class ParameterServer(nn.Module):
    def __init__(self, num_gpus=0):
        super().__init__()
        self.model = Net(num_gpus=num_gpus)
        cuda = torch.cuda.is_available() and num_gpus > 0
        self.input_device = torch.device("cuda:0" if cuda else "cpu")
        self.forward_lock = threading.Lock()

    def forward(self, inp, training=True):
        inp = inp.to(self.input_device)
        # One pass at a time: each sets the shared model's train or eval mode.
        with self.forward_lock, torch.set_grad_enabled(training):
            self.model.train(training)
            # On clones: the tutorial's pass saves the live weights, which another trainer's step
            # changes before this pass's backward (pytorch/examples#856).
            weights = {name: param.clone() for name, param in self.model.named_parameters()}
            out = torch.func.functional_call(self.model, weights, (inp,))
        return out.to("cpu")  # RPC only supports CPU tensors

    # Use dist autograd to retrieve gradients accumulated for this model.
    def get_dist_gradients(self, cid):
        grads = dist_autograd.get_gradients(cid)
        return {k.to("cpu"): v.to("cpu") for k, v in grads.items()}

    # Wrap local parameters in a RRef. Needed for building the DistributedOptimizer.
    def get_param_rrefs(self):
        return [rpc.RRef(param) for param in self.model.parameters()]


# The global parameter server instance, and a lock to ensure we only have one.
param_server = None
global_lock = threading.Lock()


def get_parameter_server(num_gpus=0):
    global param_server
    # At once: the tutorial's Net uses the CPU unnoticed, or fails later on a missing cuda:1.
    if num_gpus > torch.cuda.device_count():
        raise ValueError(f"--num_gpus {num_gpus} is more GPUs than the parameter server has "
                         f"({torch.cuda.device_count()})")
    with global_lock:  # only one handle to the ParameterServer
        if not param_server:
            param_server = ParameterServer(num_gpus=num_gpus)
        return param_server


def run_parameter_server(rank, world_size, args):  # args: the flags, the tutorial's globals
    # Built before init_rpc, not at a trainer's first call: a wrong --num_gpus stops rank 0 at once.
    get_parameter_server(args.num_gpus)
    print("PS master initializing RPC")
    # 4 RPC threads, not torch's 16: the lock runs the passes one at a time.
    with meeting(rank, args):
        rpc.init_rpc(worker_name(rank, world_size), rank=rank, world_size=world_size,
                     rpc_backend_options=backend_options(args, num_worker_threads=4))
    print("RPC initialized! Running parameter server...")
    wait_for_peers(rank, args)  # rpc.shutdown() alone hangs on a dead trainer
    rpc.shutdown(timeout=args.timeout)
    print("RPC shutdown on parameter server.")


# --------- Trainers --------------------
# The network trained by this trainer: forward() invokes it on the parameter server.
class TrainerNet(nn.Module):
    def __init__(self, num_gpus=0):
        super().__init__()
        self.num_gpus = num_gpus
        self.param_server_rref = rpc.remote(
            "parameter_server", get_parameter_server, args=(num_gpus,))

    def get_global_param_rrefs(self):
        return remote_method(ParameterServer.get_param_rrefs, self.param_server_rref)

    def forward(self, x):
        # The mode travels with the call: the tutorial's model.eval() never reaches the server.
        return remote_method(ParameterServer.forward, self.param_server_rref, x, self.training)


def run_training_loop(rank, num_gpus, train_loader, test_loader, epochs=1):
    net = TrainerNet(num_gpus=num_gpus)
    param_rrefs = net.get_global_param_rrefs()
    opt = DistributedOptimizer(optim.SGD, param_rrefs, lr=0.03)
    start = time.perf_counter()
    for epoch in range(epochs):
        for i, (data, target) in enumerate(train_loader):
            with dist_autograd.context() as cid:
                model_output = net(data)
                target = target.to(model_output.device)
                loss = F.nll_loss(model_output, target)
                if i % 5 == 0:  # 4 decimals, where the tutorial prints all
                    print(f"Rank {rank} training batch {i} loss {loss.item():.4f}")
                dist_autograd.backward(cid, [loss])
                if epoch == i == 0:  # once: the tutorial's check in every batch costs an RPC each
                    assert remote_method(
                        ParameterServer.get_dist_gradients, net.param_server_rref, cid) != {}
                opt.step(cid)
    seconds, batches = time.perf_counter() - start, epochs * len(train_loader)
    print("Training complete!")
    print("Getting accuracy....")
    accuracy = get_accuracy(test_loader, net)
    print(f"Summary: rank={rank} batches={batches} seconds={seconds:.2f} "  # not in the tutorial
          f"ms_per_batch={1000 * seconds / batches:.1f} accuracy={accuracy:.4f}")


def get_accuracy(test_loader, model):
    model.eval()
    correct_sum = 0
    device = torch.device("cuda:0" if model.num_gpus > 0 and torch.cuda.is_available() else "cpu")
    with torch.no_grad():
        for i, (data, target) in enumerate(test_loader):
            out = model(data)
            pred = out.argmax(dim=1, keepdim=True)
            pred, target = pred.to(device), target.to(device)
            correct = pred.eq(target.view_as(pred)).sum().item()
            correct_sum += correct
    acc = correct_sum / len(test_loader.dataset)
    print(f"Accuracy {acc:.4f}")
    return acc


# One entry for every rank, as torch.multiprocessing and torchrun call it: the tutorial's __main__
# picks run_parameter_server or run_worker(rank, world_size, num_gpus, train_loader, test_loader).
def run_worker(rank, world_size, args):
    if rank == 0:
        return run_parameter_server(rank, world_size, args)
    print(f"Worker rank {rank} initializing RPC")
    torch.set_num_threads(1)  # more threads would only spin
    with meeting(rank, args):
        rpc.init_rpc(worker_name(rank, world_size), rank=rank, world_size=world_size,
                     rpc_backend_options=backend_options(args))
    print(f"Worker {rank} done initializing RPC")
    # After init_rpc, unlike the tutorial: a download delays no peer's meeting.
    with machine_lock():
        train_loader, test_loader = load_mnist(args)
    run_training_loop(rank, args.num_gpus, train_loader, test_loader, epochs=args.epochs)
    wait_for_peers(rank, args)
    rpc.shutdown(timeout=args.timeout)


def load_mnist(args):
    from torchvision import datasets, transforms  # slow to import: only the trainers do

    transform = transforms.Compose(
        [transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])
    folders = [os.path.join(args.data_dir, sub) for sub in ("MNIST/raw", "MNIST", "")]
    made = [folder for folder in folders if not os.path.isdir(folder)]
    try:  # not in the tutorial: a failed download gives one line
        train_set = datasets.MNIST(args.data_dir, train=True, download=True, transform=transform)
    except RuntimeError as exc:
        for folder in made:  # the folders the download made, left empty; never the user's
            with contextlib.suppress(OSError):
                os.rmdir(folder)
        cause = str(exc).strip().splitlines()[-1]  # torchvision's report ends with the cause
        raise RuntimeError(f"cannot download MNIST into {args.data_dir} ({cause}); give "
                           "--data_dir a folder that holds MNIST/raw/") from None
    test_set = datasets.MNIST(args.data_dir, train=False, transform=transform)
    # Shuffled by torch's generator, which --seed seeds: a trainer's order repeats.
    train_loader = torch.utils.data.DataLoader(train_set, batch_size=32, shuffle=True)
    test_loader = torch.utils.data.DataLoader(test_set, batch_size=32, shuffle=True)
    return train_loader, test_loader


def worker_name(rank, world_size):
    return "parameter_server" if rank == 0 else f"trainer_{rank}"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Parameter-Server RPC based training",
        epilog="Rank 0 is the parameter server, every other rank a trainer.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)
    add = parser.add_argument
    add("--num_gpus", type=in_range(int, 0, 2), default=0, help="GPUs to use for training.")
    add("--epochs", type=in_range(int, 1), default=1, help="Epochs each trainer runs.")
    add("--data_dir", default="./data", help="Where MNIST/ is, or goes (the tutorial's ../data).")
    return parse_common(parser, argv, world_size=4, least=2)


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
