"""Parameter server training with PyTorch's distributed RPC framework.

Rank 0 is the parameter server: it owns the model (`Net`) and runs its forward
and backward passes. Every other rank is a trainer: it reads MNIST, sends each
batch to the parameter server over RPC, runs the backward pass with distributed
autograd and updates the remote weights with a DistributedOptimizer.

One command starts every rank:          python rpc_parameter_server.py --world_size=4
One terminal per rank (tutorial form):  python rpc_parameter_server.py --world_size=2 --rank=0
                                        python rpc_parameter_server.py --world_size=2 --rank=1
"""
import argparse
import contextlib
import fcntl
import ipaddress
import os
import signal
import socket
import struct
import sys
import threading
import time
import traceback
import warnings
from datetime import timedelta

if __name__ == "__main__" and "--debug" not in sys.argv:
    # Before torch loads: its C++ log would repeat each failure as warnings, errors and stack dumps.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")

import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch import optim
from torch.distributed.optim import DistributedOptimizer

PS_NAME = "parameter_server"
TRAINER_NAME = "trainer_{}"
# TCP (uv) only: the shared-memory transport busy-polls and starves other runs on the machine (README,
# "Sharing a machine"); the choice is a private option until pytorch/pytorch#33982.
RPC_TRANSPORTS = ["uv"]
PS_RPC_THREADS = 4


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
        # The tutorial uses Dropout2d on a flattened tensor, which PyTorch now
        # warns about; Dropout is what it means (as in pytorch/examples).
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
        # Move tensor to next device if necessary
        next_device = next(self.fc1.parameters()).device
        x = x.to(next_device)
        x = self.fc1(x)
        x = F.relu(x)
        x = self.dropout2(x)
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


# --------- Helper Methods --------------------


# On the local node, call a method with first arg as the value held by the
# RRef. Other args are passed in as arguments to the function called.
# Useful for calling instance methods. method could be any matching function,
# including class methods.
def call_method(method, rref, *args, **kwargs):
    return method(rref.local_value(), *args, **kwargs)


# Given an RRef, return the result of calling the passed in method on the
# value held by the RRef. This call is done on the remote node that owns
# the RRef and passes along the given argument.
# Example: If the value held by the RRef is of type Foo, then
# remote_method(Foo.bar, rref, arg1, arg2) is equivalent to calling
# <foo_instance>.bar(arg1, arg2) on the remote node and getting the result
# back.
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
        # The tutorial runs on the live weights, which another trainer's optimizer step changes in place
        # before this pass's backward ("modified by an inplace operation"); clones keep what backward needs
        # and pass gradients on to the parameters. forward_lock makes all trainers' forward passes run one
        # at a time, as functional_call swaps the clones (and train/eval mode) into the one shared module.
        inp = inp.to(self.input_device)
        with self.forward_lock, torch.set_grad_enabled(training):
            self.model.train(training)
            weights = {name: param.clone() for name, param in self.model.named_parameters()}
            out = torch.func.functional_call(self.model, weights, (inp,))
        # RPC carries CUDA tensors only with a device map (TensorPipe, since torch 1.8); the CPU round trip needs none.
        return out.to("cpu")

    # Use dist autograd to retrieve gradients accumulated for this model.
    # Primarily used for verification.
    def get_dist_gradients(self, cid):
        grads = dist_autograd.get_gradients(cid)
        # RPC carries CUDA tensors only with a device map (TensorPipe, since torch 1.8); the CPU round trip needs none.
        return {k.to("cpu"): v.to("cpu") for k, v in grads.items()}

    # Wrap local parameters in a RRef. Needed for building the
    # DistributedOptimizer which optimizes parameters remotely.
    def get_param_rrefs(self):
        return [rpc.RRef(param) for param in self.model.parameters()]


# The global parameter server instance. The tutorial keeps it as module state
# because every trainer's rpc.remote(get_parameter_server) must get the same one.
param_server = None
global_lock = threading.Lock()


