"""Distributed reinforcement learning with PyTorch's RPC framework and RRef.

The tutorial "Getting Started with Distributed RPC Framework", part 1
(https://pytorch.org/tutorials/intermediate/rpc_tutorial.html). The agent (rank 0) owns the
policy; every other rank is an observer with a CartPole-v1 environment. The agent starts an
episode on every observer at once, each observer asks the agent for every action through the
agent's RRef, and after the episode the agent updates the policy with REINFORCE.

One command starts every rank:       python rpc_rl_cartpole.py --world_size=3
One terminal per rank:               python rpc_rl_cartpole.py --world_size=2 --rank=0
                                     python rpc_rl_cartpole.py --world_size=2 --rank=1
torchrun:                            torchrun --nproc_per_node=2 rpc_rl_cartpole.py
"""
import argparse
import contextlib
import fcntl
import itertools
import os
import re
import signal
import socket
import struct
import sys
import threading
import time
import traceback
import warnings
from itertools import count

if __name__ == "__main__" and "--debug" not in sys.argv:
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # before torch loads: no C++ warnings as peers go

import gymnasium as gym  # the tutorial's gym is no longer maintained; gymnasium's reset and step differ (see Observer)
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
    def __init__(self, args):
        self.id = rpc.get_worker_info().id
        self.env = gym.make("CartPole-v1")
        self.args = args  # the tutorial's args are a module-level global; here the agent passes them in
        # The tutorial's env.seed(args.seed) gives every observer the same episodes; gymnasium seeds at reset, by rank.
        self.env.reset(seed=args.seed + self.id)

    def run_episode(self, agent_rref):
        try:
            state, _ = self.env.reset()  # gymnasium: reset returns (state, info); step, five values (see below)
            for _ in range(10000):
                # Send state to agent and get action back
                action = agent_rref.rpc_sync().select_action(self.id, state)

                # Apply action to environment
                state, reward, terminated, truncated, _ = self.env.step(action)  # gym's done: terminated or truncated

                # Report reward to agent for training
                agent_rref.rpc_sync().report_reward(self.id, reward)

                if terminated or truncated:
                    break
        except Exception as exc:  # torch would print this RPC's traceback here: one line instead (--debug: both),
            if not self.args.debug:  # and this observer ends, so the agent stops too rather than train on a cut episode
                fail(self.id, self.args, describe(exc))
            raise


# --------- Agent --------------------
class Agent:
    def __init__(self, world_size, args):  # the tutorial's Agent(world_size) reads the global args
        self.ob_rrefs = []
        self.agent_rref = RRef(self)
        self.rewards = {}
        self.saved_log_probs = {}
        self.policy = Policy()
        self.optimizer = optim.Adam(self.policy.parameters(), lr=args.lr)  # the tutorial's 1e-2, now a flag
        self.gamma = args.gamma
        self.eps = torch.finfo(torch.float32).eps  # the tutorial's numpy eps: the same number, one import fewer
        self.running_reward = 0
        self.reward_threshold = gym.make("CartPole-v1").spec.reward_threshold
        self.total_steps = 0  # for the Summary line

        # Initialize remote observers
        for ob_rank in range(1, world_size):
            ob_info = rpc.get_worker_info(OBSERVER_NAME.format(ob_rank))
            self.ob_rrefs.append(remote(ob_info, Observer, args=(args,)))
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
            # Kick off episodes on all observers asynchronously (the tutorial's rpc_async wraps a blocking proxy)
            futs.append(ob_rref.rpc_async().run_episode(self.agent_rref))

        # Wait for all episodes to complete
        for fut in futs:
            fut.wait()

    def finish_episode(self):
        # Combine data from all observers
        probs, returns = [], []
        for ob_id in self.rewards:
            probs.extend(self.saved_log_probs[ob_id])
            # Discount within each observer's own trajectory: the tutorial discounts all the trajectories joined
            # end to end, so one observer's rewards leaked into another's returns.
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
    torch.manual_seed(args.seed + rank)  # the tutorial seeds only the environment: torch too, so --seed repeats a run
    torch.set_num_threads(1)  # the policy is tiny: a second intra-op thread only spins, and slows the other ranks
    # The tutorial sets MASTER_ADDR and MASTER_PORT; the options name rank 0's address and bound every wait. One RPC
    # thread on the agent: autograd sums gradients in an order set by the threads that built the graph (same --seed).
    options = backend_options(args, num_worker_threads=1 if rank == 0 else 16)
    with deadline(rank, args):  # one init_rpc for both roles, where the tutorial has one in each branch
        rpc.init_rpc(worker_name(rank, world_size), rank=rank, world_size=world_size, rpc_backend_options=options)
    if rank == 0:
        # Rank 0 is the agent
        agent = Agent(world_size, args)
        limit = f" (or for at most {args.max_episodes} episodes)" if args.max_episodes else ""  # not in the tutorial
        print(f"This will run until reward threshold of {agent.reward_threshold} is reached{limit}.")
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
            if i_episode == args.max_episodes:  # the tutorial has no bound; 0 keeps it so
                break
        seconds = time.perf_counter() - start  # not in the tutorial: one key=value line for people and scripts
        print(f"Summary: episodes={i_episode} steps={agent.total_steps} seconds={seconds:.2f} "
              f"us_per_step={seconds / agent.total_steps * 1e6:.0f} solved={str(solved).lower()}")
    # else: other ranks are observers; they wait passively for the agent's calls

    # The tutorial's rpc.shutdown() alone waits forever for a peer that died: wait_for_peers first, and a time limit.
    wait_for_peers(rank, args)
    rpc.shutdown(timeout=args.timeout)


