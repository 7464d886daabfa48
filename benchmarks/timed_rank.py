"""One rank of a script as a user runs it in a terminal, with clocks around the parts the benchmarks time.

    python benchmarks/timed_rank.py [--transports=default] rpc_parameter_server.py --world_size=2 --rank=1 ...

runs what `python rpc_parameter_server.py --world_size=2 --rank=1 --master_port=PORT ...` runs: it imports the
script, wraps a few of its functions with clocks (monkeypatching: two perf_counter calls per phase, no other
change), and calls the script's own main() with the same arguments. When main returns, it prints one more line,

    Timed: role=trainer load_s=... forward_s=... backward_s=... step_s=... other_s=...

the totals of its clocks in seconds, which the benchmarks read next to the script's own Summary line. Only the
environment the user's shell has: this module sets nothing but what the script itself sets when run directly.
--transports=default (before the script's name) is the one departure, and only when asked for: TensorPipe's
default transports instead of the script's TCP only, for figures of what the scripts trade away.

Clocks per script and role:
- rpc_parameter_server.py, trainer: load (the DataLoader), forward (the forward RPC and the loss), backward
  (dist_autograd.backward), step (DistributedOptimizer.step), other (the once-per-run gradient check and the
  release of each distributed autograd context); together they cover run_training_loop's timed loop.
  Parameter server: its forward passes (ParameterServer.forward in training mode) and its part of each
  distributed backward pass (from the gradient of its output arriving to that of conv1's weight, the last it
  computes).
- rpc_rl_cartpole.py, observer: per episode, reset, env_step and calls (each step's two round trips to the
  agent, agent_rref.rpc_sync().select_action and .report_reward); agent: its own select_action and
  finish_episode.
"""
import contextlib
import importlib
import os
import sys
import time

from common import ROOT, PhaseClock


def clock_parameter_server(ps, rank):
    """Clocks for rpc_parameter_server.py; returns a function that gives the Timed line's pairs."""
    if rank == 0:
        return clock_the_server(ps)
    clock, started = PhaseClock(), []

    class TimedLoader:  # the script's train loader: a batch's wait is load
        def __init__(self, loader):
            self.loader = loader

        def __len__(self):
            return len(self.loader)

        def __getattr__(self, name):
            return getattr(self.loader, name)

        def __iter__(self):
            if not started:  # run_training_loop's clock starts just before its loop
                started.append(True)
                clock.restart()
            for batch in self.loader:
                clock.mark("load")
                yield batch
            clock.mark("load")  # the last, empty fetch

    class TimedDistAutograd:  # the script's dist_autograd, with backward and the context timed
        def __init__(self, module):
            self.module = module

        def __getattr__(self, name):
            return getattr(self.module, name)

        def backward(self, context_id, roots, *args, **kwargs):
            clock.mark("forward")  # since the batch arrived: the forward RPC, the loss and its print
            self.module.backward(context_id, roots, *args, **kwargs)
            clock.mark("backward")

        @contextlib.contextmanager
        def context(self):
            with self.module.context() as context_id:
                yield context_id
            clock.mark("other")  # leaving the context releases it on the server too

    load_mnist, optimizer = ps.load_mnist, ps.DistributedOptimizer

    def timed_load_mnist(args, rank):
        train_loader, test_loader = load_mnist(args, rank)
        return TimedLoader(train_loader), test_loader

    def timed_optimizer(*args, **kwargs):
        opt = optimizer(*args, **kwargs)
        step = opt.step

        def timed_step(context_id):
            clock.mark("other")  # since backward: on the first batch, the script's check of the gradients
            step(context_id)
            clock.mark("step")

        opt.step = timed_step
        return opt

    ps.load_mnist, ps.DistributedOptimizer, ps.dist_autograd = timed_load_mnist, timed_optimizer, TimedDistAutograd(
        ps.dist_autograd)
    return lambda: "role=trainer " + " ".join(f"{phase}_s={seconds:.6f}" for phase, seconds in clock.totals.items())


