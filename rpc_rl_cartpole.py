"""The tutorial "Getting Started with Distributed RPC Framework", part 1
(https://pytorch.org/tutorials/intermediate/rpc_tutorial.html): the agent (rank 0) owns the
policy; every other rank plays CartPole-v1, asking it for each action.

    python rpc_rl_cartpole.py --world_size=3  # every rank; or one terminal each, with --rank=R
"""
import argparse
import contextlib
import fcntl
import logging
import math
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

if __name__ == "__main__" and "--debug" not in sys.argv:  # torch reads it as it loads
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")

import gymnasium as gym  # the tutorial's gym is no longer maintained
import torch
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.distributed.rpc import RRef, remote
from torch.distributions import Categorical

AGENT_NAME = "agent"
OBSERVER_NAME = "obs{}"  # the tutorial's "obs" names all observers alike


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


class Observer:
    def __init__(self, seed=1):  # the tutorial's global args.seed
        self.id = rpc.get_worker_info().id
        self.env = gym.make("CartPole-v1")
        # By rank: the tutorial's env.seed(args.seed) starts every observer alike.
        self.env.reset(seed=seed + self.id)

    def run_episode(self, agent_rref):
        state, _ = self.env.reset()  # gymnasium's (state, info)
        # No n_steps: the tutorial's 100 / observers holds every reward under the threshold.
        # The tutorial: _remote_method(Agent.<method>, agent_rref, ...), the same calls.
        for _ in range(10000):
            # send the state to the agent to get an action
            action = agent_rref.rpc_sync().select_action(self.id, state)
            state, reward, terminated, truncated, _ = self.env.step(action)
            # report the reward to the agent for training purpose
            agent_rref.rpc_sync().report_reward(self.id, reward)
            if terminated or truncated:  # gym's done
                break


class Agent:
    def __init__(self, world_size, gamma=0.99, seed=1):  # the tutorial's global args
        self.ob_rrefs = []
        self.agent_rref = RRef(self)
        self.rewards = {}
        self.saved_log_probs = {}
        self.policy = Policy()
        self.optimizer = optim.Adam(self.policy.parameters(), lr=1e-2)
        self.gamma = gamma
        self.eps = torch.finfo(torch.float32).eps  # as the tutorial's numpy
        self.running_reward = 0
        self.reward_threshold = gym.make("CartPole-v1").spec.reward_threshold
        self.total_steps = 0  # not in the tutorial: for the Summary line
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
            # The tutorial: rpc_async(ob_rref.owner(), _call_method, ...), the same call.
            futs.append(ob_rref.rpc_async().run_episode(self.agent_rref))

        # until all finish or one fails (the tutorial waits on each in turn)
        torch.futures.wait_all(futs)

    def finish_episode(self):
        # joins probs and returns from different observers into lists
        probs, returns = [], []
        for ob_id in self.rewards:
            probs.extend(self.saved_log_probs[ob_id])
            # Per observer: the tutorial's returns run across the joined episodes.
            R, ob_returns = 0, []
            for r in self.rewards[ob_id][::-1]:
                R = r + self.gamma * R
                ob_returns.insert(0, R)
            returns.extend(ob_returns)
        self.total_steps += len(returns)

        min_reward = min([sum(self.rewards[ob_id]) for ob_id in self.rewards])
        self.running_reward = 0.05 * min_reward + (1 - 0.05) * self.running_reward

        for ob_id in self.rewards:
            self.rewards[ob_id] = []
            self.saved_log_probs[ob_id] = []

        policy_loss = []
        returns = torch.tensor(returns)
        returns = (returns - returns.mean()) / (returns.std() + self.eps)
        for log_prob, R in zip(probs, returns):
            policy_loss.append(-log_prob * R)
        self.optimizer.zero_grad()
        policy_loss = torch.cat(policy_loss).sum()
        policy_loss.backward()
        self.optimizer.step()
        return min_reward


def run_worker(rank, world_size, args):  # args: the flags, the tutorial's globals
    torch.set_num_threads(1)  # not in the tutorial: the policy is tiny, a second thread spins
    # One RPC thread on the agent: the threads that build the graph order the gradients' sum.
    options = backend_options(args, num_worker_threads=1 if rank == 0 else 16)
    with meeting(rank, args):
        rpc.init_rpc(worker_name(rank, world_size), rank=rank, world_size=world_size,
                     rpc_backend_options=options)
    if rank == 0:
        agent = Agent(world_size, gamma=args.gamma, seed=args.seed)
        # Not in the tutorial: when it stops.
        print(f"This will run until reward threshold of {agent.reward_threshold} is reached"
              + (f", or for {args.max_episodes} episodes." if args.max_episodes else "."))
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
            if i_episode == args.max_episodes:
                break
        seconds = time.perf_counter() - start  # not in the tutorial: for people and scripts
        print(f"Summary: episodes={i_episode} steps={agent.total_steps} seconds={seconds:.2f} "
              f"us_per_step={seconds / agent.total_steps * 1e6:.0f} solved={str(solved).lower()}")
    # else: observers passively wait for instructions from the agent
    say_done(rank, args)  # not in the tutorial: rank 0 watches until all are done
    rpc.shutdown()


def worker_name(rank, world_size):
    return AGENT_NAME if rank == 0 else OBSERVER_NAME.format(rank)