def worker_name(rank, world_size):
    return AGENT_NAME if rank == 0 else OBSERVER_NAME.format(rank)


def parse_args(argv=None):  # the tutorial parses at import; a function lets tests and users import the classes
    parser = argparse.ArgumentParser(description="RPC Reinforcement Learning Example",
                                     epilog="Rank 0 is the agent; every other rank is an observer with its own "
                                     "CartPole. --world_size must be at least 2 (the default, one observer).",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)
    add_common_flags(parser, world_size=2)
    parser.add_argument("--log_interval", type=int, default=10, metavar="N", help="Episodes between status lines.")
    parser.add_argument("--gamma", type=float, default=0.99, metavar="G", help="How much to value future rewards.")
    parser.add_argument("--lr", type=float, default=1e-2, help="Learning rate of Adam.")  # the tutorial's, fixed
    parser.add_argument("--max_episodes", type=int, default=0, metavar="N",
                        help="Stop after N episodes even if not solved (0: run until solved, as the tutorial).")
    args = parser.parse_args(argv)
    check_common_args(parser, args)
    if args.world_size < 2:
        parser.error(f"--world_size must be at least 2 (one agent and at least one observer), got {args.world_size}")
    if args.log_interval <= 0:
        parser.error(f"--log_interval must be positive, got {args.log_interval}")
    if not 0 < args.gamma <= 1:
        parser.error(f"--gamma must be in (0, 1], got {args.gamma}")
    if args.max_episodes < 0:
        parser.error(f"--max_episodes must be 0 (until solved) or positive, got {args.max_episodes}")
    return args


# --------- Launching ranks, bounding waits, reporting failures --------------------
# Not in the tutorials; the same text in all four scripts, which each supply worker_name and run_worker above.
def backend_options(args, **kwargs):
    # TCP only: the shared-memory transport busy-polls a core per process (a private option: pytorch/pytorch#33982).
    return rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://{args.master_addr}:{args.master_port}",
                                           rpc_timeout=args.timeout, _transports=["uv"], **kwargs)


