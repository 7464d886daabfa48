"""The tutorial "Getting Started with Distributed RPC Framework", part 1
(https://pytorch.org/tutorials/intermediate/rpc_tutorial.html): the agent (rank 0) owns the
policy, and every other rank plays CartPole-v1, asking the agent for each action over RPC.

    python rpc_rl_cartpole.py --world_size=3             # every rank, here
    python rpc_rl_cartpole.py --world_size=2 --rank=0    # or one terminal per rank
    python rpc_rl_cartpole.py --world_size=2 --rank=1
    torchrun --nproc_per_node=2 rpc_rl_cartpole.py
"""
import argparse
import contextlib
import os
import re
import signal
import socket
import sys
import threading
import time
import traceback
import warnings
from itertools import count
from multiprocessing import resource_tracker

if __name__ == "__main__":  # before torch starts threads, which inherit it: see main
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])
    if "--debug" not in sys.argv:
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # no C++ log lines

# The tutorial's gym is no longer maintained; gymnasium's reset and step differ (see Observer).
import gymnasium as gym
import psutil
import torch
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.distributed.rpc import RRef, remote
from torch.distributions import Categorical

AGENT_NAME = "agent"
OBSERVER_NAME = "obs{}"


# --------- Policy --------------------
class Policy(nn.Module):
    def __init__(self):
        super().__init__()
        self.affine1 = nn.Linear(4, 128)
        self.dropout = nn.Dropout(p=0.6)
        self.affine2 = nn.Linear(128, 2)

    def forward(self, x):
        x = self.affine1(x)
        x = self.dropout(x)
        x = F.relu(x)
        action_scores = self.affine2(x)
        return F.softmax(action_scores, dim=1)


# --------- Observer --------------------
class Observer:
    def __init__(self, seed=1):  # the tutorial's seed is its global args.seed, 1 by default
        self.id = rpc.get_worker_info().id
        self.env = gym.make("CartPole-v1")
        # By rank: the tutorial's env.seed(args.seed) gives every observer the same episodes.
        self.env.reset(seed=seed + self.id)

    def run_episode(self, agent_rref):
        state, _ = self.env.reset()  # gymnasium: reset returns (state, info); step, five values
        for _ in range(10000):
            # Send state to agent and get action back
            action = agent_rref.rpc_sync().select_action(self.id, state)

            # Apply action to environment (gym's done is terminated or truncated)
            state, reward, terminated, truncated, _ = self.env.step(action)

            # Report reward to agent for training
            agent_rref.rpc_sync().report_reward(self.id, reward)

            if terminated or truncated:
                break


# --------- Agent --------------------
class Agent:
    # lr, gamma and seed: the tutorial's fixed 1e-2 and its global args' gamma and seed.
    def __init__(self, world_size, lr=1e-2, gamma=0.99, seed=1):
        self.ob_rrefs = []
        self.agent_rref = RRef(self)
        self.rewards = {}
        self.saved_log_probs = {}
        self.policy = Policy()
        self.optimizer = optim.Adam(self.policy.parameters(), lr=lr)
        self.gamma = gamma
        self.eps = torch.finfo(torch.float32).eps  # the tutorial's numpy gives the same
        self.running_reward = 0
        self.reward_threshold = gym.make("CartPole-v1").spec.reward_threshold
        self.total_steps = 0  # for the Summary line

        # Initialize remote observers
        for ob_rank in range(1, world_size):
            ob_info = rpc.get_worker_info(OBSERVER_NAME.format(ob_rank))
            self.ob_rrefs.append(remote(ob_info, Observer, kwargs={"seed": seed}))
            self.rewards[ob_info.id] = []
            self.saved_log_probs[ob_info.id] = []

    def select_action(self, ob_id, state):
        state = torch.from_numpy(state).float().unsqueeze(0)
        probs = self.policy(state)
        m = Categorical(probs)
        action = m.sample()
        self.saved_log_probs[ob_id].append(m.log_prob(action))
        return action.item()

    def report_reward(self, ob_id, reward):
        self.rewards[ob_id].append(reward)

    def run_episode(self):
        futs = []
        for ob_rref in self.ob_rrefs:
            # Kick off episodes on all observers asynchronously, in one call each: the tutorial's
            # rpc_async(..., ob_rref.rpc_sync().run_episode) has each observer call itself.
            futs.append(ob_rref.rpc_async().run_episode(self.agent_rref))

        # Wait for all episodes to complete, or for the first that fails (the tutorial's fut.wait()
        # for each in turn would wait on one observer while another failed)
        torch.futures.wait_all(futs)

    def finish_episode(self):
        # Combine data from all observers
        probs, returns = [], []
        for ob_id in self.rewards:
            probs.extend(self.saved_log_probs[ob_id])
            # Discount within each observer's own trajectory: the tutorial discounts all of them
            # joined end to end, so one observer's rewards leaked into another's returns.
            R, ob_returns = 0, []
            for r in self.rewards[ob_id][::-1]:
                R = r + self.gamma * R
                ob_returns.insert(0, R)
            returns.extend(ob_returns)
        self.total_steps += len(returns)

        # Calculate running reward
        min_reward = min([sum(self.rewards[ob_id]) for ob_id in self.rewards])
        self.running_reward = 0.05 * min_reward + (1 - 0.05) * self.running_reward

        # Clear stored data
        for ob_id in self.rewards:
            self.rewards[ob_id] = []
            self.saved_log_probs[ob_id] = []

        # Compute policy loss
        policy_loss = []
        returns = torch.tensor(returns)
        returns = (returns - returns.mean()) / (returns.std() + self.eps)
        for log_prob, R in zip(probs, returns):
            policy_loss.append(-log_prob * R)

        # Update policy
        self.optimizer.zero_grad()
        policy_loss = torch.cat(policy_loss).sum()
        policy_loss.backward()
        self.optimizer.step()

        return min_reward


