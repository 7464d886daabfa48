"""CartPole agent and one observer over RPC, run as the README tells a user, against the plain loop in one process.

    python benchmarks/bench_rl_cartpole.py --rounds 3 [--episodes 150]

Each round runs, one after the other:

1. the single process: this file's plain loop, in a fresh process with torch's defaults. It is the script's
   Agent logic without RPC, as a user would write it: the script's Policy, Adam lr 1e-2, one CartPole-v1
   environment seeded as the script's observer (rank 1), torch seeded as its agent (rank 0); per step select an
   action (the policy, a Categorical sample, its log-prob kept) and step the environment; per episode the
   script's REINFORCE update; --episodes episodes, or fewer if solved. It runs on its own too, and prints the
   same line:

       python benchmarks/bench_rl_cartpole.py --single [--episodes 150]

2. the floor: benchmarks/rpc_ping.py, two fresh processes set up as the script's agent and observer. The
   agent sends an RRef it owns to the observer, which calls a no-op through that fork twice per step, as the
   tutorial's observer calls `agent_rref.rpc_sync().select_action(...)` and `.report_reward(...)`, on the
   scripts' transport (TensorPipe over TCP, _transports=["uv"]). One step over RPC cannot cost less than one step
   in one process plus those two calls: floor = single µs per step + rpc_ping's us_per_step.

3. RPC: rpc_rl_cartpole.py at world size 2 (one agent, one observer), one process per rank as a user runs it
   in two terminals,

       python rpc_rl_cartpole.py --world_size=2 --rank=0 --master_port=PORT --max_episodes=150
       python rpc_rl_cartpole.py --world_size=2 --rank=1 --master_port=PORT --max_episodes=150

   on a free port, with the environment of the shell this runs in and nothing added. Each rank runs through
   benchmarks/timed_rank.py, which calls the script's own main() with those arguments and adds clocks: the
   observer's phases and the agent's own select_action and finish_episode. µs per step is the script's own
   Summary line (us_per_step).

Prints every round, then the machine, the median µs per step of each phase of both sides (reset,
select_action, env_step, and for one process finish: the end-of-episode update; for RPC calls, the observer's
two calls to the agent, and rest, what the observer does not see: the agent's update and starting each
episode) with the agent's own select_action (within calls: the rest of calls is the two round trips) and
finish_episode (within rest), and the medians, ranges and ratios to one process and to the floor, all as
key=value pairs. The bound is ratio_to_floor at most 1.15 (aim 1.05), median of 3 rounds. Exit status 1 if a
run fails.

--transports default runs the RPC side and the floor with TensorPipe's default transports (shared memory added,
which busy-polls a core per process) instead of the scripts' TCP only: not what a user runs, for the README's
figures of what TCP costs. Defaults: --rounds 3, --episodes 150, --calls 2000, --seed 1.
"""
import argparse
import os
import sys
import time

from common import (Failed, add_bench_flags, fields, held_port, machine, median, medians, python, rounds_reported,
                    run_together, same, shown, spread)

SINGLE_PHASES = ("reset", "select_action", "env_step", "finish")
RPC_PHASES = ("reset", "calls", "env_step", "rest")
OBSERVER_RANK = 1  # the only observer at world size 2; its environment is seeded with seed + this


def single(args):
    """The plain single-process loop; prints one `Single:` line of key=value pairs."""
    import gymnasium as gym
    import torch
    import torch.optim as optim
    from torch.distributions import Categorical

    from rpc_rl_cartpole import Policy

    torch.manual_seed(args.seed)  # what the script's agent (rank 0) seeds
    env = gym.make("CartPole-v1")
    env.reset(seed=args.seed + OBSERVER_RANK)  # what the script's observer seeds
    policy = Policy()
    optimizer = optim.Adam(policy.parameters(), lr=1e-2)
    gamma, eps = 0.99, torch.finfo(torch.float32).eps
    running_reward, steps, solved = 0, 0, False
    totals = dict.fromkeys(SINGLE_PHASES, 0.0)
    start = last = time.perf_counter()
    for episode in range(1, args.episodes + 1):
        state, _ = env.reset()
        now = time.perf_counter()
        totals["reset"] += now - last
        rewards, log_probs = [], []
        for _ in range(10000):
            probs = policy(torch.from_numpy(state).float().unsqueeze(0))
            m = Categorical(probs)
            action = m.sample()
            log_probs.append(m.log_prob(action))
            action = action.item()
            last, now = now, time.perf_counter()
            totals["select_action"] += now - last
            state, reward, terminated, truncated, _ = env.step(action)
            last, now = now, time.perf_counter()
            totals["env_step"] += now - last
            rewards.append(reward)
            if terminated or truncated:
                break
        R, returns = 0, []
        for r in rewards[::-1]:
            R = r + gamma * R
            returns.insert(0, R)
        steps += len(rewards)
        running_reward = 0.05 * sum(rewards) + (1 - 0.05) * running_reward
        returns = torch.tensor(returns)
        returns = (returns - returns.mean()) / (returns.std() + eps)
        policy_loss = torch.cat([-log_prob * R for log_prob, R in zip(log_probs, returns)]).sum()
        optimizer.zero_grad()
        policy_loss.backward()
        optimizer.step()
        last = time.perf_counter()
        totals["finish"] += last - now
        solved = running_reward > env.spec.reward_threshold
        if solved:
            break
    seconds = time.perf_counter() - start
    print(f"Single: episodes={episode} steps={steps} seconds={seconds:.3f} us_per_step={1e6 * seconds / steps:.1f} "
          + " ".join(f"{phase}_us={1e6 * total / steps:.1f}" for phase, total in totals.items())
          + f" solved={str(solved).lower()} torch={torch.__version__} intra_op_threads={torch.get_num_threads()}",
          flush=True)