def get_parameter_server(num_gpus=0):
    """Returns a singleton parameter server to all trainer processes."""
    global param_server
    # Each trainer sends its own --num_gpus; run_parameter_server checked only the server's.
    if num_gpus > torch.cuda.device_count():
        raise ValueError(f"a trainer asked for a parameter server on {num_gpus} GPUs, but the parameter "
                         f"server's machine has {torch.cuda.device_count()}: lower --num_gpus on the trainers.")
    # Ensure that we get only one handle to the ParameterServer.
    with global_lock:
        if not param_server:
            # construct it once
            param_server = ParameterServer(num_gpus=num_gpus)
        return param_server


def run_parameter_server(rank, world_size, args):
    # The model is placed on this machine, so this is where --num_gpus must fit.
    if args.num_gpus > torch.cuda.device_count():
        raise RankFailure(f"--num_gpus {args.num_gpus} asks for {args.num_gpus} GPUs on the parameter server (rank 0), "
                          f"but its machine has {torch.cuda.device_count()}: run rank 0 on a machine with that many "
                          f"GPUs, or lower --num_gpus on every rank.")
    # The parameter server just acts as a host for the model and responds to
    # requests from trainers.
    # rpc.shutdown() will wait for all workers to complete by default, which
    # in this case means that the parameter server will wait for all trainers
    # to complete, and then exit.
    print("PS master initializing RPC")
    # Forward passes run one at a time (forward_lock), so a few RPC threads serve any number of trainers; each
    # thread that runs a pass brings its own OpenMP team and memory arena, and more of them only slow each pass.
    _init_rpc(PS_NAME, rank, world_size, args, num_worker_threads=PS_RPC_THREADS)
    print("RPC initialized! Running parameter server...")
    _shutdown(rank, world_size, args)
    print("RPC shutdown on parameter server.")
    if args.save_model and param_server is not None:
        torch.save(param_server.model.state_dict(), args.save_model)
        print(f"Saved the trained model's state_dict to {args.save_model}")


# --------- Trainers --------------------


# nn.Module corresponding to the network trained by this trainer. The
# forward() method simply invokes the network on the given parameter
# server.
class TrainerNet(nn.Module):
    def __init__(self, num_gpus=0):
        super().__init__()
        self.num_gpus = num_gpus
        self.param_server_rref = rpc.remote(PS_NAME, get_parameter_server, args=(num_gpus,))

    def get_global_param_rrefs(self):
        return remote_method(ParameterServer.get_param_rrefs, self.param_server_rref)

    def forward(self, x):
        # The tutorial's model.eval() never reached the model on the parameter
        # server, so dropout stayed on while accuracy was measured; this
        # module's own train/eval mode now travels with every call.
        return remote_method(ParameterServer.forward, self.param_server_rref, x, self.training)


def run_training_loop(rank, num_gpus, train_loader, test_loader, epochs=1, lr=0.03, log_interval=5):
    # Runs the typical neural network forward + backward + optimizer step, but
    # in a distributed fashion.
    net = TrainerNet(num_gpus=num_gpus)
    # Build DistributedOptimizer.
    param_rrefs = net.get_global_param_rrefs()
    opt = DistributedOptimizer(optim.SGD, param_rrefs, lr=lr)
    batches = 0
    start = time.perf_counter()
    for epoch in range(epochs):
        for i, (data, target) in enumerate(train_loader):
            with dist_autograd.context() as cid:
                model_output = net(data)
                target = target.to(model_output.device)
                loss = F.nll_loss(model_output, target)
                if i % log_interval == 0:
                    # The tutorial prints the full float, and one epoch: i restarts at 0, so name the epoch.
                    epoch_note = f" epoch {epoch}" if epochs > 1 else ""
                    print(f"Rank {rank} training batch {i} loss {loss.item():.4f}{epoch_note}")
                dist_autograd.backward(cid, [loss])
                # Ensure that dist autograd ran successfully and gradients were
                # returned. The tutorial checks every batch, which ships all
                # 1.2M gradients back to the trainer each time; once is enough.
                if batches == 0:
                    assert remote_method(ParameterServer.get_dist_gradients, net.param_server_rref, cid) != {}
                opt.step(cid)
            batches += 1
    seconds = time.perf_counter() - start

    print("Training complete!")
    print("Getting accuracy....")
    accuracy = get_accuracy(test_loader, net)
    print(
        f"Summary: rank={rank} batches={batches} seconds={seconds:.2f} "
        f"ms_per_batch={1000 * seconds / max(batches, 1):.1f} accuracy={accuracy:.4f}"
    )


