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
import torch.nn.functional as F
from torch import optim
from torch.distributed.optim import DistributedOptimizer

PS_NAME = "parameter_server"
TRAINER_NAME = "trainer_{}"
# TensorPipe's default shared-memory transport busy-polls most of a core in
# every process, which the training itself needs on a small machine; TCP (uv)
# was faster here (62 against 86-89 ms per batch, benchmarks/bench_parameter_server.py).
RPC_TRANSPORTS = ["uv"]


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
        # The tutorial runs self.model(inp) on the live weights. With two
        # trainers that breaks: trainer B's optimizer step updates the weights
        # in place while trainer A's backward pass still needs the values its
        # forward pass saw ("modified by an inplace operation"). So each forward
        # pass runs on a clone of the weights: clone() passes gradients back to
        # the real parameters, and the optimizer's in-place update no longer
        # touches what a pending backward pass holds. functional_call swaps the
        # clones into the shared module while it runs, so one RPC thread at a
        # time; the mode (train or eval) is set under the same lock because
        # every trainer shares this one module.
        inp = inp.to(self.input_device)
        with self.forward_lock, torch.set_grad_enabled(training):
            self.model.train(training)
            weights = {name: param.clone() for name, param in self.model.named_parameters()}
            out = torch.func.functional_call(self.model, weights, (inp,))
        # This output is forwarded over RPC, which as of 1.5.0 only accepts CPU tensors.
        # Tensors must be moved in and out of GPU memory due to this.
        return out.to("cpu")

    # Use dist autograd to retrieve gradients accumulated for this model.
    # Primarily used for verification.
    def get_dist_gradients(self, cid):
        grads = dist_autograd.get_gradients(cid)
        # This output is forwarded over RPC, which as of 1.5.0 only accepts CPU tensors.
        # Tensors must be moved in and out of GPU memory due to this.
        return {k.to("cpu"): v.to("cpu") for k, v in grads.items()}

    # Wrap local parameters in a RRef. Needed for building the
    # DistributedOptimizer which optimizes paramters remotely.
    def get_param_rrefs(self):
        return [rpc.RRef(param) for param in self.model.parameters()]


# The global parameter server instance. The tutorial keeps it as module state
# because every trainer's rpc.remote(get_parameter_server) must get the same one.
param_server = None
global_lock = threading.Lock()


def get_parameter_server(num_gpus=0):
    """Returns a singleton parameter server to all trainer processes."""
    global param_server
    # Ensure that we get only one handle to the ParameterServer.
    with global_lock:
        if not param_server:
            # construct it once
            param_server = ParameterServer(num_gpus=num_gpus)
        return param_server


def run_parameter_server(rank, world_size, args):
    # The parameter server just acts as a host for the model and responds to
    # requests from trainers.
    # rpc.shutdown() will wait for all workers to complete by default, which
    # in this case means that the parameter server will wait for all trainers
    # to complete, and then exit.
    print("PS master initializing RPC")
    _init_rpc(PS_NAME, rank, world_size, args)
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
                    print(f"Rank {rank} training batch {i} loss {loss.item():.4f}", flush=True)
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
        f"ms_per_batch={1000 * seconds / max(batches, 1):.1f} accuracy={accuracy:.4f}",
        flush=True,
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
    print(f"Accuracy {accuracy:.4f}", flush=True)
    return accuracy


# Main loop for trainers.
def run_worker(rank, world_size, num_gpus, train_loader, test_loader, args):
    print(f"Worker rank {rank} initializing RPC")
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
    # Imported here, not at the top: torchvision takes ~2 s to import, and of
    # all the processes only the trainers read MNIST.
    from torchvision import datasets, transforms

    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])
    try:
        train_set = datasets.MNIST(args.data_dir, train=True, download=args.download, transform=transform)
        test_set = datasets.MNIST(args.data_dir, train=False, transform=transform)
    except Exception as exc:  # RuntimeError when absent, URLError/OSError when the download fails
        raise RankFailure(
            f"MNIST is not in {os.path.join(os.path.abspath(args.data_dir), 'MNIST', 'raw')} "
            f"and could not be {'downloaded' if args.download else 'found'} ({exc}). "
            f"Put the four files {', '.join(MNIST_FILES)} (optionally .gz) there, point --data_dir "
            f"at the folder that holds MNIST/, or pass --download on a machine that can reach the MNIST mirrors."
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
        description="Parameter-Server RPC based training",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _add_common_flags(parser, world_size=4)
    parser.add_argument("--num_gpus", type=int, default=0,
                        help="Number of GPUs to use for training, currently supports between 0 and 2 GPUs.")
    parser.add_argument("--seed", type=int, default=1, help="Random seed (model init, data order).")
    parser.add_argument("--data_dir", "--data-dir", default="./data", help="Folder that holds (or receives) MNIST/raw/.")
    parser.add_argument("--download", action=argparse.BooleanOptionalAction, default=True, help="Download MNIST if it is missing.")
    parser.add_argument("--epochs", type=int, default=1, help="Epochs each trainer runs.")
    parser.add_argument("--batch_size", "--batch-size", type=int, default=32, help="Batch size.")
    parser.add_argument("--lr", type=float, default=0.03, help="Learning rate of SGD.")
    parser.add_argument("--train_samples", type=int, default=0, help="Use only the first N training images (0: all).")
    parser.add_argument("--test_samples", type=int, default=0, help="Use only the first N test images (0: all).")
    parser.add_argument("--log_interval", type=int, default=5, help="Batches between loss lines.")
    parser.add_argument("--save_model", default=None, metavar="PATH", help="The parameter server saves the trained state_dict here.")
    args = parser.parse_args(argv)
    _check_common_args(parser, args, min_world_size=2, roles="one parameter server and at least one trainer")
    if not 0 <= args.num_gpus <= 2:
        parser.error(f"--num_gpus must be between 0 and 2, got {args.num_gpus}")
    if args.num_gpus > torch.cuda.device_count():
        parser.error(f"--num_gpus {args.num_gpus} asks for more GPUs than this machine has ({torch.cuda.device_count()})")
    for flag in ("epochs", "batch_size", "lr", "log_interval"):
        if getattr(args, flag) <= 0:
            parser.error(f"--{flag} must be positive, got {getattr(args, flag)}")
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
