"""CartPole with one observer, run as the README tells a user, against the floor of its two calls per step.

    python benchmarks/bench_rl_cartpole.py [--rounds 3] [--episodes 150] [--threads 1]

Each round runs, one after the other:

1. one process: this file's plain loop in a fresh process with torch's defaults, the loop a user would write:
   the script's Policy, Adam lr 1e-2, one CartPole-v1 seeded as the script's observer (rank 1), torch seeded as
   its agent (rank 0); per step the policy picks an action and the environment steps; per episode the script's
   REINFORCE update; --episodes episodes, or fewer if solved. Alone:
       python benchmarks/bench_rl_cartpole.py --single
2. the calls: benchmarks/rpc_ping.py, two fresh processes that make the tutorial's two calls per step
   (`agent_rref.rpc_sync().select_action(...)`, `.report_reward(...)`) as no-ops. A step over RPC cannot cost
   less than the step in one process plus those two calls: floor = one process's us_per_step + the calls'.
3. the script at world size 2, one process per rank as a user starts them in two terminals:
       python rpc_rl_cartpole.py --world_size=2 --rank=0 --master_port=PORT --max_episodes=150
       python rpc_rl_cartpole.py --world_size=2 --rank=1 --master_port=PORT --max_episodes=150
   on a free port, with the shell's environment. us per step is the agent's own Summary line.

--threads 1 sets OMP_NUM_THREADS=1 for every process. Prints one line per round, then the machine and the
medians, ratio_to_floor among them, as key=value pairs; exit status 1 if a run fails.
"""
import os
import statistics
import sys
import time

from common import fields, free_port, machine, parser, python, rounds, run_together, shown, spread

OBSERVER = 1  # the only observer at world size 2; its environment is seeded with seed + its rank


def single(args):
    """The plain loop in this process; prints one `Single:` line."""
    import gymnasium as gym
    import torch
    from torch.distributions import Categorical

    from rpc_rl_cartpole import Policy

    torch.manual_seed(args.seed)  # as the script's agent (rank 0)
    env = gym.make("CartPole-v1")
    env.reset(seed=args.seed + OBSERVER)  # as the script's observer
    policy = Policy()
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-2)
    eps, running_reward, steps, solved = torch.finfo(torch.float32).eps, 0, 0, False
    start = time.perf_counter()
    for episode in range(1, args.episodes + 1):
        state, _ = env.reset()
        rewards, log_probs = [], []
        for _ in range(10000):
            m = Categorical(policy(torch.from_numpy(state).float().unsqueeze(0)))
            action = m.sample()
            log_probs.append(m.log_prob(action))
            state, reward, terminated, truncated, _ = env.step(action.item())
            rewards.append(reward)
            if terminated or truncated:
                break
        R, returns = 0, []
        for r in rewards[::-1]:
            R = r + 0.99 * R
            returns.insert(0, R)
        steps += len(rewards)
        running_reward = 0.05 * sum(rewards) + (1 - 0.05) * running_reward
        returns = torch.tensor(returns)
        returns = (returns - returns.mean()) / (returns.std() + eps)
        optimizer.zero_grad()
        torch.cat([-log_prob * R for log_prob, R in zip(log_probs, returns)]).sum().backward()
        optimizer.step()
        solved = running_reward > env.spec.reward_threshold
        if solved:
            break
    seconds = time.perf_counter() - start
    print(f"Single: episodes={episode} steps={steps} seconds={seconds:.2f} us_per_step={1e6 * seconds / steps:.0f} "
          f"solved={str(solved).lower()} torch={torch.__version__} intra_op_threads={torch.get_num_threads()}",
          flush=True)


def main():
    p = parser(__doc__.splitlines()[0], "one process, the calls, the script")
    p.add_argument("--episodes", type=int, default=150, help="episodes per run (fewer if solved)")
    p.add_argument("--steps", type=int, default=2000, help="timed steps of two no-op calls for the floor")
    p.add_argument("--single", action="store_true", help="run only the one-process loop, here, and print it")
    args = p.parse_args()
    if args.single:
        return single(args)

    def one_round(n):
        one = python("benchmarks/bench_rl_cartpole.py", "--single", f"--episodes={args.episodes}",
                     f"--seed={args.seed}")
        got = fields(run_together([one], args)[0], "Single:")
        with free_port() as port:
            pings = [python("benchmarks/rpc_ping.py", f"--rank={rank}", f"--master_port={port}",
                            f"--steps={args.steps}") for rank in (0, 1)]
            calls = float(fields(run_together(pings, args)[0], "Ping:")["us_per_step"])
        with free_port() as port:
            ranks = [python("rpc_rl_cartpole.py", "--world_size=2", f"--rank={rank}", f"--master_port={port}",
                            f"--max_episodes={args.episodes}", f"--seed={args.seed}") for rank in (0, 1)]
            rpc = fields(run_together(ranks, args)[0], "Summary:")
        if n == 1:
            print(f"# one process: {shown(one)}", *(f"# calls rank {r}: {shown(c)}" for r, c in enumerate(pings)),
                  *(f"# rank {r}: {shown(c)}" for r, c in enumerate(ranks)), sep="\n")
        single_us, rpc_us = float(got["us_per_step"]), float(rpc["us_per_step"])
        floor = single_us + calls
        print(f"round={n} single_us_per_step={single_us:.0f} two_calls_us={calls:.0f} floor_us_per_step={floor:.0f} "
              f"rpc_us_per_step={rpc_us:.0f} ratio_to_floor={rpc_us / floor:.2f} ratio={rpc_us / single_us:.2f} "
              f"single_steps={got['steps']} rpc_steps={rpc['steps']}", flush=True)
        return single_us, calls, floor, rpc_us, got

    results = rounds(args, one_round)
    single_us, calls, floors, rpc_us = ([r[i] for r in results] for i in range(4))
    print(machine(args, results[0][4]["torch"]), f"single_intra_op_threads={results[0][4]['intra_op_threads']}")
    print(f"bench=rl_cartpole world_size=2 rounds={args.rounds} threads={args.threads} episodes={args.episodes} "
          f"seed={args.seed} {spread('single_us_per_step', single_us, 0)} {spread('two_calls_us', calls, 0)} "
          f"{spread('floor_us_per_step', floors, 0)} {spread('rpc_us_per_step', rpc_us, 0)} "
          f"ratio_to_floor_median={statistics.median(r / f for f, r in zip(floors, rpc_us)):.2f} "
          f"ratio_median={statistics.median(r / s for s, r in zip(single_us, rpc_us)):.2f}", flush=True)


if __name__ == "__main__":
    sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the scripts, for --single
    main()
