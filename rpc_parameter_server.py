"""Parameter server training with PyTorch's distributed RPC framework.

The tutorial "Implementing a Parameter Server Using Distributed RPC Framework"
(https://pytorch.org/tutorials/intermediate/rpc_param_server_tutorial.html). Rank 0 is the
parameter server: it holds the model (`Net`) and runs its forward passes. Every other rank is a
trainer: it reads MNIST, sends each batch to the parameter server over RPC, and trains the remote
weights with distributed autograd and a DistributedOptimizer.

One command starts every rank:       python rpc_parameter_server.py --world_size=4
One terminal per rank:               python rpc_parameter_server.py --world_size=2 --rank=0
                                     python rpc_parameter_server.py --world_size=2 --rank=1
torchrun:                            torchrun --nproc_per_node=4 rpc_parameter_server.py
"""
import argparse
import contextlib
import fcntl
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
        # Put conv layers on the first cuda device, or CPU if no cuda device
        self.conv1 = nn.Conv2d(1, 32, 3, 1).to(device)
        self.conv2 = nn.Conv2d(32, 64, 3, 1).to(device)
        # Put rest of the network on the 2nd cuda device, if there is one
        if "cuda" in str(device) and num_gpus > 1:
            device = torch.device("cuda:1")
        print(f"Putting rest of layers on {str(device)}")
        self.dropout1 = nn.Dropout(0.25).to(device)  # not Dropout2d, as in pytorch/examples
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
        x = x.to(next_device)  # Move tensor to next device if necessary
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
        with self.forward_lock, torch.set_grad_enabled(training):
            self.model.train(training)
            if trainers == 1:
                out = self.model(inp)
            else:
                # Another trainer's step between this pass on the live weights (the tutorial) and
                # its backward would fail it: clones keep what backward needs, and the lock runs
                # passes one at a time, as functional_call swaps the clones in.
                weights = {name: param.clone() for name, param in self.model.named_parameters()}
                out = torch.func.functional_call(self.model, weights, (inp,))
        return out.to("cpu")  # RPC carries CUDA tensors only with a device map

    # Use dist autograd to retrieve gradients accumulated for this model.
    # Primarily used for verification.
    def get_dist_gradients(self, cid):
        grads = dist_autograd.get_gradients(cid)
        return {k.to("cpu"): v.to("cpu") for k, v in grads.items()}  # to the CPU, as forward

    # Wrap local parameters in a RRef. Needed for building the DistributedOptimizer.
    def get_param_rrefs(self):
        return [rpc.RRef(param) for param in self.model.parameters()]


# The global parameter server instance, and a lock to ensure we only have one parameter server.
param_server = None
global_lock = threading.Lock()
trainers = 1  # not in the tutorial: how many trainers share it (run_parameter_server sets it)


def get_parameter_server(num_gpus=0):
    """Returns a singleton parameter server to all trainer processes."""
    global param_server
    # Checked where the GPUs are: the tutorial would use the CPU unnoticed.
    if num_gpus > torch.cuda.device_count():
        raise ValueError(f"--num_gpus {num_gpus} is more GPUs than the parameter server has "
                         f"({torch.cuda.device_count()})")
    # Ensure that we get only one handle to the ParameterServer.
    with global_lock:
        if not param_server:
            # construct it once
            param_server = ParameterServer(num_gpus=num_gpus)
        return param_server


def run_parameter_server(rank, world_size, args):
    global trainers
    trainers = world_size - 1
    # Forward (on an RPC thread) and backward (on autograd's) free each other's activations, and
    # glibc then returns about 25 MB a batch to the OS, to fault it in again. Freeing one 30 MB
    # block first raises glibc's thresholds above that; other allocators ignore it.
    torch.empty(30 * 2**20, dtype=torch.uint8)
    # The parameter server just acts as a host for the model and responds to requests from trainers.
    print("PS master initializing RPC")
    # The tutorial sets MASTER_ADDR and MASTER_PORT; the options name rank 0 and a timeout.
    # 4 RPC threads, not 16: passes run one at a time, and each thread's OpenMP team slows them.
    with deadline(rank, args):
        rpc.init_rpc(worker_name(rank, world_size), rank=rank, world_size=world_size,
                     rpc_backend_options=backend_options(args, num_worker_threads=4))
    print("RPC initialized! Running parameter server...")
    # The tutorial's "rpc.shutdown() will wait for all workers to complete by default" waits
    # forever for a trainer that died: wait_for_peers first.
    wait_for_peers(rank, args)
    rpc.shutdown(timeout=args.timeout)
    print("RPC shutdown on parameter server.")
    if args.save_model and param_server is not None:  # not in the tutorial: keep what was trained
        torch.save(param_server.model.state_dict(), args.save_model)
        print(f"Saved the trained model's state_dict to {args.save_model}")