def get_accuracy(test_loader, model):
    model.eval()
    correct_sum = 0
    # Use GPU to evaluate if possible
    device = torch.device("cuda:0" if model.num_gpus > 0 and torch.cuda.is_available() else "cpu")
    with torch.no_grad():
        for data, target in test_loader:
            out = model(data)
            pred = out.argmax(dim=1, keepdim=True)
            pred, target = pred.to(device), target.to(device)
            correct_sum += pred.eq(target.view_as(pred)).sum().item()
    accuracy = correct_sum / len(test_loader.dataset)
    # The tutorial prints the plain fraction; four places keep a --test_samples subset from printing 0.6666666666666666.
    print(f"Accuracy {accuracy:.4f}")
    return accuracy


# Main loop for trainers.
def run_worker(rank, world_size, num_gpus, train_loader, test_loader, args):
    print(f"Worker rank {rank} initializing RPC")
    # A trainer only computes the loss: a second intra-op thread would spin against the parameter server's.
    torch.set_num_threads(1)
    _init_rpc(TRAINER_NAME.format(rank), rank, world_size, args)
    print(f"Worker {rank} done initializing RPC")
    run_training_loop(rank, num_gpus, train_loader, test_loader, args.epochs, args.lr, args.log_interval)
    _shutdown(rank, world_size, args)


# --------- MNIST data --------------------

MNIST_FILES = [
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
]


def load_mnist(args, rank):
    """Train and test loaders; --train_samples/--test_samples keep the first N."""
    # Imported here, not at the top: torchvision is slow to import, and only the trainers read MNIST.
    from torchvision import datasets, transforms

    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])
    try:
        train_set = datasets.MNIST(args.data_dir, train=True, download=args.download, transform=transform)
        test_set = datasets.MNIST(args.data_dir, train=False, transform=transform)
    except Exception as exc:  # RuntimeError when absent, URLError/OSError when the download fails
        failed = (f"could not be downloaded ({exc}): this machine may have no network access" if args.download
                  else "--no-download forbids fetching it")
        raise RankFailure(
            f"MNIST is not in {os.path.join(os.path.abspath(args.data_dir), 'MNIST', 'raw')} and {failed}. "
            f"Put the four files {', '.join(MNIST_FILES)} (optionally .gz) there or point --data_dir at the folder "
            f"that holds MNIST/{'' if args.download else ', or pass --download on a machine with network access'}."
        ) from exc
    if args.train_samples:
        train_set = torch.utils.data.Subset(train_set, range(min(args.train_samples, len(train_set))))
    if args.test_samples:
        test_set = torch.utils.data.Subset(test_set, range(min(args.test_samples, len(test_set))))
    # Each trainer shuffles differently but reproducibly.
    shuffle_gen = torch.Generator().manual_seed(args.seed + rank)
    train_loader = torch.utils.data.DataLoader(train_set, batch_size=args.batch_size, shuffle=True, generator=shuffle_gen)
    # The tutorial shuffles the test set too; order does not change accuracy.
    test_loader = torch.utils.data.DataLoader(test_set, batch_size=args.batch_size, shuffle=False)
    return train_loader, test_loader


# --------- Roles by rank --------------------


def worker_name(rank, world_size):
    return PS_NAME if rank == 0 else TRAINER_NAME.format(rank)


def run_rank(rank, args):
    """What one process does: rank 0 serves the model, the others train."""
    torch.manual_seed(args.seed + rank)
    if rank == 0:
        run_parameter_server(rank, args.world_size, args)
    else:
        train_loader, test_loader = load_mnist(args, rank)
        run_worker(rank, args.world_size, args.num_gpus, train_loader, test_loader, args)


# --------- Starting, watching and stopping ranks --------------------
# What the tutorials leave out: bounded waits, one paragraph per failure, several
# machines, launchers. The same text in all four scripts; each script supplies
# RPC_TRANSPORTS, worker_name(rank, world_size) and run_rank(rank, args) above.