@contextlib.contextmanager
def deadline(rank, args, rpc_group=True):
    """Around init_rpc (or, rpc_group=False, init_process_group), which waits 30 minutes for a missing rank, forever
    on a silent port; after init_rpc, a check that every rank runs this script: another's would answer its RPCs."""
    where = f"not all {args.world_size} ranks of this script met at {args.master_addr}:{args.master_port}"
    (timer := threading.Timer(args.meet_timeout, fail, (rank, args, f"{where} within {args.meet_timeout:g} s: check "
                              "--world_size and --master_port."))).start()
    try:
        with warnings.catch_warnings():  # init_rpc's own use of a Gloo Backend as a ProcessGroup: not ours to fix
            warnings.filterwarnings("ignore", message="You are using a Backend .* as a ProcessGroup")
            yield
        if rpc_group:  # every rank runs this script: another script's ranks would answer its RPCs
            for peer in range(args.world_size):
                rpc.get_worker_info(worker_name(peer, args.world_size))  # raises for a name that no rank has
    except Exception as exc:  # also: the rank that hosted the meeting gave up (ranks of another --world_size came)
        fail(rank, args, f"{where}: {traceback.format_exc() if args.debug else describe(exc)}")
    timer.cancel()


_ranks_done, _all_done = itertools.count(1), torch.futures.Future()  # on rank 0: ranks done so far, and when all are


@rpc.functions.async_execution  # on rank 0: answers once every rank is done, holding no RPC thread meanwhile
def _rank_done(world_size):
    if next(_ranks_done) == world_size:  # next() on a count is atomic: two ranks done at once count as two
        _all_done.set_result(None)
    return _all_done


def wait_for_peers(rank, args, futures=None):
    """Before rpc.shutdown(), which waits forever for a peer that died: every rank tells rank 0 it is done and waits
    for the answer, which comes when all are (given futures of RPCs with no time limit: their results). Meanwhile it
    asks every peer each second if it answers: a peer whose process ended fails at once, a vanished one at --timeout."""
    done, futures = threading.Event(), futures or [rpc.rpc_async(0, _rank_done, args=(args.world_size,), timeout=0)]
    torch.futures.collect_all(futures).add_done_callback(lambda _: done.set())
    while not done.wait(timeout=1):
        for peer in set(range(args.world_size)) - {rank}:
            try:
                rpc.rpc_sync(peer, os.getpid)
            except RuntimeError:
                fail(rank, args, f"lost contact with rank {peer} ({worker_name(peer, args.world_size)}); see its output.")
    return [fut.wait() for fut in futures]  # (raises what a future failed with)


def describe(exc):
    """One line for an exception; for one raised inside an RPC, the rank it ran on and the remote exception."""
    text = str(exc).strip() or type(exc).__name__
    # The callee's repr(exception), then its traceback (torch prints it on the callee too); innermost first.
    if remote := re.findall(r"On WorkerInfo\(id=(\d+), name=(.*?)\):\n(.*)", text):
        return "an RPC that ran on rank {} ({}) raised {}".format(*remote[-1])
    lost = re.search("end of file|connection reset|closed by peer|broken pipe|no such process", text, re.I)
    return f"{type(exc).__name__}: {text.splitlines()[0]}" + " (a peer's process ended; see its output)" * bool(lost)


def fail(rank, args, message):
    print(f"Error on rank {rank} ({worker_name(rank, args.world_size)}): {message}", file=sys.stderr, flush=True)
    os._exit(1)  # RPC's threads may still wait on a peer that is gone


def pick_interface(rank, args):
    """Gloo and TensorPipe announce the address the hostname resolves to, often 127.0.0.1: for a --master_addr on
    another machine, use the interface that reaches it (SIOCGIFADDR reads an interface's address)."""
    if args.ifname is None and not socket.gethostbyname(args.master_addr).startswith("127."):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((args.master_addr, args.master_port))  # UDP: finds the route, sends nothing
            ours = socket.inet_aton(probe.getsockname()[0])
            for _, name in socket.if_nameindex():
                with contextlib.suppress(OSError):  # an interface without an address
                    if fcntl.ioctl(probe, 0x8915, struct.pack("256s", name.encode()))[20:24] == ours:
                        args.ifname = name
        print(f"Rank {rank}: using network interface {args.ifname} to reach {args.master_addr}")
    if args.ifname:
        os.environ["GLOO_SOCKET_IFNAME"] = os.environ["TP_SOCKET_IFNAME"] = os.environ["NCCL_SOCKET_IFNAME"] = args.ifname


