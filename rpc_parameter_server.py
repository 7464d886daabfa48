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
import json
import multiprocessing.connection
import multiprocessing.forkserver
import multiprocessing.util
import os
import re
import shutil
import signal
import socket
import struct
import sys
import threading
import time
import traceback
import urllib.error
import warnings
from datetime import timedelta

if __name__ == "__main__" and "--debug" not in sys.argv:
    # Before torch loads: its C++ log would repeat each failure as warnings, errors and stack dumps.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
if __name__ == "__mp_main__":  # a rank that _launch_all (below) started, still starting: it has nothing to say yet
    signal.signal(signal.SIGINT, lambda *_: os._exit(130))

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
        raise ValueError(f"a trainer asked for a parameter server on {num_gpus} GPU{'s' * (num_gpus > 1)}, but the "
                         f"parameter server's machine has {torch.cuda.device_count()}: lower --num_gpus on the trainers.")
    # Ensure that we get only one handle to the ParameterServer.
    with global_lock:
        if not param_server:
            # construct it once
            param_server = ParameterServer(num_gpus=num_gpus)
        return param_server


def run_parameter_server(rank, world_size, args):
    # The model is placed on this machine, so this is where --num_gpus must fit.
    if args.num_gpus > torch.cuda.device_count():
        raise RankFailure(f"--num_gpus {args.num_gpus} asks for {args.num_gpus} GPU{'s' * (args.num_gpus > 1)} on the "
                          f"parameter server (rank 0), "
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
    except Exception as exc:
        raw = os.path.join(os.path.abspath(args.data_dir), "MNIST", "raw")
        # torchvision lists each mirror it tried and its error: the last line says why.
        cause = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
        if isinstance(exc, OSError) and not isinstance(exc, urllib.error.URLError):  # the disk, not the network
            raise RankFailure(f"MNIST could not be read or written in {raw} ({exc.strerror or cause}"
                              f"{': ' + str(exc.filename) if exc.filename else ''}). Check that folder's permissions "
                              f"and free space, or point --data_dir at another folder.") from exc
        if all(os.path.exists(os.path.join(raw, name)) for name in MNIST_FILES):  # all there, yet unreadable
            raise RankFailure(f"MNIST in {raw} could not be read ({cause}): one of its four files is truncated or "
                              f"damaged. Delete the four files and put them there again"
                              f"{' (or let the script download them)' if args.download else ''}.") from exc
        failed = (f"could not be downloaded ({cause}): this machine may have no network access" if args.download
                  else "--no-download forbids fetching it")
        raise RankFailure(
            f"MNIST is not in {raw} and {failed}. "
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
    try:
        address = socket.gethostbyname(args.master_addr)
    except OSError as exc:
        raise RankFailure(f"--master_addr {args.master_addr} does not resolve to an address here ({exc.strerror}): "
                          f"fix --master_addr (rank 0's address as this machine sees it).") from exc
    if args.ifname is None and not ipaddress.ip_address(address).is_loopback:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:
                probe.connect((address, args.master_port))  # UDP: picks the route, sends nothing
            except OSError as exc:
                raise RankFailure(f"this machine has no route to --master_addr {args.master_addr} ({exc.strerror}): "
                                  f"fix --master_addr, or name the interface that reaches it with --ifname.") from exc
            local = socket.inet_aton(probe.getsockname()[0])
            for name in names:  # SIOCGIFADDR: the interface that has the route's address
                with contextlib.suppress(OSError):
                    if fcntl.ioctl(probe, 0x8915, struct.pack("256s", name.encode()))[20:24] == local:
                        args.ifname = name
                        print(f"Rank {rank}: using network interface {name} to reach {args.master_addr}")
    if args.ifname is not None and args.ifname not in names:
        raise RankFailure(f"there is no network interface --ifname {args.ifname} here; this machine has {', '.join(names)}.")
    if args.ifname:
        os.environ["GLOO_SOCKET_IFNAME"] = os.environ["NCCL_SOCKET_IFNAME"] = os.environ["TP_SOCKET_IFNAME"] = args.ifname


_watching, _finished, _report_lock = threading.Event(), threading.Event(), threading.Lock()
_states = None  # from the launcher: each rank's 0 (starting), 1 (watching its peers), 2 (reported), 3 (gone)
# Flags that may differ from rank to rank; every other flag must be the same on every rank of a run.
RANK_OWN_FLAGS = {"rank", "master_addr", "ifname", "timeout", "debug", "data_dir", "download", "save_model"}


@contextlib.contextmanager
def _deadline(rank, args, why):
    """Past --timeout, print why() as the report and end the process: for waits torch leaves unbounded."""
    timer = threading.Timer(args.timeout, lambda: _exit_with_report(rank, args, why()))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _init_rpc(name, rank, world_size, args, num_worker_threads=16):
    """rpc.init_rpc, with every wait bounded by --timeout (init_rpc alone: 30 minutes, and days in its group).
    Returns the store the ranks met on."""
    _pick_interface(rank, args)
    where = f"{args.master_addr}:{args.master_port}"
    waiting = f"Rank {rank}: waiting up to {args.timeout:g} s for all {world_size} processes to meet at {where}"
    serve = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"  # torchrun serves its own
    why = (f"waited {args.timeout:g} s for rank 0 at {where}, and no rank 0 answered. Start rank 0 with the same "
           f"--master_addr and --master_port, and check that {where} is reachable and that no other program listens "
           f"there.")
    if not serve:
        print(waiting)  # a client waits from the start; rank 0 only once it listens
    try:
        with _deadline(rank, args, lambda: why):  # the store's own timeouts miss a listener that never answers
            # A client tries to connect twice, each time for the timeout it is given: half of --timeout.
            store = dist.TCPStore(args.master_addr, args.master_port, world_size, serve,
                                  timedelta(seconds=args.timeout / (1 if serve else 2)), wait_for_workers=False,
                                  multi_tenant=True)
            if serve:
                print(waiting)
            store.set_timeout(timedelta(seconds=args.timeout))
            if rank == 0:
                store.set("world_size", str(world_size))
            theirs = int(store.get("world_size"))  # the first answer: a rank 0 is there
            why = (f"waited {args.timeout:g} s for all {world_size} processes to meet at {where}, and not all came. "
                   f"Start ranks 0..{world_size - 1} with the same --world_size, --master_addr and --master_port "
                   f"within --timeout of each other, and check that {where} is reachable.")
            if theirs != world_size or store.add(f"rank{rank}", 1) > 1:
                raise RankFailure(f"the group at {where} is not this run's: its --world_size is {theirs} (this rank's: "
                                  f"{world_size}), or its rank {rank} is taken. Start every rank of a run with the same "
                                  f"--world_size, and give each run its own --master_port.")
            flags = {key: value for key, value in vars(args).items() if key not in RANK_OWN_FLAGS}
            store.set(f"flags{rank}", json.dumps(flags, default=str))
            store.set(f"pid{rank}", str(os.getpid()))  # which process is which rank, for whoever must stop one
            store.wait([f"rank{peer}" for peer in range(world_size)])
            ranks_flags = [json.loads(store.get(f"flags{peer}")) for peer in range(world_size)]
            differ = [f"rank {peer} has --{key} {value}, rank 0 --{key} {ranks_flags[0].get(key)}"
                      for peer, theirs in enumerate(ranks_flags) for key, value in theirs.items()
                      if value != ranks_flags[0].get(key)]
            store.set(f"compared{rank}", "1")
            if differ and serve:  # the store goes with this process: let every rank read the flags first
                store.wait([f"compared{peer}" for peer in range(world_size)])
    except dist.DistError as exc:
        if "address already in use" in str(exc).lower():
            raise RankFailure(f"port {args.master_port} on {args.master_addr} is already in use, so rank 0 cannot "
                              f"listen there: stop what holds it, or give every rank another --master_port.") from exc
        raise RankFailure(why) from exc
    if differ:
        raise RankFailure(f"the ranks were started with different flags: {'; '.join(differ)}. Start every rank with "
                          f"the same flags; only --{', --'.join(sorted(RANK_OWN_FLAGS & vars(args).keys()))} may differ.")
    # init_rpc's rendezvous shares the store above (multi_tenant) and finds every rank already there.
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = args.master_addr, str(args.master_port)
    options = rpc.TensorPipeRpcBackendOptions(init_method="env://", rpc_timeout=args.timeout, _transports=RPC_TRANSPORTS,
                                           num_worker_threads=num_worker_threads)
    why = (f"all {world_size} processes met at {where}, but RPC did not start within {args.timeout:g} s: a rank "
           f"stopped, or a firewall blocks the ports that TensorPipe and Gloo listen on (README, \"Running on several "
           f"machines\").")
    with _deadline(rank, args, lambda: why):  # init_rpc's own group waits about 24 days for a rank that died
        rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=options)

    def watch():  # a rank hears of a dead peer only when it calls it: so call every peer each second
        while not _finished.wait(1.0):
            lost = _lost_peers(rank, world_size, args)
            if lost and not _finished.is_set():
                _exit_with_report(rank, args, lost, shared=True)

    threading.Thread(target=watch, daemon=True).start()
    _watching.set()
    if _states is not None:
        _states[rank] = 1
    return store


def _lost_peers(rank, world_size, args):
    """A report naming every peer that does not answer within --timeout, or None."""
    try:
        pings = {peer: rpc.rpc_async(worker_name(peer, world_size), time.monotonic, timeout=args.timeout)
                 for peer in range(world_size) if peer != rank}
    except RuntimeError:  # RPC has just shut down: the run ended well
        return None
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
    _watching.clear()  # an error from here on is this rank's own, not a lost peer
    rpc.shutdown(timeout=args.timeout)
    store.set(f"closed{rank}", "1")
    if rank == 0:  # the store lives in this process, and rpc.shutdown on other ranks may still use it
        store.wait([f"closed{peer}" for peer in range(world_size)])


def _describe(exc):
    """One line for an unexpected exception; for one raised inside an RPC, the remote cause and its rank."""
    try:
        text = str(exc).strip()
    except Exception:
        return type(exc).__name__
    remote = re.search(r"On WorkerInfo\(id=(\d+), name=(.*?)\):\n(.*)", text)
    if remote:  # torch sends the callee's repr(exception) and its traceback: keep the first
        return (f"an RPC that ran on rank {remote[1]} ({remote[2]}) raised {remote[3]}. Its traceback is in rank "
                f"{remote[1]}'s output (torch prints it there).")
    if text:
        return f"{type(exc).__name__}: {text.splitlines()[0]}"
    return type(exc).__name__ + "".join(f" at {f.filename}:{f.lineno}" for f in traceback.extract_tb(exc.__traceback__)[-1:])


def _exit_with_report(rank, args, message, exc=None, code=1, shared=False):
    """Print one paragraph (with --debug, the traceback too), then end the process whatever else happens.
    shared: the peers see the same cause (a lost peer, a Ctrl-C to every process) and will report it too."""
    try:
        _report_lock.acquire()  # one report per process, from whichever thread comes first
        try:  # an unexpected exception most often means that a peer died under it
            lost = not message and _watching.is_set() and _lost_peers(rank, args.world_size, args)
            message, shared = message or lost or _describe(exc), shared or bool(lost)
        except Exception:
            message = message or type(exc).__name__
        if exc is not None and args.debug:
            traceback.print_exception(exc)
        hint = "" if args.debug or code != 1 else "\n(Run with --debug to see the traceback and torch's own log.)"
        print(f"\nError on rank {rank} ({worker_name(rank, args.world_size)}): {message}{hint}", file=sys.stderr)
        sys.stdout.flush(), sys.stderr.flush()
        if not args.debug:  # the paragraph is this rank's last word: torch's threads may still print as peers go
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stderr.fileno())
        # Stay reachable while peers have yet to report the same cause, so that they say what they saw, not
        # that this rank vanished: in a one-command run until each has (the launcher's states tell), else 2 s.
        launched = _states is not None  # shared memory: it outlives a killed launcher
        if launched:
            _states[rank] = 2
        end = time.monotonic() + (10 if launched else 2 if code == 1 and args.world_size > 2 else 0)
        while shared and _watching.is_set() and time.monotonic() < end and (
                not launched or 1 in [state for peer, state in enumerate(_states) if peer != rank]):
            time.sleep(0.05)
    finally:
        os._exit(code)  # rpc's threads cannot be trusted to wind down after a failure