class RankFailure(Exception):
    """A failure explained in words: the message is the whole report."""


def _pick_interface(rank, args):
    """Gloo and TensorPipe advertise the hostname's address (often 127.0.0.1): name the interface instead."""
    names = [name for _, name in socket.if_nameindex()]
    if args.ifname is None and not ipaddress.ip_address(socket.gethostbyname(args.master_addr)).is_loopback:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((args.master_addr, args.master_port))  # UDP: picks the route, sends nothing
            local = socket.inet_aton(probe.getsockname()[0])
            for name in names:  # SIOCGIFADDR: the interface that has the route's address
                with contextlib.suppress(OSError):
                    if fcntl.ioctl(probe, 0x8915, struct.pack("256s", name.encode()))[20:24] == local:
                        args.ifname = name
                        print(f"Rank {rank}: using network interface {name} to reach {args.master_addr}")
    if args.ifname is not None and args.ifname not in names:
        raise RankFailure(f"there is no network interface --ifname {args.ifname} here; this machine has {', '.join(names)}.")
    if args.ifname:
        os.environ["GLOO_SOCKET_IFNAME"] = os.environ["TP_SOCKET_IFNAME"] = args.ifname


_watching, _finished, _report_lock = threading.Event(), threading.Event(), threading.Lock()


def _init_rpc(name, rank, world_size, args, num_worker_threads=16):
    """rpc.init_rpc, but every rank waits at most --timeout for the others (init_rpc alone: 30 minutes)."""
    _pick_interface(rank, args)
    where = f"{args.master_addr}:{args.master_port}"
    print(f"Rank {rank}: waiting up to {args.timeout:g} s for all {world_size} processes to meet at {where}")
    serve = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"  # torchrun serves its own
    try:
        # A client tries to connect twice, each time for the timeout it is given: half of --timeout.
        store = dist.TCPStore(args.master_addr, args.master_port, world_size, serve,
                              timedelta(seconds=args.timeout / (1 if serve else 2)), wait_for_workers=False, multi_tenant=True)
        store.set_timeout(timedelta(seconds=args.timeout))
        if rank == 0:
            store.set("world_size", str(world_size))
        theirs = int(store.get("world_size"))
        if theirs != world_size or store.add(f"rank{rank}", 1) > 1:
            raise RankFailure(f"the group at {where} is not this run's: its --world_size is {theirs} (this rank's: "
                              f"{world_size}), or its rank {rank} is taken. Start every rank of a run with the same "
                              f"--world_size, and give each run its own --master_port.")
        store.wait([f"rank{peer}" for peer in range(world_size)])
    except dist.DistError as exc:
        if "address already in use" in str(exc).lower():
            raise RankFailure(f"port {args.master_port} on {args.master_addr} is already in use, so rank 0 cannot "
                              f"listen there: stop what holds it, or give every rank another --master_port.") from exc
        raise RankFailure(f"waited {args.timeout:g} s for all {world_size} processes to meet at {where}, and not all "
                          f"came. Start ranks 0..{world_size - 1} with the same --world_size, --master_addr and "
                          f"--master_port within --timeout of each other, and check that {where} is reachable.") from exc
    # init_rpc's rendezvous shares the store above (multi_tenant) and finds every rank already there.
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = args.master_addr, str(args.master_port)
    options = rpc.TensorPipeRpcBackendOptions(init_method="env://", rpc_timeout=args.timeout, _transports=RPC_TRANSPORTS,
                                           num_worker_threads=num_worker_threads)
    rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=options)

    def watch():  # a rank hears of a dead peer only when it calls it: so call every peer each second
        while not _finished.wait(1.0):
            lost = _lost_peers(rank, world_size, args)
            if lost and not _finished.is_set():
                _exit_with_report(rank, args, lost)

    threading.Thread(target=watch, daemon=True).start()
    _watching.set()


