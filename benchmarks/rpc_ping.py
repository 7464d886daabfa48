"""Two no-op calls per step through an RRef fork, as the CartPole tutorial's observer calls its agent, between two
fresh processes on the transport the scripts use.

    python benchmarks/rpc_ping.py --rank=0 --master_port=PORT [--calls 2000] [--transports default] &
    python benchmarks/rpc_ping.py --rank=1 --master_port=PORT

Rank 0 plays the agent: it owns an object and an RRef to it, and sends the RRef to rank 1 in an RPC, as the
agent sends agent_rref to each observer's run_episode. Rank 1 plays the observer: holding that fork, it calls
`rref.rpc_sync().noop()` twice per step (the tutorial's select_action and report_reward), --warmup steps
untimed and then --calls steps timed, one call at a time, and returns the time. Rank 0 prints
`Ping: steps=N seconds=... us_per_call=... us_per_step=...`; us_per_step (two calls) is the least one CartPole
step over RPC can add to the same step in one process.

Both ranks set up RPC as rpc_rl_cartpole.py's agent (rank 0) and observer (rank 1) do, with their names (the
script's deadline checks them), the script's own backend_options (TensorPipe, TCP only: _transports=["uv"]), one
RPC thread on rank 0 and TensorPipe's 16 on rank 1, one intra-op thread each. --transports default (on both ranks) leaves out _transports, so TensorPipe
adds its shared-memory transport: not what the scripts run.
"""
import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Target:
    def noop(self):
        return None


def time_steps(rref, steps, warmup):
    """On rank 1, in an RPC thread as the observer's run_episode: seconds for `steps` steps of two calls each."""
    for _ in range(warmup):
        rref.rpc_sync().noop()
        rref.rpc_sync().noop()
    start = time.perf_counter()
    for _ in range(steps):
        rref.rpc_sync().noop()
        rref.rpc_sync().noop()
    return time.perf_counter() - start


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--rank", type=int, required=True, choices=(0, 1))
    parser.add_argument("--master_addr", default="localhost")
    parser.add_argument("--master_port", type=int, default=29500)
    parser.add_argument("--calls", type=int, default=2000, help="timed steps of two calls each")
    parser.add_argument("--warmup", type=int, default=200, help="untimed steps first")
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--transports", choices=("script", "default"), default="script",
                        help="the scripts' (TCP only), or TensorPipe's defaults (adds shared memory, which busy-polls)")
    args = parser.parse_args(argv)
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # as the scripts do, before torch loads
    sys.path.insert(0, ROOT)
    import torch
    import torch.distributed.rpc as rpc
    import rpc_rl_cartpole as rl

    script_args = rl.parse_args(["--world_size=2", f"--rank={args.rank}", f"--master_addr={args.master_addr}",
                                 f"--master_port={args.master_port}", f"--timeout={args.timeout}"])
    torch.set_num_threads(1)  # as the script's run_worker
    threads = 1 if args.rank == 0 else 16
    if args.transports == "script":
        options = rl.backend_options(script_args, num_worker_threads=threads)
    else:
        options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://{args.master_addr}:{args.master_port}",
                                                  rpc_timeout=args.timeout, num_worker_threads=threads)
    with rl.deadline(args.rank, script_args):
        rpc.init_rpc(rl.worker_name(args.rank, 2), rank=args.rank, world_size=2, rpc_backend_options=options)
    if args.rank == 0:
        target = rpc.RRef(Target())  # owned here, as the agent owns agent_rref
        seconds = rpc.rpc_sync(rl.worker_name(1, 2), time_steps, args=(target, args.calls, args.warmup), timeout=0)
        print(f"Ping: steps={args.calls} seconds={seconds:.4f} us_per_call={1e6 * seconds / args.calls / 2:.1f} "
              f"us_per_step={1e6 * seconds / args.calls:.1f}", flush=True)
    rpc.shutdown(timeout=args.timeout)


if __name__ == "__main__":
    main()
