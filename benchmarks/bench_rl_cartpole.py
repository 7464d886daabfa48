"""CartPole agent and observer over RPC vs. the same agent and environment in one process.

Both sides play --episodes episodes of CartPole-v1 with the script's Agent
(Policy, select_action, finish_episode) and the same seeds, so they take the
same steps, in this one invocation, in --rounds alternating rounds of (single
process, RPC). The RPC side is the script's own run at world size 2 (one
agent, one observer) in two spawned processes, rpc_rl_cartpole.run_rank for
each rank; only its observer's environment is timed (TimedObserver). Prints
every round, then the machine, the median microseconds per environment step
of each phase (select_action, for RPC the round trip the observer waits;
env.step; env.reset; finish, the per-episode report and update, for RPC
everything the observer does not see) for both sides, plus the agent's own
select_action timed inside it (agent_select_action, a part of the observer's
select_action: the rest is the round trip), and the medians,
ranges and ratio of the whole, all as key=value pairs.

    python benchmarks/bench_rl_cartpole.py [--episodes 50] [--rounds 3] [--transports default] [--rank_env none]
"""
import argparse
import os
import re
import sys
import time
import warnings
from statistics import median

import gymnasium as gym
import torch
import torch.distributed.rpc as rpc

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]
import rpc_rl_cartpole as rl  # noqa: E402
from common import (add_rank_env_flag, PhaseClock, captured_stdout, free_port, machine, phase_medians,  # noqa: E402
                    run_rpc_round, same, spread)

PHASES = ("select_action", "env_step", "reset", "finish")
OBSERVER_ID = 1  # the one observer's rank and RPC id; its environment's seed is seed + this
CLOCK = PhaseClock()  # this process's environment calls


class TimedEnv(gym.Wrapper):
    """The environment with a clock: the time between its calls is spent choosing the action."""

    def reset(self, **kwargs):
        CLOCK.mark("finish")
        result = self.env.reset(**kwargs)
        CLOCK.mark("reset")
        return result

    def step(self, action):
        CLOCK.mark("select_action")
        result = self.env.step(action)
        CLOCK.mark("env_step")
        return result


class TimedObserver(rl.Observer):
    """The script's Observer on a TimedEnv; the RPC side sets rl.Observer to this so the agent builds it."""

    def __init__(self, seed):
        super().__init__(seed)
        self.env = TimedEnv(self.env)

    def run_episode(self, agent_rref):
        CLOCK.restart()  # between episodes the observer waits for the agent: that time is not its own
        super().run_episode(agent_rref)


def single_round(args):
    """The script's Agent choosing for one TimedEnv in this process, the loop of run_agent and run_episode."""
    torch.manual_seed(args.seed)  # what the agent's rank seeds
    agent = rl.Agent(world_size=1, gamma=args.gamma, lr=args.lr, seed=args.seed)  # no remote observers
    agent.rewards[OBSERVER_ID], agent.saved_log_probs[OBSERVER_ID] = [], []
    env = TimedEnv(gym.make(rl.ENV_NAME))
    seed = args.seed + OBSERVER_ID
    CLOCK.totals = {}
    CLOCK.restart()
    for _ in range(args.max_episodes):
        state, _ = env.reset(seed=seed)
        seed = None
        rewards = []
        for _ in range(10000):  # Observer.run_episode's cap
            action = agent.select_action(OBSERVER_ID, state)
            state, reward, terminated, truncated, _ = env.step(action)
            rewards.append(reward)
            if terminated or truncated:
                break
        agent.report_reward(OBSERVER_ID, rewards)
        agent.finish_episode()
        if agent.running_reward > agent.reward_threshold:
            break
    CLOCK.mark("finish")
    return figures(CLOCK.totals, agent.total_steps)


def figures(totals, steps):
    us = {phase: 1e6 * seconds / steps for phase, seconds in totals.items()}
    return {"us_per_step": sum(us.values()), "phases": us, "steps": steps}


def time_the_agent():
    """A clock inside the agent: its own select_action, so the round trip is what the observer waits beyond it."""
    totals = {"agent_select_action": 0.0}
    select_action = rl.Agent.select_action

    def timed_select_action(self, ob_id, state):
        begin = time.perf_counter()
        action = select_action(self, ob_id, state)
        totals["agent_select_action"] += time.perf_counter() - begin
        return action

    rl.Agent.select_action = timed_select_action
    return totals


