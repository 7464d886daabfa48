"""Parameter server over RPC vs. the same Net trained in one process.

Both sides train one epoch on the same MNIST images in the same order (batch
32, SGD lr 0.03, the script's seeds), on CPU, in this one invocation, in
--rounds alternating rounds of (single process, RPC). The RPC side is the
script's own code at world size 2 in two spawned processes: rank 0 is
rpc_parameter_server.run_rank(0), rank 1 run_rank(1) with a copy of
run_training_loop that has a clock between its steps. Prints every round, then the machine, the median
milliseconds per batch of each phase (data loading, forward, backward,
optimizer step, the rest) for both sides, plus the parameter server's own
forward and backward compute timed inside it (server_forward within forward,
server_backward within backward: the rest of those phases is the round trip),
and the medians, ranges and ratio of the whole, all as key=value pairs.

    python benchmarks/bench_parameter_server.py --data_dir PATH [--rounds 3] [--transports default] [--rank_env none]

--data_dir is an MNIST root as the script takes it (default: the script's
./data, downloaded when missing); the first 8,000 training and 2,000 test
images are used unless --train_samples/--test_samples say otherwise.
"""
import argparse
import os
import sys
import time
from statistics import median

import torch
import torch.distributed.autograd as dist_autograd
import torch.nn.functional as F
from torch import optim
from torch.distributed.optim import DistributedOptimizer

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]
import rpc_parameter_server as ps  # noqa: E402
from common import (add_rank_env_flag, PhaseClock, captured_stdout, free_port, machine, phase_medians,  # noqa: E402
                    run_rpc_round, same, spread)

PHASES = ("load", "forward", "backward", "step", "other")
SERVER_PHASES = ("server_forward", "server_backward")  # inside rpc_forward and rpc_backward, timed on the server
TRAINER_RANK = 1  # its data order is the one both sides train on


def figures(clock, batches, accuracy):
    ms = {phase: 1000 * seconds / batches for phase, seconds in clock.totals.items()}
    return {"ms_per_batch": sum(ms.values()), "phases": ms, "batches": batches, "accuracy": accuracy}


def accuracies(rounds):
    return same([f"{r['accuracy']:.4f}" for r in rounds])


def single_round(args):
    """The script's Net, data and SGD in this process, with no RPC in between."""
    torch.manual_seed(args.seed)  # what rank 0, which builds the Net, seeds
    with captured_stdout():  # Net's "Putting ... on cpu" lines
        model = ps.Net(num_gpus=args.num_gpus)
    train_loader, test_loader = ps.load_mnist(args, rank=TRAINER_RANK)
    opt = optim.SGD(model.parameters(), lr=args.lr)
    model.train()
    clock = PhaseClock()
    for data, target in train_loader:
        clock.mark("load")
        loss = F.nll_loss(model(data), target)
        clock.mark("forward")
        loss.backward()
        clock.mark("backward")
        opt.step()
        opt.zero_grad()  # after the step, not before the forward pass: optimizer work, timed with it
        clock.mark("step")
    with captured_stdout():  # get_accuracy's own "Accuracy" line
        accuracy = ps.get_accuracy(test_loader, model)
    return figures(clock, len(train_loader), accuracy)


def time_the_server():
    """Clocks inside the parameter server: its forward passes, and its part of each distributed backward pass
    (from the gradient of its output arriving to that of conv1's weight, the last one it computes)."""
    totals = {"forward": 0.0, "backward": 0.0}
    started = []
    forward, net_init = ps.ParameterServer.forward, ps.Net.__init__

    def timed_forward(self, inp, training=True):
        begin = time.perf_counter()
        out = forward(self, inp, training)
        if training:
            totals["forward"] += time.perf_counter() - begin
            out.register_hook(lambda grad: started.append(time.perf_counter()))
        return out

    def backward_ends(grad):
        totals["backward"] += time.perf_counter() - started.pop()

    def hook_conv1_weight(module, inputs):  # functional_call has swapped in this pass's clone of the weight
        if torch.is_grad_enabled():
            module.weight.register_hook(backward_ends)

    def timed_net_init(self, *args, **kwargs):
        net_init(self, *args, **kwargs)
        self.conv1.register_forward_pre_hook(hook_conv1_weight)

    ps.ParameterServer.forward, ps.Net.__init__ = timed_forward, timed_net_init
    return totals


