"""The floor of a CartPole step over RPC: two no-op calls through an RRef fork, between two fresh processes.

    python benchmarks/rpc_ping.py --rank=0 --master_port=PORT [--steps 2000] &
    python benchmarks/rpc_ping.py --rank=1 --master_port=PORT

Rank 0 plays the agent: it owns an object, wraps it in an RRef and sends that to rank 1, as the agent sends
agent_rref to each observer. Rank 1 plays the observer: per step it calls `rref.rpc_sync().noop()` twice (the
tutorial's select_action and report_reward), one call at a time. Rank 0 prints `Ping: steps=N seconds=...
us_per_step=...`. The transport and thread counts are the script's: TensorPipe over TCP only, one RPC thread on
the agent, 16 on the observer.
"""
import argparse
import time

import torch.distributed.rpc as rpc


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


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--rank", type=int, required=True, choices=(0, 1))
    p.add_argument("--master_addr", default="localhost")
    p.add_argument("--master_port", type=int, default=29500)
    p.add_argument("--steps", type=int, default=2000, help="timed steps of two calls each")
    p.add_argument("--warmup", type=int, default=200, help="untimed steps first")
    p.add_argument("--timeout", type=float, default=60.0)
    args = p.parse_args()
    # _transports=["uv"]: TCP only, as the scripts (TensorPipe's shared-memory transport busy-polls a core).
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://{args.master_addr}:{args.master_port}",
                                              rpc_timeout=args.timeout, _transports=["uv"],
                                              num_worker_threads=1 if args.rank == 0 else 16)
    rpc.init_rpc(["agent", "obs1"][args.rank], rank=args.rank, world_size=2, rpc_backend_options=options)
    if args.rank == 0:
        seconds = rpc.rpc_sync("obs1", time_steps, args=(rpc.RRef(Target()), args.steps, args.warmup), timeout=0)
        print(f"Ping: steps={args.steps} seconds={seconds:.3f} us_per_step={1e6 * seconds / args.steps:.1f}",
              flush=True)
    rpc.shutdown()


if __name__ == "__main__":
    main()
