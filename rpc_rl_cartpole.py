"""The tutorial "Getting Started with Distributed RPC Framework", part 1
(https://pytorch.org/tutorials/intermediate/rpc_tutorial.html): the agent (rank 0) owns the
policy; every other rank plays CartPole-v1, asking it for each action.

    python rpc_rl_cartpole.py --world_size=3  # every rank; or one terminal each, with --rank=R
"""
import argparse
import contextlib
import datetime
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
from multiprocessing import resource_tracker

if __name__ == "__main__":  # before torch starts threads that would inherit it; main() unblocks
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])
    if "--debug" not in sys.argv:
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # no C++ log lines

import gymnasium as gym  # the tutorial's gym is no longer maintained
import psutil
import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.distributed.rpc import RRef, remote
from torch.distributions import Categorical

AGENT_NAME = "agent"
OBSERVER_NAME = "obs{}"


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
        # By rank: the tutorial's env.seed(args.seed) gives every observer the same episodes.
        self.env.reset(seed=seed + self.id)

    def run_episode(self, agent_rref):
        state, _ = self.env.reset()  # gymnasium's (state, info)
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
        self.total_steps = 0
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
            # One RPC: the tutorial's rpc_async of ob_rref.rpc_sync().run_episode makes the observer
            # call itself a second time.
            futs.append(ob_rref.rpc_async().run_episode(self.agent_rref))

        # until all finish or one fails (the tutorial's fut.wait() in turn sits on one)
        torch.futures.wait_all(futs)

    def finish_episode(self):
        # joins probs and rewards from different observers into lists
        probs, returns = [], []
        for ob_id in self.rewards:
            probs.extend(self.saved_log_probs[ob_id])
            # Per observer: the tutorial's returns run across observers' episodes joined.
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


def run_worker(rank, world_size, args):
    torch.set_num_threads(1)  # the policy is tiny: a second thread only spins
    # One RPC thread on the agent: the threads that build the graph order the gradients' sum.
    options = backend_options(args, num_worker_threads=1 if rank == 0 else 16)
    with deadline(rank, args):
        rpc.init_rpc(worker_name(rank, world_size), rank=rank, world_size=world_size,
                     rpc_backend_options=options)
    if rank == 0:
        agent = Agent(world_size, gamma=args.gamma, seed=args.seed)
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
        seconds = time.perf_counter() - start
        print(f"Summary: episodes={i_episode} steps={agent.total_steps} seconds={seconds:.2f} "
              f"us_per_step={seconds / agent.total_steps * 1e6:.0f} solved={str(solved).lower()}")
    # else: observers passively wait for instructions from the agent
    wait_for_peers(rank, args)  # rpc.shutdown() alone hangs on a dead peer
    rpc.shutdown(timeout=args.timeout)


def worker_name(rank, world_size):
    return AGENT_NAME if rank == 0 else OBSERVER_NAME.format(rank)


def parse_args(argv=None):  # the tutorial parses at import
    parser = argparse.ArgumentParser(
        description="RPC Reinforcement Learning Example",
        epilog="Rank 0 is the agent, every other rank an observer.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)
    add = parser.add_argument
    add("--log_interval", type=number(int, 1), default=10, help="Episodes between status lines.")
    add("--gamma", type=number(float, 0, 1), default=0.99, help="How much to value future rewards.")
    add("--max_episodes", type=number(int, 0), default=0,
        help="Stop after this many episodes (0: when solved, as the tutorial).")
    return parse_common(parser, argv, world_size=2, least=2)


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
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's holds it
    if rank == 0 and not agent:  # in our words: torch's for a port in use vary by release
        try:
            bound(args.master_port).close()
        except OSError as exc:
            fail(rank, args, f"cannot listen on port {args.master_port} ({exc.strerror})")
    # torch's own meeting fails unexplained on two world sizes
    store = dist.TCPStore(args.master_addr, args.master_port, is_master=rank == 0 and not agent,
                          timeout=datetime.timedelta(seconds=9 * args.timeout), multi_tenant=True)
    store.add("came", 1)  # before rank 0 reads sizes
    store.set(str(rank), str(args.world_size))
    for peer in range(args.world_size):
        sizes = sorted({int(store.get(str(peer))), args.world_size})
        if len(sizes) > 1:
            store.add("told", 1)
            while rank == 0 and store.add("told", 0) < max(store.add("came", 0), args.world_size):
                time.sleep(0.1)  # the store lives here: all read it first
            fail(rank, args, "ranks of --world_size {} and {} met".format(*sizes))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "You are using a Backend")  # torch's own use of it
        yield
    try:
        tell_peers(rank, args)  # a failed first connection aborts TensorPipe (moolib#34)
    except RuntimeError:  # get_worker_info's: no peer of that name
        fail(rank, args, f"ranks of two scripts met at port {args.master_port}")
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
    # and for a peer lost within it
    timer = threading.Timer(args.timeout, fail, (rank, args, "lost a peer in rpc.shutdown()"))
    timer.daemon = True
    timer.start()