def _run_rank_reporting(rank, args):
    try:
        with warnings.catch_warnings():  # rpc's own use of a gloo Backend as a ProcessGroup: not ours to fix
            warnings.filterwarnings("ignore", message="You are using a Backend .* as a ProcessGroup")
            run_rank(rank, args)
    except KeyboardInterrupt as exc:
        _exit_with_report(rank, args, "interrupted.", exc, code=130, shared=True)
    except RankFailure as exc:
        _exit_with_report(rank, args, str(exc), exc)
    except BaseException as exc:
        _exit_with_report(rank, args, None, exc)


def _rank_main(rank, args, states=None):
    """One rank's process, started by the launcher below or from the command line."""
    global _states
    _states = states
    for stream in (sys.stdout, sys.stderr):  # whole lines, even with PYTHONUNBUFFERED=1: ranks never merge
        stream.reconfigure(line_buffering=True, write_through=False)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the launched rank's quiet start-up handler ends here
    if states is not None:  # stop with the launcher (the kernel's parent-death signal would come from the fork server)
        def stop_with_launcher(launcher=multiprocessing.parent_process().sentinel):
            multiprocessing.connection.wait([launcher])  # its end of the pipe closes when it dies
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

        threading.Thread(target=stop_with_launcher, daemon=True).start()
    # The rank runs in a thread of its own: the main thread then takes Ctrl-C at once, where torch's waits
    # (Future.wait, init_rpc) would hold it until they return.
    worker = threading.Thread(target=_run_rank_reporting, args=(rank, args), daemon=True)
    worker.start()
    try:
        worker.join()
    except KeyboardInterrupt as exc:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # one report: a second signal would cut it short, silently
        # In a rank it launched: did this come because the launcher died? (Its pipe is closed then.)
        parent = multiprocessing.parent_process()
        orphan = parent is not None and bool(multiprocessing.connection.wait([parent.sentinel], 0.5))
        _exit_with_report(rank, args, "the launcher is gone (it was killed), so this rank stops too." if orphan
                          else "interrupted.", exc, code=130, shared=True)


