"""The batch tutorial's own measurement: the batch CartPole with and without batching, 1 to 8 observers.

    python benchmarks/bench_batch_cartpole.py [--rounds 3] [--observers 1 2 4 8] [--episodes 3] [--threads 1]
                                              [--agent_threads 16]

Each round runs, one after the other, for each number of observers N, the script as the README tells a user,
in one command, first batching and then not (the tutorial times both in turn, for world sizes 2 to 11):

    python rpc_batch_cartpole.py --world_size=N+1 --num_episode=EPISODES --batch
    python rpc_batch_cartpole.py --world_size=N+1 --num_episode=EPISODES --no-batch

with the script's default of one RPC thread on the agent, or --agent_threads 16, torch's default, as the
tutorial's comparison runs it. Every observer plays the tutorial's 500 steps an episode. Each run's figure is
the µs per observer-step of its own Summary line (the training loop alone, not the start of the processes).
Prints one line per round, then the machine and, per N, the medians and ranges of both and of their ratio
(below 1: batching is faster).
"""
import statistics

from common import fields, machine, parser, python, rounds, run_together, spread


def one_run(args, observers, batch):
    command = python("rpc_batch_cartpole.py", f"--world_size={observers + 1}", f"--num_episode={args.episodes}",
                     f"--seed={args.seed}", f"--agent_threads={args.agent_threads}",
                     "--batch" if batch else "--no-batch")
    return float(fields(run_together([command], args)[0], "Summary:")["us_per_step"])


def main():
    p = parser(__doc__.splitlines()[0], "batch, no batch for each number of observers")
    p.add_argument("--observers", type=int, nargs="+", default=list(range(1, 9)), help="observer counts")
    p.add_argument("--episodes", type=int, default=3, help="episodes of each run (the tutorial's: 10)")
    p.add_argument("--agent_threads", type=int, default=1, help="the script's --agent_threads (the tutorial: 16)")
    args = p.parse_args()

    def one_round(n):
        figures = {}
        for observers in args.observers:
            figures[observers] = (one_run(args, observers, True), one_run(args, observers, False))
        print(f"Round {n}: " + " ".join(f"observers={o} batch_us={b:.0f} no_batch_us={nb:.0f}"
                                        for o, (b, nb) in figures.items()), flush=True)
        return figures

    results = rounds(args, one_round)
    import torch  # only for its version, once the runs are done

    print(f"Machine: {machine(args, torch.__version__)}")
    for observers in args.observers:
        batch = [r[observers][0] for r in results]
        no_batch = [r[observers][1] for r in results]
        ratio = [b / nb for b, nb in zip(batch, no_batch)]
        print(f"Observers: observers={observers} agent_threads={args.agent_threads} {spread('batch_us', batch, 0)} "
              f"{spread('no_batch_us', no_batch, 0)} {spread('ratio', ratio, 2)} "
              f"ratio_of_medians={statistics.median(batch) / statistics.median(no_batch):.2f}")


if __name__ == "__main__":
    main()