def run_rank(rank, args):
    """One process: the tutorial's run_worker, and one line instead of a traceback if it fails."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C ends a rank at once, even inside a wait in torch
    if mp.parent_process() and not mp.parent_process().is_alive():  # a launcher killed while this rank started,
        return  # before torch.multiprocessing armed the signal that the launcher's death sends its ranks
    for stream in (sys.stdout, sys.stderr):  # whole lines, even with PYTHONUNBUFFERED=1: ranks never merge
        stream.reconfigure(line_buffering=True, write_through=False)
    try:
        pick_interface(rank, args)
        run_worker(rank, args.world_size, args)
    except Exception as exc:
        fail(rank, args, traceback.format_exc() if args.debug else describe(exc))


def add_common_flags(parser, world_size):
    parser.add_argument("--world_size", "--world-size", type=int, default=world_size, help="Processes, all roles.")
    parser.add_argument("--rank", type=int, help="Run only this rank (a terminal or machine each); else all here.")
    parser.add_argument("--master_addr", default="localhost", help="Address of rank 0.")
    parser.add_argument("--master_port", type=int, help="Port of rank 0; 29500 with --rank, else a free one.")
    parser.add_argument("--ifname", help="Network interface to use; found from --master_addr if it is not local.")
    parser.add_argument("--timeout", type=float, help="Longest wait for a peer or an RPC, in seconds (default: 60; "
                        "ranks started by hand with --rank wait 300 s for each other).")
    parser.add_argument("--debug", action="store_true", help="On a failure, the traceback and torch's own log too.")
    parser.add_argument("--seed", type=int, default=1, help="Random seed.")
    parser.set_defaults(**{name.lower(): os.environ[name] for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
                           if name in os.environ})  # set by torchrun (and other launchers); a flag overrides them


def check_common_args(parser, args):
    if args.rank is not None and not 0 <= args.rank < args.world_size:
        parser.error(f"--rank must be in [0, {args.world_size}) for --world_size {args.world_size}, got {args.rank}")
    args.master_port = args.master_port or (29500 if args.rank is not None else None)
    by_hand = args.rank is not None and "RANK" not in os.environ  # one terminal per rank: a person starts the rest
    args.timeout, args.meet_timeout = args.timeout or 60.0, args.timeout or (300 if by_hand else 60)


def main(argv=None):
    args = parse_args(argv)
    if args.rank is not None:  # one rank per process, its peers perhaps not started yet: say what it waits for
        print(f"Rank {args.rank} waits up to {args.meet_timeout:g} s for all {args.world_size} ranks at "
              f"{args.master_addr}:{args.master_port}", file=sys.stderr)
        return run_rank(args.rank, args)
    if args.master_port is None:  # a free port, held until the run ends by a socket bound to it, never listening:
        (port := socket.socket()).setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (rank 0 can still listen)
        port.bind(("", 0))  # the OS gives it to no one else
        args.master_port = port.getsockname()[1]
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # `kill` stops the ranks as Ctrl-C does
    print(f"Starting {args.world_size} ranks; rank 0 listens on {args.master_addr}:{args.master_port}", flush=True)
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited: a Ctrl-C while a rank starts cannot cut it off
        ranks = mp.start_processes(run_rank, args=(args,), nprocs=args.world_size, join=False, daemon=True)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # (run_rank gives each rank the default action)
        while not ranks.join(grace_period=3):  # when a rank fails, the others have 3 s to say why, then SIGTERM
            pass
    except mp.ProcessExitedException as exc:
        sys.exit(f"Rank {exc.error_index} ({worker_name(exc.error_index, args.world_size)}) ended with "
                 f"{exc.signal_name or f'exit code {exc.exit_code}'}: stopped every rank.")
    except KeyboardInterrupt:
        print("Interrupted: stopping every rank.", file=sys.stderr)
        sys.exit(130)  # the daemonic ranks are terminated as this process exits


if __name__ == "__main__":
    main()