def rpc_rank(rank, args):
    """One process of the RPC side: rank 0 the script's parameter server, rank 1 the timed trainer."""
    with captured_stdout():  # the script's progress lines; errors still reach stderr
        if hasattr(ps, "_set_rendezvous_env"):  # plumbing where _init_rpc does not set MASTER_ADDR/PORT itself
            ps._set_rendezvous_env(rank, args)
        if args.transports != "script":
            ps.RPC_TRANSPORTS = None if args.transports == "default" else args.transports.split(",")
        if rank == 0:
            totals = time_the_server()
            ps.run_rank(0, args)
            return {"server": totals}
        result = {}

        def run_training_loop(rank, num_gpus, train_loader, test_loader, *rest):  # the script's, timed
            result["rpc"] = timed_training_loop(args, train_loader, test_loader)

        ps.run_training_loop = run_training_loop
        ps.run_rank(rank, args)  # everything else as the script sets a trainer up
    return result


def timed_training_loop(args, train_loader, test_loader):
    """The script's run_training_loop for one epoch, with a clock between its steps and no loss lines."""
    net = ps.TrainerNet(num_gpus=args.num_gpus)
    opt = DistributedOptimizer(optim.SGD, net.get_global_param_rrefs(), lr=args.lr)
    clock = PhaseClock()
    for i, (data, target) in enumerate(train_loader):
        clock.mark("load")
        with dist_autograd.context() as cid:
            loss = F.nll_loss(net(data), target)
            clock.mark("forward")
            dist_autograd.backward(cid, [loss])
            clock.mark("backward")
            if i == 0:  # the script's one check that gradients reached the server
                assert ps.remote_method(ps.ParameterServer.get_dist_gradients, net.param_server_rref, cid) != {}
                clock.mark("other")
            opt.step(cid)
            clock.mark("step")
        clock.mark("other")  # leaving the context releases it on the server as well
    with captured_stdout():
        accuracy = ps.get_accuracy(test_loader, net)
    return figures(clock, len(train_loader), accuracy)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data_dir", default=None, help="an MNIST root, as the script's --data_dir (default: its)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of (single process, RPC)")
    parser.add_argument("--train_samples", type=int, default=8000, help="first N training images")
    parser.add_argument("--test_samples", type=int, default=2000, help="first N test images")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--transports", default="script",
                        help="TensorPipe transports of the RPC side: script (the script's own), default (TensorPipe's), or e.g. uv")
    add_rank_env_flag(parser)
    bench = parser.parse_args()
    if bench.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {bench.rounds}")

    flags = ["--world_size", "2", "--seed", str(bench.seed),
             "--train_samples", str(bench.train_samples), "--test_samples", str(bench.test_samples)]
    if bench.data_dir:
        flags += ["--data_dir", bench.data_dir]
    singles, rpcs = [], []
    try:
        for n in range(1, bench.rounds + 1):  # alternate, so that a busy spell on the machine hits both sides
            singles.append(single_round(ps.parse_args(flags)))
            rpc_args = ps.parse_args(flags + ["--master_port", str(free_port())])
            rpc_args.transports = bench.transports
            sides = run_rpc_round(rpc_rank, rpc_args, rank_env=bench.rank_env)
            for phase, seconds in sides["server"].items():  # inside the server, a part of forward and backward
                sides["rpc"]["phases"][f"server_{phase}"] = 1000 * seconds / sides["rpc"]["batches"]
            rpcs.append(sides["rpc"])
            single, rpc = singles[-1]["ms_per_batch"], rpcs[-1]["ms_per_batch"]
            print(f"round={n} single_ms_per_batch={single:.1f} rpc_ms_per_batch={rpc:.1f} ratio={rpc / single:.2f} "
                  f"single_accuracy={singles[-1]['accuracy']:.4f} rpc_accuracy={rpcs[-1]['accuracy']:.4f}", flush=True)
    except ps.RankFailure as exc:
        sys.exit(f"Error: {exc}")
    except torch.multiprocessing.ProcessException as exc:
        sys.exit(f"The RPC side failed in round {len(rpcs) + 1}: {exc}")

    single_ms = [r["ms_per_batch"] for r in singles]
    rpc_ms = [r["ms_per_batch"] for r in rpcs]
    print(machine())
    print("phase_ms_per_batch=median", phase_medians("single", [r["phases"] for r in singles], PHASES, 1),
          phase_medians("rpc", [r["phases"] for r in rpcs], PHASES + SERVER_PHASES, 1))
    print(f"bench=parameter_server world_size=2 rounds={bench.rounds} batches={singles[0]['batches']} "
          f"transports={bench.transports} rank_env={bench.rank_env} "
          f"seed={bench.seed} {spread('single_ms_per_batch', single_ms, 1)} {spread('rpc_ms_per_batch', rpc_ms, 1)} "
          f"ratio={median(rpc_ms) / median(single_ms):.2f} "
          f"single_accuracy={accuracies(singles)} rpc_accuracy={accuracies(rpcs)}", flush=True)


if __name__ == "__main__":
    main()
