"""Parameter server training with PyTorch's distributed RPC framework.

The tutorial "Implementing a Parameter Server Using Distributed RPC Framework"
(https://pytorch.org/tutorials/intermediate/rpc_param_server_tutorial.html). Rank 0 is the parameter server: it
holds the model (`Net`) and runs its forward passes. Every other rank is a trainer: it reads MNIST, sends each batch
to the parameter server over RPC, and trains the remote weights with distributed autograd and a DistributedOptimizer.

One command starts every rank:       python rpc_parameter_server.py --world_size=4
One terminal per rank:               python rpc_parameter_server.py --world_size=2 --rank=0
                                     python rpc_parameter_server.py --world_size=2 --rank=1
torchrun:                            torchrun --nproc_per_node=4 rpc_parameter_server.py
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
import torch.nn.functional as F
from torch import optim
from torch.distributed.optim import DistributedOptimizer


# --------- MNIST Network to train, from pytorch/examples -----
class Net(nn.Module):
    def __init__(self, num_gpus=0):
        super().__init__()
        print(f"Using {num_gpus} GPUs to train")
        self.num_gpus = num_gpus
        device = torch.device("cuda:0" if torch.cuda.is_available() and self.num_gpus > 0 else "cpu")
        print(f"Putting first 2 convs on {str(device)}")
        # Put conv layers on the first cuda device, or CPU if no cuda device
        self.conv1 = nn.Conv2d(1, 32, 3, 1).to(device)
        self.conv2 = nn.Conv2d(32, 64, 3, 1).to(device)
        # Put rest of the network on the 2nd cuda device, if there is one
        if "cuda" in str(device) and num_gpus > 1:
            device = torch.device("cuda:1")
        print(f"Putting rest of layers on {str(device)}")
        self.dropout1 = nn.Dropout(0.25).to(device)  # not Dropout2d: on flat features it warns (pytorch/examples)
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


# remote_method(Foo.bar, rref, arg1) calls <Foo instance>.bar(arg1) on the node that owns rref, and returns the result.
def remote_method(method, rref, *args, **kwargs):
    args = [method, rref] + list(args)
    return rpc.rpc_sync(rref.owner(), call_method, args=args, kwargs=kwargs)


# --------- Parameter Server --------------------
class ParameterServer(nn.Module):
    def __init__(self, num_gpus=0):
        super().__init__()
        self.model = Net(num_gpus=num_gpus)
        self.input_device = torch.device("cuda:0" if torch.cuda.is_available() and num_gpus > 0 else "cpu")
        self.forward_lock = threading.Lock()

    def forward(self, inp, training=True):
        inp = inp.to(self.input_device)
        # Several trainers: another trainer's optimizer step between a pass on the live weights (the tutorial) and
        # its backward fails it; clones keep what backward needs. forward_lock runs passes one at a time, as
        # functional_call swaps clones and mode in; optimizer steps are NOT serialised against forward passes.
        with self.forward_lock, torch.set_grad_enabled(training):
            self.model.train(training)
            weights = {name: param.clone() for name, param in self.model.named_parameters()}
            out = torch.func.functional_call(self.model, weights, (inp,))
        return out.to("cpu")  # RPC carries CUDA tensors only with a device map; the CPU round trip needs none

    # Use dist autograd to retrieve gradients accumulated for this model. Primarily used for verification.
    def get_dist_gradients(self, cid):
        return {k.to("cpu"): v.to("cpu") for k, v in dist_autograd.get_gradients(cid).items()}  # for RPC, as forward

    # Wrap local parameters in a RRef. Needed for building the DistributedOptimizer.
    def get_param_rrefs(self):
        return [rpc.RRef(param) for param in self.model.parameters()]


# The global parameter server instance, and a lock to ensure we only have one parameter server.
param_server = None
global_lock = threading.Lock()


def get_parameter_server(num_gpus=0):
    """Returns a singleton parameter server to all trainer processes."""
    global param_server
    if num_gpus > torch.cuda.device_count():  # each trainer sends its own --num_gpus: check it where the GPUs are
        raise ValueError(f"a trainer's --num_gpus {num_gpus} is more than this machine's {torch.cuda.device_count()}")
    with global_lock:  # Ensure that we get only one handle to the ParameterServer.
        if not param_server:
            param_server = ParameterServer(num_gpus=num_gpus)
        return param_server


def run_parameter_server(rank, world_size, args):
    if args.num_gpus > torch.cuda.device_count():  # the model lives here; the tutorial would use the CPU unnoticed
        raise ValueError(f"--num_gpus {args.num_gpus} is more GPUs than this machine has ({torch.cuda.device_count()})")
    # The parameter server just acts as a host for the model and responds to requests from trainers.
    print("PS master initializing RPC")
    # The tutorial sets MASTER_ADDR and MASTER_PORT; the options name rank 0's address and bound every wait.
    # 4 RPC threads, not 16: passes run one at a time (forward_lock), and each thread's OpenMP team slows them.
    with deadline(rank, args):
        rpc.init_rpc(worker_name(rank, world_size), rank=rank, world_size=world_size,
                     rpc_backend_options=backend_options(args, num_worker_threads=4))
    print("RPC initialized! Running parameter server...")
    # The tutorial: "rpc.shutdown() will wait for all workers to complete by default", which it does forever for a
    # trainer that died. wait_for_peers waits for every trainer, watching each, and then shutdown has a time limit.
    wait_for_peers(rank, args)
    rpc.shutdown(timeout=args.timeout)
    print("RPC shutdown on parameter server.")
    if args.save_model and param_server is not None:  # not in the tutorial, whose training is lost at exit
        torch.save(param_server.model.state_dict(), args.save_model)
        print(f"Saved the trained model's state_dict to {args.save_model}")


# --------- Trainers --------------------
# nn.Module corresponding to the network trained by this trainer: forward() invokes it on the parameter server.
class TrainerNet(nn.Module):
    def __init__(self, num_gpus=0):
        super().__init__()
        self.num_gpus = num_gpus
        self.param_server_rref = rpc.remote("parameter_server", get_parameter_server, args=(num_gpus,))

    def get_global_param_rrefs(self):
        return remote_method(ParameterServer.get_param_rrefs, self.param_server_rref)

    def forward(self, x):
        # The mode travels with the call: the tutorial's model.eval() never reaches the model on the server.
        return remote_method(ParameterServer.forward, self.param_server_rref, x, self.training)


# epochs, lr and log_interval: the tutorial's fixed 1, 0.03 and 5, here from the command line.
def run_training_loop(rank, num_gpus, train_loader, test_loader, epochs=1, lr=0.03, log_interval=5):
    # Runs the typical neural network forward + backward + optimizer step, but in a distributed fashion.
    net = TrainerNet(num_gpus=num_gpus)
    param_rrefs = net.get_global_param_rrefs()
    opt = DistributedOptimizer(optim.SGD, param_rrefs, lr=lr)  # Build DistributedOptimizer.
    start = time.perf_counter()
    for epoch in range(epochs):  # the tutorial trains one epoch: --epochs for more
        for i, (data, target) in enumerate(train_loader):
            with dist_autograd.context() as cid:
                model_output = net(data)
                target = target.to(model_output.device)
                loss = F.nll_loss(model_output, target)
                if i % log_interval == 0:
                    # Four places, not the full float; with several epochs i restarts at 0, so name the epoch.
                    print(f"Rank {rank} training batch {i} loss {loss.item():.4f}" + f" epoch {epoch}" * (epochs > 1))
                dist_autograd.backward(cid, [loss])
                # Ensure that dist autograd returned gradients: once, not every batch (1.2M gradients each time).
                if epoch == i == 0:
                    assert remote_method(ParameterServer.get_dist_gradients, net.param_server_rref, cid) != {}
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
        for data, target in test_loader:
            out = model(data)  # the tutorial's model(data, -1) passes an argument TrainerNet.forward does not take
            pred = out.argmax(dim=1, keepdim=True)
            pred, target = pred.to(device), target.to(device)
            correct_sum += pred.eq(target.view_as(pred)).sum().item()
    accuracy = correct_sum / len(test_loader.dataset)
    print(f"Accuracy {accuracy:.4f}")  # four places: a --test_samples subset would print 0.6666666666666666
    return accuracy


# Main loop for trainers. The launcher below calls it for every rank, with flags for num_gpus and the loaders.
def run_worker(rank, world_size, args):
    torch.manual_seed(args.seed + rank)  # the tutorial seeds nothing; with this, --seed repeats a one-trainer run
    if rank == 0:
        return run_parameter_server(rank, world_size, args)
    print(f"Worker rank {rank} initializing RPC")
    torch.set_num_threads(1)  # a trainer only computes the loss: a second thread would spin against the server's
    with deadline(rank, args):  # options and deadline: as in run_parameter_server
        rpc.init_rpc(worker_name(rank, world_size), rank=rank, world_size=world_size,
                     rpc_backend_options=backend_options(args))
    print(f"Worker {rank} done initializing RPC")
    # After init_rpc, not before as in the tutorial: a download holds up no peer's --timeout.
    train_loader, test_loader = load_mnist(args, rank)
    run_training_loop(rank, args.num_gpus, train_loader, test_loader, args.epochs, args.lr, args.log_interval)
    wait_for_peers(rank, args)  # see run_parameter_server
    rpc.shutdown(timeout=args.timeout)


# --------- MNIST data --------------------
def load_mnist(args, rank):
    """The tutorial's train and test loaders; --train_samples/--test_samples keep the first N."""
    from torchvision import datasets, transforms  # slow to import, and only the trainers need it
    raw = os.path.join(os.path.abspath(args.data_dir), "MNIST", "raw")
    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])
    try:
        with contextlib.ExitStack() as stack:
            if args.download:  # trainers started together would download into the same files: one at a time
                os.makedirs(raw, exist_ok=True)
                stack.callback(os.close, lock := os.open(raw, os.O_RDONLY))
                fcntl.flock(lock, fcntl.LOCK_EX)
            train_set = datasets.MNIST(args.data_dir, train=True, download=args.download, transform=transform)
            test_set = datasets.MNIST(args.data_dir, train=False, transform=transform)
    except Exception as exc:  # torchvision's RuntimeError is the same for a missing set and a damaged file
        files = [f"{split}-{kind}-ubyte" for split in ("train", "t10k") for kind in ("images-idx3", "labels-idx1")]
        cause = (str(exc).strip() or type(exc).__name__).splitlines()[0]
        if isinstance(exc, OSError) and not isinstance(exc, (ConnectionError, TimeoutError)):  # the disk
            raise OSError(f"MNIST could not be read or written in {raw} ({cause}): check that folder's permissions "
                          f"and free space, or point --data_dir at another folder.") from exc
        if all(os.path.exists(os.path.join(raw, name)) for name in files):  # all there, yet unreadable
            raise ValueError(f"MNIST in {raw} could not be read ({cause}): one of its four files is truncated or "
                             f"damaged; delete the four and put them there again.") from exc
        # Not the download's own error (--debug shows it): its "Name or service not known" reads as a bad address.
        why = "could not be downloaded (no network?)" if args.download else "--no-download forbids fetching it"
        raise FileNotFoundError(f"MNIST is not in {raw} and {why}. Put {', '.join(files)} there, or point "
                                f"--data_dir at the folder that holds MNIST/.") from exc
    train_set = torch.utils.data.Subset(train_set, range(min(args.train_samples or len(train_set), len(train_set))))
    test_set = torch.utils.data.Subset(test_set, range(min(args.test_samples or len(test_set), len(test_set))))
    generator = torch.Generator().manual_seed(args.seed + rank)  # each trainer shuffles its own way, reproducibly
    train_loader = torch.utils.data.DataLoader(train_set, batch_size=args.batch_size, shuffle=True, generator=generator)
    test_loader = torch.utils.data.DataLoader(test_set, batch_size=args.batch_size)  # unshuffled: same accuracy
    return train_loader, test_loader