def _lost_peers(rank, world_size, args):
    """A report naming every peer that does not answer within --timeout, or None."""
    pings = {peer: rpc.rpc_async(worker_name(peer, world_size), time.monotonic, timeout=args.timeout)
             for peer in range(world_size) if peer != rank}
    lost = []
    for peer, ping in pings.items():
        try:
            ping.wait()
        except Exception:
            lost.append(f"rank {peer} ({worker_name(peer, world_size)})")
    return lost and (f"lost contact with {', '.join(lost)}: the process died or its machine became unreachable. "
                     f"Look at that rank's own output for the cause, then start all ranks again.")


def _shutdown(rank, world_size, args):
    """rpc.shutdown() alone would wait forever for a dead peer: wait here, where the peer watch runs."""
    store = dist.TCPStore(args.master_addr, args.master_port, timeout=timedelta(seconds=args.timeout))
    store.set(f"done{rank}", "1")
    while not store.check([f"done{peer}" for peer in range(world_size)]):
        time.sleep(0.1)
    _finished.set()
    rpc.shutdown(timeout=args.timeout)


def _exit_with_report(rank, args, message, exc=None, code=1):
    """Print one paragraph (with --debug, the traceback too), then end the process whatever else happens."""
    try:
        _report_lock.acquire()  # one report per process, from whichever thread comes first
        try:  # an unexpected exception most often means that a peer died under it
            lines, frames = str(exc).strip().splitlines(), traceback.extract_tb(exc.__traceback__)[-1:]
            message = message or (_watching.is_set() and _lost_peers(rank, args.world_size, args) or type(exc).__name__
                                  + (f": {lines[0]}" if lines else "".join(f" at {f.filename}:{f.lineno}" for f in frames)))
        except Exception:
            message = message or type(exc).__name__
        if exc is not None and args.debug:
            traceback.print_exception(exc)
        hint = "" if args.debug or code != 1 else "\n(Run with --debug to see the traceback and torch's own log.)"
        print(f"\nError on rank {rank} ({worker_name(rank, args.world_size)}): {message}{hint}", file=sys.stderr)
        sys.stdout.flush(), sys.stderr.flush()
        if _watching.is_set() and args.world_size > 2:  # stay reachable: peers still calling this rank learn of it first
            time.sleep(2)
    finally:
        os._exit(code)  # rpc's threads cannot be trusted to wind down after a failure


def _rank_main(rank, args):
    """One rank's process, started by the launcher below or from the command line."""
    for stream in (sys.stdout, sys.stderr):  # whole lines, even with PYTHONUNBUFFERED=1: ranks never merge
        stream.reconfigure(line_buffering=True, write_through=False)
    try:
        with warnings.catch_warnings():  # rpc's own use of a gloo Backend as a ProcessGroup: not ours to fix
            warnings.filterwarnings("ignore", message="You are using a Backend .* as a ProcessGroup")
            run_rank(rank, args)
    except KeyboardInterrupt as exc:
        _exit_with_report(rank, args, "interrupted.", exc, code=130)
    except RankFailure as exc:
        _exit_with_report(rank, args, str(exc), exc)
    except BaseException as exc:
        _exit_with_report(rank, args, None, exc)