# --------- Launch Distributed Workers --------------------
def run_worker(rank, world_size, args):
    torch.manual_seed(args.seed + rank)  # the tutorial seeds only the environment: torch too
    torch.set_num_threads(1)  # the policy is tiny: a second thread only spins against other ranks
    # The options replace the tutorial's MASTER_ADDR and MASTER_PORT. One RPC thread on the agent:
    # autograd sums gradients in the order of the threads that built the graph (same seed).
    options = backend_options(args, num_worker_threads=1 if rank == 0 else 16)
    with deadline(rank, args):  # one init_rpc for both roles, where the tutorial has one in each
        rpc.init_rpc(worker_name(rank, world_size), rank=rank, world_size=world_size,
                     rpc_backend_options=options)
    if rank == 0:
        # Rank 0 is the agent
        agent = Agent(world_size, gamma=args.gamma, seed=args.seed)
        print(f"This will run until reward threshold of {agent.reward_threshold} is reached.")
        start = time.perf_counter()
        for i_episode in count(1):
            agent.run_episode()
            last_reward = agent.finish_episode()

            if i_episode % args.log_interval == 0:
                print(f"Episode {i_episode}\tLast reward: {last_reward:.2f}\t"
                      f"Average reward: {agent.running_reward:.2f}")

            solved = agent.running_reward > agent.reward_threshold
            if solved:
                print(f"Solved! Running reward is now {agent.running_reward}!")
                break
            if i_episode == args.max_episodes:  # not in the tutorial, which has no bound
                break
        seconds = time.perf_counter() - start  # not in the tutorial: a line for people and scripts
        print(f"Summary: episodes={i_episode} steps={agent.total_steps} seconds={seconds:.2f} "
              f"us_per_step={seconds / agent.total_steps * 1e6:.0f} solved={str(solved).lower()}")
    # else: other ranks are observers; they wait passively for agent commands

    # Not in the tutorial, whose rpc.shutdown() alone waits forever for a dead peer.
    wait_for_peers(rank, args)
    rpc.shutdown(timeout=args.timeout)


def worker_name(rank, world_size):
    return AGENT_NAME if rank == 0 else OBSERVER_NAME.format(rank)


def parse_args(argv=None):  # the tutorial parses at import
    parser = argparse.ArgumentParser(
        description="RPC Reinforcement Learning Example",
        epilog="Rank 0 is the agent, every other rank an observer with a CartPole of its own.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)
    add = parser.add_argument
    add("--log_interval", type=int, default=10, metavar="N", help="Episodes between status lines.")
    add("--gamma", type=float, default=0.99, metavar="G", help="How much to value future rewards.")
    add("--max_episodes", type=int, default=0, metavar="N",
        help="Stop after N episodes even if not solved (0: run until solved, as the tutorial).")
    args = parse_common(parser, argv, world_size=2)
    if args.world_size < 2:
        parser.error("--world_size must be at least 2: an agent and an observer")
    return args


# --------- Launching ranks (not in the tutorials) --------------------
def backend_options(args, **kwargs):
    # TCP only: shared memory busy-polls (private: pytorch/pytorch#33982).
    return rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://{args.master_addr}:{args.master_port}", rpc_timeout=args.timeout,
        _transports=["uv"], **kwargs)