def worker_name(rank, world_size):
    return "parameter_server" if rank == 0 else f"trainer_{rank}"


def parse_args(argv=None):  # the tutorial parses at import; a function lets tests and users import the classes
    parser = argparse.ArgumentParser(description="Parameter-Server RPC based training",
                                     epilog="Rank 0 is the parameter server, every other rank a trainer: "
                                     "--world_size must be at least 2 (the default 4: three trainers).",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)
    add_common_flags(parser, world_size=4)
    parser.add_argument("--num_gpus", type=int, default=0, help="GPUs to use for training, between 0 and 2.")
    # Not in the tutorial, which trains one epoch on all of MNIST from ../data, lr 0.03, batch 32, a line per 5:
    parser.add_argument("--epochs", type=int, default=1, help="Epochs each trainer runs.")
    parser.add_argument("--lr", type=float, default=0.03, help="Learning rate of SGD.")
    parser.add_argument("--log_interval", type=int, default=5, help="Batches between loss lines.")
    parser.add_argument("--batch_size", type=int, default=32, help="Batch size.")
    # ./data, not the tutorial's ../data, which is outside the folder the user runs the script in.
    parser.add_argument("--data_dir", default="./data", help="Folder that holds (or receives) MNIST/raw/.")
    parser.add_argument("--download", action=argparse.BooleanOptionalAction, default=True, help="Get MNIST if missing.")
    parser.add_argument("--train_samples", type=int, default=0, help="Use only the first N training images (0: all).")
    parser.add_argument("--test_samples", type=int, default=0, help="Use only the first N test images (0: all).")
    parser.add_argument("--save_model", metavar="PATH", help="The parameter server saves the trained state_dict here.")
    args = parser.parse_args(argv)
    check_common_args(parser, args)
    if args.world_size < 2:
        parser.error(f"--world_size must be at least 2 (one parameter server and a trainer), got {args.world_size}")
    if not 0 <= args.num_gpus <= 2:  # the tutorial's assert lets 3 through, though its message says 0-2
        parser.error(f"--num_gpus must be between 0 and 2, got {args.num_gpus}")
    for flag in ("epochs", "lr", "log_interval", "batch_size", "train_samples", "test_samples"):
        samples, value = flag.endswith("samples"), getattr(args, flag)
        if value < 0 or value == 0 and not samples:
            parser.error(f"--{flag} must be {'0 (all) or ' * samples}positive, got {value}")
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
