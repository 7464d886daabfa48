"""The tutorial "Implementing a Parameter Server Using Distributed RPC Framework"
(https://pytorch.org/tutorials/intermediate/rpc_param_server_tutorial.html): rank 0 holds the
model, every other rank trains it on MNIST over RPC.

    python rpc_parameter_server.py  # every rank; or one terminal each, with --rank=R
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
        # Convs on the first GPU, else the CPU.
        self.conv1 = nn.Conv2d(1, 32, 3, 1).to(device)
        self.conv2 = nn.Conv2d(32, 64, 3, 1).to(device)
        # The rest on a second GPU, if any.
        if "cuda" in str(device) and num_gpus > 1:
            device = torch.device("cuda:1")
        print(f"Putting rest of layers on {str(device)}")
        # nn.Dropout, as pytorch/examples' MNIST now has: the tutorial's Dropout2d warns on
        # dropout2's 2-D input.
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
        x = x.flatten(start_dim=1)
        next_device = next(self.fc1.parameters()).device
        x = x.to(next_device)  # fc1 may be on another device
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
            # Clones: another trainer's step changes the live weights the tutorial's pass saves,
            # before its backward (pytorch/examples#856).
            weights = {name: param.clone() for name, param in self.model.named_parameters()}
            out = torch.func.functional_call(self.model, weights, (inp,))
        return out.to("cpu")  # RPC only supports CPU tensors

    # Use dist autograd to retrieve gradients accumulated for this model.
    def get_dist_gradients(self, cid):
        grads = dist_autograd.get_gradients(cid)
        return {k.to("cpu"): v.to("cpu") for k, v in grads.items()}  # RPC only supports CPU tensors

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


def run_parameter_server(rank, world_size, args):  # args: the flags, which the tutorial's lacks
    # The server only hosts the model and answers the trainers.
    # Built before init_rpc, not at a trainer's first call: a wrong --num_gpus stops rank 0 at once.
    get_parameter_server(args.num_gpus)
    print("PS master initializing RPC")
    # 4 RPC threads, not torch's 16: the lock runs the passes one at a time.
    with meeting(rank, args):
        rpc.init_rpc(worker_name(rank, world_size), rank=rank, world_size=world_size,
                     rpc_backend_options=backend_options(args, num_worker_threads=4))
    print("RPC initialized! Running parameter server...")
    say_done(rank, args)  # not in the tutorial: rank 0 watches until all are done
    rpc.shutdown()  # waits for all trainers to finish
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
    for epoch in range(epochs):  # --epochs passes, where the tutorial makes one
        for i, (data, target) in enumerate(train_loader):
            with dist_autograd.context() as cid:
                model_output = net(data)
                target = target.to(model_output.device)
                loss = F.nll_loss(model_output, target)
                if i % 5 == 0:  # 4 decimals, where the tutorial prints all
                    print(f"Rank {rank} training batch {i} loss {loss.item():.4f}")
                dist_autograd.backward(cid, [loss])
                # Dist autograd gave gradients: checked once, not each batch (an RPC each).
                if epoch == i == 0:
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
    # A GPU if possible.
    device = torch.device("cuda:0" if model.num_gpus > 0 and torch.cuda.is_available() else "cpu")
    with torch.no_grad():
        for i, (data, target) in enumerate(test_loader):
            out = model(data)  # no -1: the tutorial's extra argument fails in forward(x)
            pred = out.argmax(dim=1, keepdim=True)
            pred, target = pred.to(device), target.to(device)
            correct = pred.eq(target.view_as(pred)).sum().item()
            correct_sum += correct
    acc = correct_sum / len(test_loader.dataset)
    # To 4 places and returned, for the Summary line: the tutorial prints all, returns none.
    print(f"Accuracy {acc:.4f}")
    return acc


# One entry for every rank, as mp and torchrun call it: the tutorial's __main__ picks
# run_parameter_server or run_worker(rank, world_size, num_gpus, train_loader, test_loader).
def run_worker(rank, world_size, args):
    if rank == 0:
        return run_parameter_server(rank, world_size, args)
    print(f"Worker rank {rank} initializing RPC")
    torch.set_num_threads(1)  # not in the tutorial: more threads would only spin
    with meeting(rank, args):
        rpc.init_rpc(worker_name(rank, world_size), rank=rank, world_size=world_size,
                     rpc_backend_options=backend_options(args))
    print(f"Worker {rank} done initializing RPC")
    # After init_rpc, unlike the tutorial: a download delays no peer's meeting.
    with machine_lock():  # trainers on one machine download in turn
        train_loader, test_loader = load_mnist(args)
    run_training_loop(rank, args.num_gpus, train_loader, test_loader, epochs=args.epochs)
    say_done(rank, args)  # not in the tutorial: rank 0 watches until all are done
    rpc.shutdown()  # waits for every worker, the server too


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
    # Flags, as in the tutorial's commands: its code makes rank and num_gpus positional.
    add("--num_gpus", type=in_range(int, 0, 2), default=0, help="GPUs to use for training.")
    add("--epochs", type=in_range(int, 1), default=1, help="Epochs each trainer runs.")
    add("--data_dir", default="./data", help="Where MNIST/ is, or goes (the tutorial's ../data).")
    return parse_common(parser, argv, world_size=4, least=2)


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