# --------- Trainers --------------------
# nn.Module corresponding to the network trained by this trainer. The
# forward() method simply invokes the network on the given parameter server.
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


# epochs, lr and log_interval: the tutorial's fixed 1, 0.03 and 5, here as keyword arguments.
def run_training_loop(rank, num_gpus, train_loader, test_loader, epochs=1, lr=0.03,
                      log_interval=5):
    # Runs the typical neural network forward + backward + optimizer step, but
    # in a distributed fashion.
    net = TrainerNet(num_gpus=num_gpus)
    # Build DistributedOptimizer.
    param_rrefs = net.get_global_param_rrefs()
    opt = DistributedOptimizer(optim.SGD, param_rrefs, lr=lr)
    start = time.perf_counter()
    for epoch in range(epochs):
        for i, (data, target) in enumerate(train_loader):
            with dist_autograd.context() as cid:
                model_output = net(data)
                target = target.to(model_output.device)
                loss = F.nll_loss(model_output, target)
                if i % log_interval == 0:
                    # Four places; with several epochs i restarts at 0, so the line names the epoch.
                    epoch_text = f" epoch {epoch}" if epochs > 1 else ""
                    print(f"Rank {rank} training batch {i} loss {loss.item():.4f}{epoch_text}")
                dist_autograd.backward(cid, [loss])
                # Ensure that dist autograd ran successfully and gradients were returned:
                # once, not every batch (1.2M gradients each time).
                if epoch == i == 0:
                    assert remote_method(
                        ParameterServer.get_dist_gradients, net.param_server_rref, cid) != {}
                opt.step(cid)
    seconds, batches = time.perf_counter() - start, epochs * len(train_loader)
    print("Training complete!")
    print("Getting accuracy....")
    accuracy = get_accuracy(test_loader, net)
    # Not in the tutorial: one key=value line for people and scripts alike.
    print(f"Summary: rank={rank} batches={batches} seconds={seconds:.2f} "
          f"ms_per_batch={1000 * seconds / max(batches, 1):.1f} accuracy={accuracy:.4f}")


def get_accuracy(test_loader, model):
    model.eval()
    correct_sum = 0
    # Use GPU to evaluate if possible
    device = torch.device("cuda:0" if model.num_gpus > 0 and torch.cuda.is_available() else "cpu")
    with torch.no_grad():
        for i, (data, target) in enumerate(test_loader):
            out = model(data)  # the tutorial's model(data, -1) passes an argument forward lacks
            pred = out.argmax(dim=1, keepdim=True)
            pred, target = pred.to(device), target.to(device)
            correct = pred.eq(target.view_as(pred)).sum().item()
            correct_sum += correct
    acc = correct_sum / len(test_loader.dataset)
    print(f"Accuracy {acc:.4f}")  # four places, where the tutorial prints the full float
    return acc


# Main loop for trainers.
def run_worker(rank, world_size, args):
    torch.manual_seed(args.seed + rank)  # the tutorial seeds nothing: --seed repeats a run
    if rank == 0:
        return run_parameter_server(rank, world_size, args)
    print(f"Worker rank {rank} initializing RPC")
    torch.set_num_threads(1)  # a trainer only computes the loss: more threads would spin
    with deadline(rank, args):  # as in run_parameter_server
        rpc.init_rpc(worker_name(rank, world_size), rank=rank, world_size=world_size,
                     rpc_backend_options=backend_options(args))
    print(f"Worker {rank} done initializing RPC")
    # After init_rpc, not before as in the tutorial: a download holds up no peer's --timeout.
    train_loader, test_loader = load_mnist(args, rank)
    run_training_loop(rank, args.num_gpus, train_loader, test_loader, epochs=args.epochs,
                      lr=args.lr, log_interval=args.log_interval)
    wait_for_peers(rank, args)  # see run_parameter_server
    rpc.shutdown(timeout=args.timeout)