def _launch_all(args):
    """Every rank in a process of its own; torch.multiprocessing stops them all when one fails."""
    if args.master_port is None:  # a free port, so that two runs never meet
        with socket.socket() as sock:
            sock.bind((args.master_addr, 0))
            args.master_port = sock.getsockname()[1]
    print(f"Starting {args.world_size} ranks; rank 0 listens on {args.master_addr}:{args.master_port}", flush=True)
    ranks = mp.start_processes(_rank_main, args=(args,), nprocs=args.world_size, join=False, start_method="spawn")
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # `kill` stops the ranks as Ctrl-C does
    try:
        while not ranks.join(grace_period=10):  # on a failure the others get 10 s to report what they saw
            pass
        return 0
    except mp.ProcessExitedException as exc:
        print(f"Rank {exc.error_index} ({worker_name(exc.error_index, args.world_size)}) ended with "
              f"{exc.signal_name or f'exit code {exc.exit_code}'}: stopped every rank.", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("Interrupted: stopping every rank.", file=sys.stderr)
        return 130
    finally:
        for process in ranks.processes:
            process.terminate()
            process.join(3)
            process.kill()


# --------- Command line --------------------


def _positive(cast):
    def positive(text):  # an argparse type: a number above zero
        if cast(text) <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return cast(text)
    return positive


def _add_common_flags(parser, world_size):
    """The command line that all four scripts share (CONVENTIONS.md)."""
    parser.add_argument("--world_size", "--world-size", type=int, default=world_size,
                        help="Processes in the RPC group, all roles counted.")
    parser.add_argument("--rank", type=int, default=None,
                        help="Run only this rank (a terminal or machine each). None: start every rank here.")
    parser.add_argument("--master_addr", default="localhost", help="Address of rank 0.")
    parser.add_argument("--master_port", type=int, default=None,
                        help="Port of rank 0. None: 29500 with --rank, else a free one.")
    parser.add_argument("--ifname", default=None,
                        help="Network interface for runs across machines. None: the one that reaches --master_addr.")
    parser.add_argument("--timeout", type=_positive(float), default=60.0, help="Longest wait for a peer or an RPC, in seconds.")
    parser.add_argument("--debug", action="store_true", help="On a failure, show the traceback and torch's own log.")


def _check_common_args(parser, args, min_world_size, roles):
    """Exit 2 with one line for a bad common flag; without --rank, take torchrun's RANK etc."""
    if args.rank is None and "RANK" in os.environ:
        args.rank, args.world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        args.master_addr, args.master_port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if args.world_size < min_world_size:
        parser.error(f"--world_size must be at least {min_world_size} ({roles}), got {args.world_size}")
    if args.rank is not None and not 0 <= args.rank < args.world_size:
        parser.error(f"--rank must be in [0, {args.world_size}) for --world_size {args.world_size}, got {args.rank}")
    if args.master_port is not None and not 0 < args.master_port < 65536:
        parser.error(f"--master_port must be in 1..65535, got {args.master_port}")
    if args.rank is not None and args.master_port is None:
        args.master_port = 29500


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Parameter-Server RPC based training",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,  # a mistyped flag fails instead of matching a longer one
    )
    _add_common_flags(parser, world_size=4)
    parser.add_argument("--num_gpus", type=int, default=0,
                        help="Number of GPUs to use for training, currently supports between 0 and 2 GPUs.")
    parser.add_argument("--seed", type=int, default=1, help="Random seed (model init, data order).")
    parser.add_argument("--data_dir", default="./data", help="Folder that holds (or receives) MNIST/raw/.")
    parser.add_argument("--download", action=argparse.BooleanOptionalAction, default=True, help="Download MNIST if it is missing.")
    parser.add_argument("--epochs", type=_positive(int), default=1, help="Epochs each trainer runs.")
    parser.add_argument("--batch_size", type=_positive(int), default=32, help="Batch size.")
    parser.add_argument("--lr", type=_positive(float), default=0.03, help="Learning rate of SGD.")
    parser.add_argument("--train_samples", type=int, default=0, help="Use only the first N training images (0: all).")
    parser.add_argument("--test_samples", type=int, default=0, help="Use only the first N test images (0: all).")
    parser.add_argument("--log_interval", type=_positive(int), default=5, help="Batches between loss lines.")
    parser.add_argument("--save_model", default=None, metavar="PATH", help="The parameter server saves the trained state_dict here.")
    args = parser.parse_args(argv)
    _check_common_args(parser, args, min_world_size=2, roles="one parameter server and at least one trainer")
    if not 0 <= args.num_gpus <= 2:
        parser.error(f"--num_gpus must be between 0 and 2, got {args.num_gpus}")
    for flag in ("train_samples", "test_samples"):
        if getattr(args, flag) < 0:
            parser.error(f"--{flag} must be 0 (all) or positive, got {getattr(args, flag)}")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.rank is not None:
        _rank_main(args.rank, args)
        return 0
    try:  # every trainer needs the data: fetch it once here, not in every trainer at the same time
        load_mnist(args, rank=0)
    except RankFailure as exc:
        print(f"\nError: {exc}", file=sys.stderr)
        return 1
    return _launch_all(args)


if __name__ == "__main__":
    sys.exit(main())
