"""CartPole agent and observer over RPC vs. the same agent and environment in one process.

Both play --episodes episodes of CartPole-v1 with the script's Policy,
select_action and finish_episode, and are measured in this one invocation.
Prints one line of key=value pairs; ratio is the RPC run's microseconds per
environment step over the single-process one.

    python benchmarks/bench_rl_cartpole.py [--episodes 50] [--repeats 2]
"""
import argparse
import os
import re
import socket
import subprocess
import sys
import tempfile
import time

import gymnasium as gym
import torch
import torch.distributed.rpc as rpc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import rpc_rl_cartpole as rl  # noqa: E402

OBSERVER_ID = 1  # the id the one observer has in the RPC run


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def single_process(bench):
    """The script's Agent and one environment, with no RPC in between."""
    torch.manual_seed(bench.seed)
    agent = rl.Agent(world_size=1, seed=bench.seed)  # no remote observers: the loop below plays the observer
    agent.rewards[OBSERVER_ID], agent.saved_log_probs[OBSERVER_ID] = [], []
    env = gym.make(rl.ENV_NAME)
    seed = bench.seed + OBSERVER_ID
    start = time.perf_counter()
    for _ in range(bench.episodes):
        state, _ = env.reset(seed=seed)
        seed = None
        rewards, done = [], False
        while not done:
            action = agent.select_action(OBSERVER_ID, state)
            state, reward, terminated, truncated, _ = env.step(action)
            rewards.append(reward)
            done = terminated or truncated
        agent.report_reward(OBSERVER_ID, rewards)
        agent.finish_episode()
    return (time.perf_counter() - start) / agent.total_steps * 1e6, agent.total_steps


def rpc_run(bench):
    """One run of the script as a user would start it; returns its Summary fields."""
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run(
            [sys.executable, os.path.join(ROOT, "rpc_rl_cartpole.py"), "--world_size", "2", "--seed", str(bench.seed),
             "--max_episodes", str(bench.episodes), "--master_port", str(free_port())],
            cwd=tmp, capture_output=True, text=True, timeout=1800)
    summary = re.search(r"^Summary: (.*)$", out.stdout, re.M)
    if out.returncode != 0 or not summary:
        sys.exit(f"RPC run failed (exit {out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return dict(kv.split("=") for kv in summary.group(1).split())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--episodes", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=2, help="rounds of (single, RPC); each side keeps its fastest")
    bench = parser.parse_args()

    # The single-process agent still needs RPC for its RRef(self): a group of one, no peers.
    rl._quiet_known_warnings()  # the script's own filter for torch.distributed's known-harmless warnings
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{free_port()}")
    rpc.init_rpc(rl.AGENT_NAME, rank=0, world_size=1, rpc_backend_options=options)
    singles, runs = [], []
    for _ in range(bench.repeats):  # alternate the two, so a busy spell on the machine hits both
        singles.append(single_process(bench))
        runs.append(rpc_run(bench))
    rpc.shutdown()
    base_us, base_steps = min(singles)
    fields = min(runs, key=lambda f: float(f["us_per_step"]))
    rpc_us = float(fields["us_per_step"])
    print(f"bench=rl_cartpole world_size=2 episodes={bench.episodes} seed={bench.seed} repeats={bench.repeats} "
          f"single_us_per_step={base_us:.0f} single_steps={base_steps} rpc_us_per_step={rpc_us:.0f} "
          f"rpc_steps={fields['steps']} ratio={rpc_us / base_us:.2f} target_ratio<=3")


if __name__ == "__main__":
    main()
