"""The tutorial "Implementing Batch RPC Processing Using Asynchronous Executions", part 2
(https://pytorch.org/tutorials/intermediate/rpc_async_execution.html): observers (ranks 1 to N-1)
play CartPole-v1; the agent (rank 0) picks their actions in batches.

    python rpc_batch_cartpole.py --world_size=5 [--no-batch]  # every rank; or one terminal each
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

if __name__ == "__main__" and "--debug" not in sys.argv:  # torch reads it as it loads
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")

import gymnasium as gym  # the tutorial's gym is no longer maintained
import torch
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.distributed.rpc import RRef
from torch.distributions import Categorical

NUM_STEPS = 500
AGENT_NAME = "agent"
OBSERVER_NAME = "observer{}"


class Policy(nn.Module):
    def __init__(self, batch=True):
        super().__init__()
        self.affine1 = nn.Linear(4, 128)
        self.dropout = nn.Dropout(p=0.6)
        self.affine2 = nn.Linear(128, 2)
        self.dim = 2 if batch else 1

    def forward(self, x):
        x = self.affine1(x)
        x = self.dropout(x)
        x = F.relu(x)
        action_scores = self.affine2(x)
        return F.softmax(action_scores, dim=self.dim)


class Observer:
    def __init__(self, batch=True, gamma=1.0, seed=543):  # the tutorial's global args
        self.id = rpc.get_worker_info().id - 1
        self.env = gym.make("CartPole-v1")
        # + id: the tutorial's env.seed(args.seed) gives all observers the same first states.
        self.env.reset(seed=seed + self.id)
        self.gamma = gamma
        self.select_action = Agent.select_action_batch if batch else Agent.select_action

    def run_episode(self, agent_rref, n_steps):
        # gymnasium: reset returns (state, info), step five values
        (state, _), ep_reward = self.env.reset(), NUM_STEPS
        rewards = torch.zeros(n_steps)
        start_step = 0
        for step in range(n_steps):
            state = torch.from_numpy(state).float().unsqueeze(0)
            # send the state to the agent to get an action
            action = rpc.rpc_sync(agent_rref.owner(), self.select_action,
                                  args=(agent_rref, self.id, state))

            # apply the action to the environment, and get the reward
            state, reward, terminated, truncated, _ = self.env.step(action)
            rewards[step] = reward

            if terminated or truncated or step + 1 >= n_steps:
                curr_rewards = rewards[start_step:(step + 1)]
                R = 0
                for i in range(curr_rewards.numel() - 1, -1, -1):
                    R = curr_rewards[i] + self.gamma * R
                    curr_rewards[i] = R
                state, _ = self.env.reset()
                if start_step == 0:
                    ep_reward = min(ep_reward, step - start_step + 1)
                start_step = step + 1

        return [rewards, ep_reward]


class Agent:
    # gamma, seed: the tutorial's global args, passed on to each Observer.
    def __init__(self, world_size, batch=True, gamma=1.0, seed=543):
        self.ob_rrefs = []
        self.agent_rref = RRef(self)
        self.rewards = {}
        # The tutorial's .cuda() needs a GPU.
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.policy = Policy(batch).to(self.device)
        self.optimizer = optim.Adam(self.policy.parameters(), lr=1e-2)
        self.running_reward = 0

        for ob_rank in range(1, world_size):
            ob_info = rpc.get_worker_info(OBSERVER_NAME.format(ob_rank))
            self.ob_rrefs.append(rpc.remote(ob_info, Observer, args=(batch, gamma, seed)))
            self.rewards[ob_info.id] = []

        self.states = torch.zeros(len(self.ob_rrefs), 1, 4)
        self.batch = batch
        self.saved_log_probs = [] if self.batch else {k: [] for k in range(len(self.ob_rrefs))}
        self.future_actions = torch.futures.Future()
        self.lock = threading.Lock()
        self.pending_states = len(self.ob_rrefs)

    @staticmethod
    def select_action(agent_rref, ob_id, state):
        self = agent_rref.local_value()
        probs = self.policy(state.to(self.device))
        m = Categorical(probs)
        action = m.sample()
        self.saved_log_probs[ob_id].append(m.log_prob(action))
        return action.item()

    @staticmethod
    @rpc.functions.async_execution
    def select_action_batch(agent_rref, ob_id, state):
        self = agent_rref.local_value()
        self.states[ob_id].copy_(state)
        future_action = self.future_actions.then(
            lambda future_actions: future_actions.wait()[ob_id].item()
        )

        with self.lock:
            self.pending_states -= 1
            if self.pending_states == 0:
                self.pending_states = len(self.ob_rrefs)
                # A copy (.cuda() made one): the next copy_ would change the input autograd saved
                probs = self.policy(self.states.to(self.device, copy=True))
                m = Categorical(probs)
                actions = m.sample()
                self.saved_log_probs.append(m.log_prob(actions).t()[0])
                future_actions = self.future_actions
                self.future_actions = torch.futures.Future()
                future_actions.set_result(actions.cpu())
        return future_action

    def run_episode(self, n_steps=0):
        futs = []
        for ob_rref in self.ob_rrefs:
            # make async RPC to kick off an episode on all observers
            futs.append(ob_rref.rpc_async().run_episode(self.agent_rref, n_steps))

        # wait until all obervers have finished this episode
        rets = torch.futures.wait_all(futs)
        rewards = torch.stack([ret[0] for ret in rets]).to(self.device).t()
        ep_rewards = sum([ret[1] for ret in rets]) / len(rets)

        # stack saved probs into one tensor
        if self.batch:
            probs = torch.stack(self.saved_log_probs)
        else:
            probs = [torch.stack(self.saved_log_probs[i]) for i in range(len(rets))]
            # Steps by observers: the tutorial's stack weighs each action by all observers' returns
            probs = torch.cat(probs, dim=1)

        policy_loss = -probs * rewards / len(rets)
        policy_loss.sum().backward()
        self.optimizer.step()
        self.optimizer.zero_grad()

        # reset variables
        self.saved_log_probs = [] if self.batch else {k: [] for k in range(len(self.ob_rrefs))}
        self.states = torch.zeros(len(self.ob_rrefs), 1, 4)

        # calculate running rewards
        self.running_reward = 0.5 * ep_rewards + 0.5 * self.running_reward
        return ep_rewards, self.running_reward


# The tutorial's run_worker(rank, world_size, n_episode, batch, print_log), with the flags in args
# and always printing, as its main() runs it. Its main() times world sizes 2 to 11, batch and not
# (benchmarks/bench_batch_cartpole.py: 2 to 9).
def run_worker(rank, world_size, args):
    torch.set_num_threads(1)  # not in the tutorial: tiny ops, more threads only spin
    options = backend_options(args, num_worker_threads=args.agent_threads if rank == 0 else 16)
    with meeting(rank, args):
        rpc.init_rpc(worker_name(rank, world_size), rank=rank, world_size=world_size,
                     rpc_backend_options=options)
    if rank == 0:
        # rank0 is the agent
        # --seed: 1 by default, as in every script here; 543, the tutorial's, is the classes' own.
        agent = Agent(world_size, args.batch, gamma=args.gamma, seed=args.seed)
        start = time.perf_counter()
        for i_episode in range(args.num_episode):
            last_reward, running_reward = agent.run_episode(n_steps=args.n_steps)
            print('Episode {}\tLast reward: {:.2f}\tAverage reward: {:.2f}'.format(
                i_episode, last_reward, running_reward))
        seconds = time.perf_counter() - start  # not in the tutorial: for people and scripts
        steps = args.n_steps * (world_size - 1) * args.num_episode  # observer-steps
        print(f"Summary: episodes={args.num_episode} steps={steps} seconds={seconds:.2f} "
              f"us_per_step={seconds / steps * 1e6:.0f} batch={str(args.batch).lower()}")
    # else: observers passively waiting for instructions from agents
    say_done(rank, args)  # not in the tutorial: rank 0 watches until all are done
    rpc.shutdown()


def worker_name(rank, world_size):
    return AGENT_NAME if rank == 0 else OBSERVER_NAME.format(rank)


def parse_args(argv=None):  # the tutorial parses at import
    parser = argparse.ArgumentParser(
        description="PyTorch RPC Batch RL example",
        epilog="Rank 0 is the agent, every other rank an observer.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)
    add = parser.add_argument
    add("--gamma", type=in_range(float, 0, 1), default=1.0, help="Discount factor.")
    add("--num_episode", "--num-episode", type=in_range(int, 1), default=10, help="Episodes.")
    # Flags for the tutorial's NUM_STEPS, and for batch, which its main() runs both ways.
    add("--n_steps", type=in_range(int, 1), default=NUM_STEPS,
        help="Steps per observer and episode.")
    add("--batch", action=argparse.BooleanOptionalAction, default=True,
        help="One policy run for all observers' states (--no-batch: one per state).")
    # Autograd sums gradients in an order that follows the threads that built the graph.
    add("--agent_threads", type=in_range(int, 1), default=1,
        help="The agent's RPC threads: 1 repeats a --seed, the tutorial has torch's 16.")
    return parse_common(parser, argv, world_size=2, least=2)  # an agent and an observer


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