@contextlib.contextmanager
def deadline(rank, args):
    # torch waits 30 min for a lost rank, forever on a silent port
    timer = threading.Timer(5 * args.timeout, fail, (
        rank, args, f"not all {args.world_size} ranks met at port {args.master_port}"))
    timer.start()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "You are using a Backend")
        yield
    tell_peers(rank, args)  # a failed first connection aborts TensorPipe (moolib#34)
    timer.cancel()


done_ranks = set()


def rank_done(rank, done):
    if done:
        done_ranks.add(rank)


def tell_peers(rank, args, done=False):
    for peer in range(args.world_size):
        name = worker_name(peer, args.world_size)
        to = rpc.get_worker_info(name)  # raises before init_rpc
        try:
            rpc.rpc_sync(to, rank_done, (rank, done))
        except RuntimeError:
            fail(rank, args, f"lost contact with rank {peer} ({name})")


def wait_for_peers(rank, args):
    # rpc.shutdown() waits forever for a dead peer
    while len(done_ranks) < args.world_size:
        time.sleep(1)
        tell_peers(rank, args, True)


def describe(exc, args):
    head, _, tail = str(exc).partition("\nTraceback")  # torch's report of an RPC's
    if tail:
        where = re.findall(r"id=(\d+), name=(.*?)\)", head)[-1]
        return "rank {} ({}): {}".format(*where, re.search(r"\n(\S.*)", tail)[1])
    if isinstance(exc, socket.gaierror):
        return f"{args.master_addr}: {exc.strerror}"
    return f"{type(exc).__name__}: {head}".splitlines()[0]


def fail(rank, args, why):
    print(f"Error on rank {rank} ({worker_name(rank, args.world_size)}): {why}", file=sys.stderr)
    os._exit(1)  # sys.exit waits for threads stuck on lost peers


def run_rank(rank, args):
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C ends it even in torch's waits
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
    if mp.parent_process() and not mp.parent_process().is_alive():
        os._exit(1)  # its launcher died before torch watched
    for stream in sys.stdout, sys.stderr:  # whole lines even unbuffered
        stream.reconfigure(line_buffering=True, write_through=False)
    try:
        if not args.ifname:  # else torch binds the hostname's address
            with socket.socket(type=socket.SOCK_DGRAM) as probe:
                probe.connect((args.master_addr, 1))  # UDP: sends nothing
                ours = probe.getsockname()[0]
            addrs = psutil.net_if_addrs()
            args.ifname = next(name for name in addrs if ours in [a.address for a in addrs[name]])
        os.environ["GLOO_SOCKET_IFNAME"] = os.environ["TP_SOCKET_IFNAME"] = args.ifname
        run_worker(rank, args.world_size, args)
    except Exception as exc:
        if "timeout" not in str(exc):  # a peer ended? name it
            with contextlib.suppress(RuntimeError):
                tell_peers(rank, args)
        fail(rank, args, traceback.format_exc() if args.debug else describe(exc, args))


def parse_common(parser, argv, world_size):
    add, env = parser.add_argument, os.environ.get  # torchrun's
    add("--world_size", "--world-size", type=int, default=env("WORLD_SIZE", world_size))
    add("--rank", type=int, default=env("RANK"), help="Run only this rank.")
    add("--master_addr", default=env("MASTER_ADDR", "localhost"), help="Address of rank 0.")
    add("--master_port", type=int, default=env("MASTER_PORT", 29500),
        help="Port of rank 0 (one command: a free one).")
    add("--ifname")
    add("--timeout", type=float, default=60, help="Seconds to wait for a peer, 5x to meet.")
    add("--debug", action="store_true", help="Tracebacks, C++ log.")
    add("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    if args.rank is not None and not 0 <= args.rank < args.world_size:
        parser.error(f"--rank must be in [0, {args.world_size})")
    return args


def main():
    args = parse_args()
    if args.rank is not None:
        print(f"Rank {args.rank} waits {5 * args.timeout:g} s for all", file=sys.stderr)
        return run_rank(args.rank, args)
    if args.master_port == 29500:  # held: no other program takes it
        held = socket.socket()
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind(("", 0))
        args.master_port = held.getsockname()[1]
    print(f"Starting {args.world_size} ranks on port {args.master_port}", flush=True)
    try:
        resource_tracker.ensure_running()  # unblocks Ctrl-C (CPython bpo-33613)
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])  # the ranks inherit it
        ranks = mp.start_processes(run_rank, (args,), args.world_size, join=False)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])  # raises one that came
        while not ranks.join(grace_period=2):
            pass
    except (mp.ProcessExitedException, KeyboardInterrupt) as exc:
        for process in mp.active_children():
            process.kill()
        sys.exit(f"{str(exc) or 'Interrupted'}: stopped every rank.")


if __name__ == "__main__":
    main()