def single_round(bench):
    command = python("benchmarks/bench_rl_cartpole.py", "--single", "--episodes", bench.episodes, "--seed", bench.seed)
    got = fields(run_together([command], bench.limit)[0], "Single:")
    result = {phase: float(got[f"{phase}_us"]) for phase in SINGLE_PHASES}
    result.update(us_per_step=float(got["us_per_step"]), steps=int(got["steps"]), torch=got["torch"],
                  intra_op_threads=got["intra_op_threads"])
    return result, command


def ping_round(bench):
    with held_port() as port:
        commands = [python("benchmarks/rpc_ping.py", f"--rank={rank}", f"--master_port={port}", "--calls", bench.calls,
                           *["--transports", "default"] * (bench.transports == "default")) for rank in (0, 1)]
        got = fields(run_together(commands, bench.limit)[0], "Ping:")
    return float(got["us_per_step"]), commands


def rpc_round(bench):
    with held_port() as port:
        flags = ["--world_size=2", f"--master_port={port}", f"--max_episodes={bench.episodes}", f"--seed={bench.seed}"]
        commands = [python("benchmarks/timed_rank.py", *bench.wrapper_flags, "rpc_rl_cartpole.py", f"--rank={rank}",
                           *flags) for rank in (0, 1)]
        agent_out, observer_out = run_together(commands, bench.limit)
    summary, agent = fields(agent_out, "Summary:"), fields(agent_out, "Timed:")
    observer = fields(observer_out, "Timed:")
    steps = int(summary["steps"])
    if int(observer["steps"]) != steps:
        raise Failed(f"the observer timed {observer['steps']} steps, the agent's Summary says {steps}")
    result = {phase: 1e6 * float(observer.get(f"{phase}_s", 0)) / steps for phase in RPC_PHASES if phase != "rest"}
    result.update(us_per_step=float(summary["us_per_step"]), steps=steps, episodes=int(summary["episodes"]),
                  agent_select_action=1e6 * float(agent["select_action_s"]) / steps,
                  agent_finish=1e6 * float(agent["finish_s"]) / steps)
    result["rest"] = 1e6 * float(summary["seconds"]) / steps - sum(result[phase] for phase in RPC_PHASES[:-1])
    return result, commands


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--episodes", type=int, default=150, help="episodes per run (fewer if solved)")
    parser.add_argument("--calls", type=int, default=2000, help="timed steps of two no-op calls for the floor")
    add_bench_flags(parser, "single process, floor, RPC")
    bench = parser.parse_args(argv)
    if bench.rounds < 1 or bench.episodes < 1 or bench.calls < 1:
        parser.error("--rounds, --episodes and --calls must be at least 1")
    if bench.single:
        return single(bench)
    bench.wrapper_flags = ["--transports=default"] * (bench.transports == "default")

    singles, pings, rpcs = [], [], []
    with rounds_reported(rpcs):
        for n in range(1, bench.rounds + 1):  # alternating, so that a busy spell on the machine hits every side
            result, single_command = single_round(bench)
            singles.append(result)
            ping, ping_commands = ping_round(bench)
            pings.append(ping)
            result, rpc_commands = rpc_round(bench)
            rpcs.append(result)
            if n == 1:
                print(f"# single: {shown(single_command)}", f"# floor rank 0: {shown(ping_commands[0])}",
                      f"# floor rank 1: {shown(ping_commands[1])}", f"# rpc rank 0: {shown(rpc_commands[0])}",
                      f"# rpc rank 1: {shown(rpc_commands[1])}", sep="\n")
            single_us, rpc_us = singles[-1]["us_per_step"], rpcs[-1]["us_per_step"]
            print(f"round={n} single_us_per_step={single_us:.0f} rpc_us_per_step={rpc_us:.0f} "
                  f"ratio={rpc_us / single_us:.2f} two_calls_us={ping:.0f} floor_us_per_step={single_us + ping:.0f} "
                  f"ratio_to_floor={rpc_us / (single_us + ping):.2f} single_steps={singles[-1]['steps']} "
                  f"rpc_steps={rpcs[-1]['steps']}", flush=True)

    single_us, rpc_us = [r["us_per_step"] for r in singles], [r["us_per_step"] for r in rpcs]
    floors = [s + p for s, p in zip(single_us, pings)]
    print(machine(singles[0]["torch"]), f"single_intra_op_threads={singles[0]['intra_op_threads']}")
    print("phase_us_per_step=median", medians("single", singles, SINGLE_PHASES, 0),
          medians("rpc", rpcs, RPC_PHASES, 0), medians("rpc", rpcs, ("agent_select_action", "agent_finish"), 0))
    print(f"bench=rl_cartpole world_size=2 rounds={bench.rounds} episodes={bench.episodes} seed={bench.seed} "
          f"transports={bench.transports} "
          f"single_steps={same([r['steps'] for r in singles])} rpc_steps={same([r['steps'] for r in rpcs])} "
          f"{spread('single_us_per_step', single_us, 0)} {spread('rpc_us_per_step', rpc_us, 0)} "
          f"{spread('two_calls_us', pings, 0)} {spread('floor_us_per_step', floors, 0)} "
          f"ratio={median(rpc_us) / median(single_us):.2f} ratio_to_floor={median(rpc_us) / median(floors):.2f} "
          f"bound=1.15 aim=1.05", flush=True)


if __name__ == "__main__":
    sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the scripts, for --single
    main()