def clock_the_server(ps):
    totals = {"forwards": 0, "forward_s": 0.0, "backwards": 0, "backward_s": 0.0}
    started = []
    forward, net_init = ps.ParameterServer.forward, ps.Net.__init__

    def timed_forward(self, inp, training=True):
        begin = time.perf_counter()
        out = forward(self, inp, training)
        if training:
            totals["forwards"] += 1
            totals["forward_s"] += time.perf_counter() - begin
            out.register_hook(lambda grad: started.append(time.perf_counter()))
        return out

    def backward_ends(grad):
        totals["backwards"] += 1
        totals["backward_s"] += time.perf_counter() - started.pop()

    def hook_conv1_weight(module, inputs):  # functional_call has swapped in this pass's clone of the weight
        if ps.torch.is_grad_enabled():
            module.weight.register_hook(backward_ends)

    def timed_net_init(self, *args, **kwargs):
        net_init(self, *args, **kwargs)
        self.conv1.register_forward_pre_hook(hook_conv1_weight)

    ps.ParameterServer.forward, ps.Net.__init__ = timed_forward, timed_net_init
    return lambda: "role=server " + " ".join(f"{key}={value:.6f}" if isinstance(value, float) else f"{key}={value}"
                                             for key, value in totals.items())


def clock_rl_cartpole(rl, rank):
    """Clocks for rpc_rl_cartpole.py; returns a function that gives the Timed line's pairs."""
    if rank == 0:
        totals = {"select_actions": 0, "select_action_s": 0.0, "finishes": 0, "finish_s": 0.0}

        def timed(method, name, calls):
            def timed_method(*args, **kwargs):
                begin = time.perf_counter()
                result = method(*args, **kwargs)
                totals[calls] += 1
                totals[f"{name}_s"] += time.perf_counter() - begin
                return result
            return timed_method

        # select_action is what the observer's agent_rref.rpc_sync().select_action(...) runs here
        rl.Agent.select_action = timed(rl.Agent.select_action, "select_action", "select_actions")
        rl.Agent.finish_episode = timed(rl.Agent.finish_episode, "finish", "finishes")
        return lambda: "role=agent " + " ".join(f"{key}={value:.6f}" if isinstance(value, float) else f"{key}={value}"
                                                for key, value in totals.items())
    clock, steps = PhaseClock(), [0]
    observer_init, run_episode = rl.Observer.__init__, rl.Observer.run_episode

    def timed_init(self, args):
        observer_init(self, args)  # its first reset (the seed) untimed, as the script's start-up
        reset, step = self.env.reset, self.env.step

        def timed_reset(*args, **kwargs):
            result = reset(*args, **kwargs)
            clock.mark("reset")
            return result

        def timed_step(action):
            clock.mark("calls")  # since the last step: its report_reward, then select_action for this one
            result = step(action)
            clock.mark("env_step")
            steps[0] += 1
            return result

        self.env.reset, self.env.step = timed_reset, timed_step

    def timed_run_episode(self, agent_rref):
        clock.restart()  # between episodes the observer waits for the agent: not its time
        run_episode(self, agent_rref)
        clock.mark("calls")  # since the last step: its report_reward

    rl.Observer.__init__, rl.Observer.run_episode = timed_init, timed_run_episode
    return lambda: f"role=observer steps={steps[0]} " + " ".join(
        f"{phase}_s={seconds:.6f}" for phase, seconds in clock.totals.items())


CLOCKS = {"rpc_parameter_server.py": clock_parameter_server, "rpc_rl_cartpole.py": clock_rl_cartpole}


def tensorpipe_defaults(module):
    """Not what a user runs (--transports=default): the script's backend_options without _transports=["uv"],
    so that TensorPipe adds its shared-memory transport, whose reactor busy-polls a core in every process."""
    def backend_options(args, **kwargs):
        return module.rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://{args.master_addr}:{args.master_port}",
                                                      rpc_timeout=args.timeout, **kwargs)
    return backend_options


def main():
    argv, transports = sys.argv[1:], "script"
    if argv and argv[0].startswith("--transports="):  # before the script's name: ours, not the script's
        transports = argv.pop(0).split("=", 1)[1]
    if not argv or argv[0] not in CLOCKS or transports not in ("script", "default"):
        sys.exit(f"usage: python benchmarks/timed_rank.py [--transports=default] {{{','.join(CLOCKS)}}} "
                 f"SCRIPT_FLAGS... (with --rank)")
    script, argv = argv[0], argv[1:]
    if "--debug" not in argv:  # what the script does first when run directly, before torch loads
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    sys.argv = [os.path.join(ROOT, script), *argv]  # as the user's process has it (argparse's prog name)
    sys.path.insert(0, ROOT)
    module = importlib.import_module(script[: -len(".py")])
    args = module.parse_args(argv)  # the same parse main() makes next; only to know the role
    if args.rank is None:
        sys.exit("benchmarks/timed_rank.py runs one rank: give --rank (or torchrun's RANK)")
    timed = CLOCKS[script](module, args.rank)
    if transports == "default":
        module.backend_options = tensorpipe_defaults(module)
    module.main(argv)
    print("Timed:", timed(), flush=True)


if __name__ == "__main__":
    main()