def rpc_rank(rank, args):
    """One process of the RPC side: the script's own rank, its observer a TimedObserver."""
    rl.Observer = TimedObserver  # the name the agent builds its observers from
    if args.transports != "script":
        rl.RPC_TRANSPORTS = None if args.transports == "default" else args.transports.split(",")
    agent_clock = time_the_agent()
    with captured_stdout() as printed:  # the script's progress lines; errors still reach stderr
        if hasattr(rl, "_set_rendezvous_env"):  # plumbing where _init_rpc does not set MASTER_ADDR/PORT itself
            rl._set_rendezvous_env(rank, args)
        rl.run_rank(rank, args)
        if rank == OBSERVER_ID:
            return {"observer": CLOCK.totals}
        summary = re.search(r"^Summary: (.*)$", printed(), re.M)
    if summary is None:
        raise RuntimeError("rpc_rl_cartpole.py printed no Summary line")
    fields = dict(pair.split("=", 1) for pair in summary.group(1).split() if "=" in pair)
    return {"steps": int(fields["steps"]), "us_per_step": float(fields["us_per_step"]), "agent": agent_clock}


def rpc_round(args, rank_env):
    """The script's run with its own us_per_step; what its observer did not see is the agent's finish."""
    result = run_rpc_round(rpc_rank, args, rank_env=rank_env)
    seen = {phase: seconds for phase, seconds in result["observer"].items() if phase != "finish"}
    seen["finish"] = result["us_per_step"] * result["steps"] / 1e6 - sum(seen.values())
    timed = figures(seen, result["steps"])
    for phase, seconds in result["agent"].items():  # inside the agent: a part of select_action, not added again
        timed["phases"][phase] = 1e6 * seconds / result["steps"]
    return timed


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of (single process, RPC)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--transports", default="script",
                        help="TensorPipe transports of the RPC side: script (the script's own), default (TensorPipe's), or e.g. uv")
    add_rank_env_flag(parser)
    bench = parser.parse_args()
    if bench.rounds < 1 or bench.episodes < 1:
        parser.error("--rounds and --episodes must be at least 1")

    flags = ["--world_size", "2", "--seed", str(bench.seed), "--max_episodes", str(bench.episodes)]
    # The single-process Agent still needs RPC for its RRef(self): a group of one,
    # TCP only, so that no shared-memory reactor polls beside the RPC rounds.
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{free_port()}", _transports=["uv"])
    with warnings.catch_warnings():  # init_rpc's own use of a gloo Backend, harmless
        warnings.filterwarnings("ignore", message=r"You are using a Backend .* as a ProcessGroup")
        rpc.init_rpc(rl.AGENT_NAME, rank=0, world_size=1, rpc_backend_options=options)
    singles, rpcs = [], []
    try:
        for n in range(1, bench.rounds + 1):  # alternate, so that a busy spell on the machine hits both sides
            singles.append(single_round(rl.parse_args(flags)))
            rpc_args = rl.parse_args(flags + ["--master_port", str(free_port())])
            rpc_args.transports = bench.transports
            rpcs.append(rpc_round(rpc_args, bench.rank_env))
            single, remote = singles[-1]["us_per_step"], rpcs[-1]["us_per_step"]
            print(f"round={n} single_us_per_step={single:.0f} rpc_us_per_step={remote:.0f} ratio={remote / single:.2f} "
                  f"single_steps={singles[-1]['steps']} rpc_steps={rpcs[-1]['steps']}", flush=True)
    except torch.multiprocessing.ProcessException as exc:
        sys.exit(f"The RPC side failed in round {len(rpcs) + 1}: {exc}")
    finally:
        rpc.shutdown()

    single_us = [r["us_per_step"] for r in singles]
    rpc_us = [r["us_per_step"] for r in rpcs]
    print(machine())
    print("phase_us_per_step=median", phase_medians("single", [r["phases"] for r in singles], PHASES, 0),
          phase_medians("rpc", [r["phases"] for r in rpcs], PHASES + ("agent_select_action",), 0))
    print(f"bench=rl_cartpole world_size=2 rounds={bench.rounds} episodes={bench.episodes} seed={bench.seed} "
          f"transports={bench.transports} rank_env={bench.rank_env} "
          f"single_steps={same([r['steps'] for r in singles])} rpc_steps={same([r['steps'] for r in rpcs])} "
          f"{spread('single_us_per_step', single_us, 0)} {spread('rpc_us_per_step', rpc_us, 0)} "
          f"ratio={median(rpc_us) / median(single_us):.2f}", flush=True)


if __name__ == "__main__":
    main()