_held = None  # while the launcher starts ranks: the stop signals that came, acted on once every rank has started


def _interrupt(signum, frame):  # Ctrl-C, or `kill`, to the launcher: stop every rank
    for each in (signal.SIGINT, signal.SIGTERM):  # first, so that a second Ctrl-C cannot stop the stopping
        signal.signal(each, signal.SIG_IGN)
    if _held is not None:  # a rank cut off mid-spawn would print multiprocessing's own traceback
        _held.append(signum)
    else:
        raise KeyboardInterrupt(signal.Signals(signum).name)


def _launch_all(args):
    """Every rank in a process of its own, as mp.spawn starts them; when one fails, or on Ctrl-C, all stop."""
    reserved = socket.socket()  # bound until the run ends, never listening: the OS gives its port to no one else
    if args.master_port is None:  # a free port, so that two runs never meet
        reserved.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # rank 0 can still listen on it
        reserved.bind(("", 0))  # every address: held on one only, a listener on another could still be given it
        args.master_port = reserved.getsockname()[1]
    global _held
    _held = []  # a stop signal from here on waits until every rank has started, so that none is left behind
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _interrupt)
    print(f"Starting {args.world_size} ranks; rank 0 listens on {args.master_addr}:{args.master_port}", flush=True)
    # For the ranks only (glibc reads these at start-up): one malloc arena, and large blocks kept rather than
    # returned, cut the parameter server's page faults per batch from 5,393 to 290 and its time by about a quarter.
    for name, value in (("MALLOC_ARENA_MAX", "1"), ("MALLOC_MMAP_THRESHOLD_", "33554432"),
                        ("MALLOC_TRIM_THRESHOLD_", "268435456")):
        os.environ.setdefault(name, value)
    # The ranks fork from one server that imports this script, and so torch, once; it never touches CUDA.
    # It starts in the current folder and ignores this process's sys.path: PYTHONPATH tells it where the script is.
    here = os.path.dirname(os.path.abspath(__file__))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
    context = mp.get_context("forkserver")
    context.set_forkserver_preload([os.path.splitext(os.path.basename(__file__))[0]])
    states, ranks, failure, code = context.Array("b", args.world_size, lock=False), [], None, 0
    hold = ()  # the states of the ranks that the launcher waits for before it stops them
    try:
        ranks = mp.start_processes(_rank_main, args=(args, states), nprocs=args.world_size, join=False,
                                   start_method="forkserver").processes
        held, _held = _held, None
        if held:
            raise KeyboardInterrupt(signal.Signals(held[0]).name)
        left = {rank.sentinel: index for index, rank in enumerate(ranks)}
        while left and failure is None:
            for sentinel in multiprocessing.connection.wait(list(left)):
                index = left.pop(sentinel)
                ranks[index].join()  # the sentinel can be ready a moment before the exit status is
                exit_code, states[index] = ranks[index].exitcode, 3  # 3: gone, so no rank waits for its report
                if exit_code and failure is None:
                    how = signal.Signals(-exit_code).name if exit_code < 0 else f"exit code {exit_code}"
                    failure = f"Rank {index} ({worker_name(index, args.world_size)}) ended with {how}: stopped every rank."
                    # Ranks that watch their peers report the loss within seconds; the others have nothing to say.
                    code, hold = 1, (1,)
    except KeyboardInterrupt as exc:
        print("Interrupted: stopping every rank.", file=sys.stderr)
        code = 130
        if exc.args == ("SIGINT",):  # Ctrl-C reached the ranks too: let each say so
            hold = (0, 1)
    finally:
        _held = None
        for signum in (signal.SIGINT, signal.SIGTERM):  # nor a Ctrl-C after a failure
            signal.signal(signum, signal.SIG_IGN)
        end = time.monotonic() + 10
        while any(rank.is_alive() and states[i] in hold for i, rank in enumerate(ranks)) and time.monotonic() < end:
            time.sleep(0.05)
        children = multiprocessing.active_children()
        for stop in ("terminate", "kill"):  # all at once, not one after another
            end = time.monotonic() + 3
            for child in children:
                if child.is_alive():
                    getattr(child, stop)()
            for child in children:
                child.join(max(0.0, end - time.monotonic()))
    reserved.close()
    # Every rank is gone: end the fork server at once, or it would spend about 0.5 s of CPU unloading torch only to
    # exit. (Python offers no public handle on it.) The script ends with os._exit, which skips multiprocessing's
    # clean-up: remove its folder, which holds the fork server's socket.
    server = getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)
    if server:
        with contextlib.suppress(ProcessLookupError):
            os.kill(server, signal.SIGTERM)  # it keeps the default action: end without clean-up
    shutil.rmtree(multiprocessing.util.get_temp_dir(), ignore_errors=True)
    if failure:
        print(failure, file=sys.stderr)
    return code


# --------- Command line --------------------


def _positive(cast):
    def positive(text):  # an argparse type: a number above zero
        if cast(text) <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return cast(text)
    return positive


def _add_common_flags(parser, world_size):
    """The command line that all four scripts share (README, "Running the scripts")."""
    parser.usage = "%(prog)s [flags]   (--help lists them)"  # a bad flag: two lines, not the whole synopsis
    parser.epilog = ("One terminal per rank: start every rank with the same flags; only --rank, --master_addr, "
                     "--ifname, --timeout and --debug (and --data_dir, --download, --save_model where a script has "
                     "them) may differ. Ranks whose flags differ stop with an error naming them.")
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
    code = main()
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(code)  # all is done: skip the interpreter's teardown of torch (about 0.7 s of CPU)