def parse_args(argv=None):  # the tutorial parses at import
    parser = argparse.ArgumentParser(
        description="RPC Reinforcement Learning Example",
        epilog="Rank 0 is the agent, every other rank an observer.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)
    add = parser.add_argument
    # 10, as the tutorial's sample output (its flag says 1).
    add("--log_interval", type=in_range(int, 1), default=10, help="Episodes between status lines.")
    add("--gamma", type=in_range(float, 0, 1), default=0.99,
        help="How much to value future rewards.")  # the tutorial's 0.1 sees a step ahead
    add("--max_episodes", type=in_range(int, 0), default=0,
        help="Stop after this many episodes (0: when solved, as the tutorial).")
    return parse_common(parser, argv, world_size=2, least=2)


# --------- Launching ranks (not in the tutorials) --------------------
def backend_options(args, **kwargs):
    # TCP only: shared memory busy-polls (private: pytorch/pytorch#33982).
    return rpc.TensorPipeRpcBackendOptions(rpc_timeout=args.timeout, _transports=["uv"], **kwargs)


met, done, ending = threading.Event(), set(), threading.Lock()


@contextlib.contextmanager
def meeting(rank, args):
    timer = threading.Timer(5 * args.timeout, stop, (rank, args, "not all ranks met"))
    timer.start()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "You are using a Backend")
        yield
    timer.cancel()
    met.set()
    threading.Thread(target=watch, args=(rank, args), daemon=True).start()


def check_peers(rank, args):
    for peer in [0] if rank else range(1, args.world_size):
        name = worker_name(peer, args.world_size)
        try:
            if rank:
                socket.create_connection((args.master_addr, args.master_port), args.timeout).close()
            elif met.is_set():
                rpc.rpc_sync(name, os.getpid, timeout=args.timeout)
        except Exception:
            stop(rank, args, f"cannot reach rank {peer} ({name})")


def watch(rank, args):
    while rank or len(done) < args.world_size:
        check_peers(rank, args)
        time.sleep(1)
    time.sleep(args.timeout + 2)
    stop(rank, args, "lost a peer in rpc.shutdown()")


def note_done(rank):
    done.add(rank)


def say_done(rank, args):
    rpc.rpc_async(0, note_done, (rank,))


def stop(rank, args, why):
    with ending:
        sys.stdout.flush()
        print(f"Error on rank {rank} ({worker_name(rank, args.world_size)}):", why, file=sys.stderr)
        os._exit(1)


def machine_lock():
    lock = open(__file__)
    fcntl.flock(lock, fcntl.LOCK_EX)
    return lock


def describe(exc):
    where = re.findall(r"id=(\d+), name=(.*?)\):\n(.*)", str(exc))
    line = "rank {} ({}): {}".format(*where[-1]) if where else f"{type(exc).__name__}: {exc}"
    return line.split("\n")[0]


def run_rank(rank, args):
    try:
        if socket.gethostbyname(args.master_addr).startswith("127.") or args.ifname:
            os.environ["GLOO_SOCKET_IFNAME"] = os.environ["TP_SOCKET_IFNAME"] = args.ifname or "lo"
        os.environ.update(MASTER_ADDR=args.master_addr, MASTER_PORT=str(args.master_port))
        torch.manual_seed(args.seed + rank)
        torch.empty(30 * 2**20, dtype=torch.uint8)  # freed: raises glibc's trim threshold
        run_worker(rank, args.world_size, args)
        ending.acquire()  # done: no more lines
        if rank == 0:
            time.sleep(1)  # peers' shutdown uses its store
    except socket.gaierror:
        stop(rank, args, f"cannot resolve --master_addr {args.master_addr}")
    except Exception as exc:
        time.sleep(1)
        check_peers(rank, args)
        stop(rank, args, traceback.format_exc() if args.debug else describe(exc))


def in_range(kind, low, high=math.inf):
    def number(text):
        if low <= kind(text) <= high:
            return kind(text)
        raise argparse.ArgumentTypeError(f"{text} is not in [{low}, {high}]")
    return number


def parse_common(parser, argv, world_size, least, most=math.inf):
    add, env = parser.add_argument, os.environ.get
    add("--world_size", "--world-size", type=in_range(int, least, most),
        default=env("WORLD_SIZE", world_size), help="Processes in all.")
    add("--rank", type=int, default=env("RANK"), help="Run only this rank (None: all).")
    add("--master_addr", default=env("MASTER_ADDR", "localhost"), help="Rank 0's address.")
    add("--master_port", type=in_range(int, 1, 65535), default=env("MASTER_PORT"),
        help="Rank 0's port (None: 29500; one command: a free one).")
    add("--ifname", help="Interface (None: lo if rank 0 is local).")
    add("--timeout", type=in_range(float, 1, 86400), default=60, help="Seconds to wait (meet: 5x).")
    add("--debug", action="store_true", help="On a failure: traceback, torch's log.")
    add("--seed", type=in_range(int, 0), default=1, help="Seeds every draw.")
    args = parser.parse_args(argv)
    if not 0 <= (args.rank or 0) < args.world_size:
        parser.error(f"--rank must be in [0, --world_size={args.world_size})")
    return args


def main():
    args = parse_args()
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    if not args.debug:
        logging.disable()
    if args.rank is not None:
        args.master_port = args.master_port or 29500
        return run_rank(args.rank, args)
    with socket.socket() as free:
        free.bind(("", 0))
        args.master_port = args.master_port or free.getsockname()[1]
    try:  # forked: spawn re-imports torch
        mp.start_processes(run_rank, (args,), args.world_size, start_method="fork")
    except mp.ProcessExitedException as exc:
        how = exc.signal_name or f"exit code {exc.exit_code}"
        sys.exit(f"Rank {exc.error_index} ended ({how}).")


if __name__ == "__main__":
    main()