# --------- MNIST data --------------------
def load_mnist(args, rank):
    """The tutorial's train and test loaders; --train_samples/--test_samples keep the first N."""
    from torchvision import datasets, transforms  # slow to import, and only trainers need it

    raw = os.path.join(os.path.abspath(args.data_dir), "MNIST", "raw")
    normalize = transforms.Normalize((0.1307,), (0.3081,))
    transform = transforms.Compose([transforms.ToTensor(), normalize])
    try:
        with contextlib.ExitStack() as stack:
            if args.download:  # trainers started together would download into the same files
                os.makedirs(raw, exist_ok=True)
                stack.callback(os.close, lock := os.open(raw, os.O_RDONLY))
                fcntl.flock(lock, fcntl.LOCK_EX)
            train_set = datasets.MNIST(args.data_dir, train=True, download=args.download,
                                       transform=transform)
            test_set = datasets.MNIST(args.data_dir, train=False, transform=transform)
    except Exception as exc:  # torchvision's errors do not say where it looked
        cause = (str(exc).strip() or type(exc).__name__).splitlines()[0]
        raise RuntimeError(f"MNIST could not be loaded from {raw} ({cause}): put its four files "
                           "there, or point --data_dir at the folder that holds MNIST/.") from exc
    train_count = min(args.train_samples or len(train_set), len(train_set))
    test_count = min(args.test_samples or len(test_set), len(test_set))
    train_set = torch.utils.data.Subset(train_set, range(train_count))
    test_set = torch.utils.data.Subset(test_set, range(test_count))
    # Each trainer shuffles its own way, and the same way for the same --seed.
    generator = torch.Generator().manual_seed(args.seed + rank)
    train_loader = torch.utils.data.DataLoader(train_set, batch_size=args.batch_size,
                                               shuffle=True, generator=generator)
    test_loader = torch.utils.data.DataLoader(test_set, batch_size=args.batch_size)
    return train_loader, test_loader


def worker_name(rank, world_size):
    return "parameter_server" if rank == 0 else f"trainer_{rank}"


def parse_args(argv=None):  # the tutorial parses at import: a function lets others import classes
    parser = argparse.ArgumentParser(
        description="Parameter-Server RPC based training",
        epilog="Rank 0 is the parameter server, every other rank a trainer: --world_size must be "
        "at least 2 (the default 4: three trainers).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)
    add = parser.add_argument
    add("--num_gpus", type=int, default=0, help="GPUs to use for training, between 0 and 2.")
    # Not in the tutorial, which trains one epoch on all of MNIST in ../data:
    add("--epochs", type=int, default=1, help="Epochs each trainer runs.")
    add("--lr", type=float, default=0.03, help="Learning rate of SGD.")
    add("--log_interval", type=int, default=5, help="Batches between loss lines.")
    add("--batch_size", type=int, default=32, help="Batch size.")
    add("--data_dir", default="./data", help="Folder that holds (or receives) MNIST/raw/.")
    add("--download", action=argparse.BooleanOptionalAction, default=True,
        help="Get MNIST if missing.")
    add("--train_samples", type=int, default=0, help="Use the first N training images (0: all).")
    add("--test_samples", type=int, default=0, help="Use the first N test images (0: all).")
    add("--save_model", metavar="PATH", help="Where the parameter server saves the state_dict.")
    args = parse_common(parser, argv, world_size=4)
    if args.world_size < 2:
        parser.error(f"--world_size must be at least 2 (one parameter server and a trainer), "
                     f"got {args.world_size}")
    if not 0 <= args.num_gpus <= 2:  # the tutorial's assert lets 3 through
        parser.error(f"--num_gpus must be between 0 and 2, got {args.num_gpus}")
    for flag in ("epochs", "lr", "log_interval", "batch_size", "train_samples", "test_samples"):
        samples, value = flag.endswith("samples"), getattr(args, flag)
        if value < 0 or value == 0 and not samples:
            parser.error(f"--{flag} must be {'0 (all) or ' * samples}positive, got {value}")
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
