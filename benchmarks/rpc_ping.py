"""A no-op rpc_sync round trip between two fresh processes, on the transport the scripts use; and the same
no-op called the way the CartPole tutorial calls its agent, through an RRef.

    python benchmarks/rpc_ping.py --rank=0 --master_port=PORT &
    python benchmarks/rpc_ping.py --rank=1 --master_port=PORT [--calls 2000] [--transports default]

Rank 1 calls a function on rank 0 that does nothing, --warmup times untimed and then --calls times, one at a
time. Then it does the same through `rref.rpc_sync().noop()` on an RRef of an object that rank 0 owns, as the
observer's `agent_rref.rpc_sync().select_action(...)` does. It prints
`Ping: calls=N seconds=... us_per_call=... rref_us_per_call=...`. The difference is what torch's RRef protocol
adds to each call: the proxy sends the RRef itself as an argument, and its owner then confirms the new fork to
the caller (RREF_CHILD_ACCEPT, and the caller's answer), two messages more per call. Both ranks set up RPC as rpc_rl_cartpole.py's
agent (rank 0) and observer (rank 1) do: the script's own backend_options (TensorPipe, TCP only:
_transports=["uv"]), one RPC thread on rank 0 and TensorPipe's 16 on rank 1, one intra-op thread each. So one
call is the least one CartPole step can pay for its round trip to the agent. --transports default (on both
ranks) leaves out _transports, so TensorPipe adds its shared-memory transport: not what the scripts run.
"""
import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def noop():
    return None


class Target:
    def noop(self):
        return None


def timed(call, args):
    """Microseconds per call: --warmup untimed calls, then --calls timed ones, one at a time."""
    for _ in range(args.warmup):
        call()
    start = time.perf_counter()
    for _ in range(args.calls):
        call()
    return 1e6 * (time.perf_counter() - start) / args.calls


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--rank", type=int, required=True, choices=(0, 1))
    parser.add_argument("--master_addr", default="localhost")
    parser.add_argument("--master_port", type=int, default=29500)
    parser.add_argument("--calls", type=int, default=2000, help="timed calls")
    parser.add_argument("--warmup", type=int, default=200, help="untimed calls first")
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
        rpc.init_rpc(f"ping{args.rank}", rank=args.rank, world_size=2, rpc_backend_options=options)
    if args.rank == 1:
        us_per_call = timed(lambda: rpc.rpc_sync("ping0", noop), args)
        target = rpc.remote("ping0", Target)  # owned by rank 0, as the agent owns agent_rref
        rref_us_per_call = timed(lambda: target.rpc_sync().noop(), args)
        print(f"Ping: calls={args.calls} seconds={us_per_call * args.calls / 1e6:.4f} us_per_call={us_per_call:.1f} "
              f"rref_us_per_call={rref_us_per_call:.1f}", flush=True)
        del target  # released before shutdown, as the script's observers drop agent_rref
    rpc.shutdown(timeout=args.timeout)


if __name__ == "__main__":
    main()