@contextlib.contextmanager
def one_at_a_time():
    with open(__file__) as lock:  # ranks on one machine, e.g. downloading into one folder
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def bound(port):  # SO_REUSEADDR, as torch's store binds: rank 0 can still listen on it
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("", port))
    return sock


def describe(exc, args):
    head, _, tail = str(exc).partition("\nTraceback")  # torch's report of an RPC's
    where, cause = re.findall(r"id=(\d+), name=(.*?)\)", head), re.findall(r"^\S.*", tail, re.M)
    if where and cause:
        return "rank {} ({}): {}".format(*where[-1], cause[0])
    if isinstance(exc, socket.gaierror):
        return f"cannot resolve --master_addr {args.master_addr} ({exc.strerror})"
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
            args.ifname = next(name for name, addrs in psutil.net_if_addrs().items()
                               if ours in [a.address for a in addrs])
        os.environ["GLOO_SOCKET_IFNAME"] = os.environ["TP_SOCKET_IFNAME"] = args.ifname
        torch.manual_seed(args.seed + rank)  # --seed repeats a run
        # Freeing 30 MB raises glibc's trim threshold: the parameter server unmapped 25 MB a batch.
        torch.empty(30 * 2**20, dtype=torch.uint8)
        run_worker(rank, args.world_size, args)
    except Exception as exc:
        if "timeout" not in str(exc):  # a peer ended? name it
            with contextlib.suppress(RuntimeError):
                tell_peers(rank, args)
        fail(rank, args, traceback.format_exc() if args.debug else describe(exc, args))


def number(kind, low, high=math.inf):  # argparse type naming its range
    def parse(text):
        if low <= kind(text) <= high:
            return kind(text)
        raise argparse.ArgumentTypeError(f"{text} is not in [{low}, {high}]")
    parse.__name__ = kind.__name__  # for argparse's "invalid int value"
    return parse


def parse_common(parser, argv, world_size, least, most=math.inf):
    add, env = parser.add_argument, os.environ.get  # torchrun's
    add("--world_size", "--world-size", type=number(int, least, most),
        default=env("WORLD_SIZE", world_size), help="Processes in all, every role.")
    add("--rank", type=int, default=env("RANK"), help="Run only this rank (None: all).")
    add("--master_addr", default=env("MASTER_ADDR", "localhost"), help="Address of rank 0.")
    add("--master_port", type=number(int, 1, 65535), default=env("MASTER_PORT"),
        help="Rank 0's port (None: 29500, or a free one for one command).")
    add("--ifname", choices=list(psutil.net_if_addrs()), metavar="IFNAME",
        help="Network interface (None: the one that reaches rank 0).")
    add("--timeout", type=number(float, 1, 86400), default=60,
        help="Seconds (1-86400) to wait for a peer, 5x to meet.")
    add("--debug", action="store_true", help="Tracebacks and torch's log on a failure.")
    add("--seed", type=number(int, 0, 2**32 - 1), default=1, help="Seeds all random draws.")
    args = parser.parse_args(argv)
    if args.rank is not None and not 0 <= args.rank < args.world_size:
        parser.error(f"--rank must be in [0, {args.world_size}) at --world_size {args.world_size}")
    return args


def main():
    args = parse_args()
    if args.rank is not None:
        args.master_port = args.master_port or 29500
        print(f"Rank {args.rank} waits {5 * args.timeout:g} s for all {args.world_size} ranks at "
              f"{args.master_addr}:{args.master_port}", file=sys.stderr)
        return run_rank(args.rank, args)
    if not args.master_port:  # a free one, held till we exit
        held = bound(0)
        args.master_port = held.getsockname()[1]
    print(f"Starting {args.world_size} ranks on port {args.master_port}", flush=True)
    try:
        resource_tracker.ensure_running()  # now: its start unblocks SIGINT (CPython bpo-33613)
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])  # the ranks inherit it
        ranks = mp.start_processes(run_rank, (args,), args.world_size, join=False)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])  # raises one that came
        logging.getLogger("torch.multiprocessing.spawn").addFilter(  # our line says it
            lambda record: "Terminating" not in record.msg)
        while not ranks.join(grace_period=2):
            pass
    except (mp.ProcessExitedException, KeyboardInterrupt) as exc:
        for process in mp.active_children():
            process.kill()
        if isinstance(exc, KeyboardInterrupt):
            sys.exit("Interrupted: stopped every rank.")
        how = exc.signal_name or f"exit code {exc.exit_code}"
        sys.exit(f"Rank {exc.error_index} ended ({how}): stopped every rank.")


if __name__ == "__main__":
    main()
