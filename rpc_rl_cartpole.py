"""Distributed reinforcement learning with PyTorch's RPC framework and RRef.

One agent (rank 0) owns the policy and its optimizer; every other rank is an
observer that owns a CartPole-v1 environment. The agent starts an episode on
every observer at once; each observer asks the agent for every action, and
after the episode the agent updates the policy with REINFORCE over all the
observers' trajectories.

One command starts every rank:       python rpc_rl_cartpole.py --world_size=3
One terminal per rank (tutorial):    python rpc_rl_cartpole.py --world_size=2 --rank=0
                                     python rpc_rl_cartpole.py --world_size=2 --rank=1
"""
import argparse
import ipaddress
import os
import signal
import socket
import sys
import threading
import time
import traceback
import warnings
from datetime import timedelta
from itertools import count

import gymnasium as gym
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
ENV_NAME = "CartPole-v1"
# Every environment step waits for one RPC round trip, so latency rules here:
# TensorPipe's default (shared memory between processes of one machine, TCP
# between machines) answered in about 0.6-1.3 ms on this 2-core machine, TCP
# alone in 1.3-4.8 ms. The other examples use TCP alone: shared memory's
# reactor busy-polls a core in each process.
RPC_TRANSPORTS = None


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
    def __init__(self, seed):
        self.id = rpc.get_worker_info().id
        self.env = gym.make(ENV_NAME)
        # The tutorial seeds every observer alike (old gym's env.seed), so all
        # play the same episode; gymnasium seeds at the first reset, by rank.
        self.seed = seed + self.id

    def run_episode(self, agent_rref):
        # gymnasium: reset returns (state, info) and takes the seed; step
        # returns five values and an episode ends when terminated or truncated.
        state, _ = self.env.reset(seed=self.seed)
        self.seed = None  # seed once; later episodes continue the seeded stream
        rewards = []
        done = False
        while not done:
            # Send state to agent and get action back. The tutorial calls
            # agent_rref.rpc_sync().select_action(...), an RRef proxy call: it
            # ships the RRef along every time, and the RRef protocol's
            # bookkeeping for that cost ~0.3 ms of a ~0.8 ms round trip here. A
            # plain RPC to the agent's process reaches the same method; whole
            # runs took ~30% less time per step (benchmarks/bench_rl_cartpole.py).
            action = rpc.rpc_sync(agent_rref.owner(), agent_select_action, args=(self.id, state))
            state, reward, terminated, truncated, _ = self.env.step(action)
            rewards.append(reward)
            done = terminated or truncated
        # Report rewards to agent for training. The tutorial sends each reward
        # in its own RPC, two round trips per step; the agent only uses them
        # after the episode, so one RPC at its end carries them all.
        agent_rref.rpc_sync().report_reward(self.id, rewards)


# --------- Agent --------------------

# The Agent in this process, for the observers' per-step RPCs (see
# Observer.run_episode for why these do not go through agent_rref).
local_agent = None


def agent_select_action(ob_id, state):
    return local_agent.select_action(ob_id, state)


class Agent:
    def __init__(self, world_size, gamma=0.99, lr=1e-2, seed=1):
        self.ob_rrefs = []
        self.agent_rref = RRef(self)
        global local_agent
        local_agent = self
        self.rewards = {}
        self.saved_log_probs = {}
        self.policy = Policy()
        self.optimizer = optim.Adam(self.policy.parameters(), lr=lr)
        self.gamma = gamma
        self.eps = torch.finfo(torch.float32).eps
        self.running_reward = 0
        self.reward_threshold = gym.spec(ENV_NAME).reward_threshold
        self.total_steps = 0

        # Initialize remote observers
        for ob_rank in range(1, world_size):
            ob_info = rpc.get_worker_info(OBSERVER_NAME.format(ob_rank))
            self.ob_rrefs.append(remote(ob_info, Observer, args=(seed,)))
            self.rewards[ob_info.id] = []
            self.saved_log_probs[ob_info.id] = []

    def select_action(self, ob_id, state):
        state = torch.from_numpy(state).float().unsqueeze(0)
        probs = self.policy(state)
        m = Categorical(probs)
        action = m.sample()
        self.saved_log_probs[ob_id].append(m.log_prob(action))
        return action.item()

    def report_reward(self, ob_id, rewards):
        self.rewards[ob_id].extend(rewards)

    def run_episode(self):
        futs = []
        for ob_rref in self.ob_rrefs:
            # Kick off episodes on all observers asynchronously. (The tutorial
            # hands ob_rref.rpc_sync().run_episode, a blocking proxy call, to
            # rpc_async; ob_rref.rpc_async() is the asynchronous form itself.)
            # timeout=0: no limit, as an episode lasts as long as the pole
            # stands, and with many observers on few cores that can exceed
            # --timeout; an observer that dies is still caught by the peer watch.
            futs.append(ob_rref.rpc_async(timeout=0).run_episode(self.agent_rref))

        # Wait for all episodes to complete
        for fut in futs:
            fut.wait()

    def finish_episode(self):
        # Combine data from all observers
        probs, returns = [], []
        for ob_id in self.rewards:
            probs.extend(self.saved_log_probs[ob_id])
            # Discount within each observer's own trajectory: the tutorial
            # runs one discount over all trajectories joined end to end, so
            # one observer's rewards leaked into another's returns.
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
        returns = torch.tensor(returns)
        returns = (returns - returns.mean()) / (returns.std() + self.eps)
        policy_loss = []
        for log_prob, R in zip(probs, returns):
            policy_loss.append(-log_prob * R)

        # Update policy
        self.optimizer.zero_grad()
        policy_loss = torch.cat(policy_loss).sum()
        policy_loss.backward()
        self.optimizer.step()

        return min_reward


# --------- Launch Distributed Workers --------------------


def run_agent(world_size, args):
    agent = Agent(world_size, args.gamma, args.lr, args.seed)
    limit = f" (or for at most {args.max_episodes} episodes)" if args.max_episodes else ""
    print(f"This will run until reward threshold of {agent.reward_threshold} is reached{limit}.", flush=True)

    solved = False
    start = time.perf_counter()
    for i_episode in count(1):
        agent.run_episode()
        last_reward = agent.finish_episode()

        if i_episode % args.log_interval == 0:
            print(f"Episode {i_episode}\tLast reward: {last_reward:.2f}\tAverage reward: {agent.running_reward:.2f}",
                  flush=True)

        if agent.running_reward > agent.reward_threshold:
            print(f"Solved! Running reward is now {agent.running_reward}!", flush=True)
            solved = True
            break
        if i_episode == args.max_episodes:  # the tutorial has no bound; 0 keeps it so
            break
    seconds = time.perf_counter() - start
    print(f"Summary: episodes={i_episode} steps={agent.total_steps} seconds={seconds:.2f} "
          f"us_per_step={seconds / agent.total_steps * 1e6:.0f} solved={str(solved).lower()}", flush=True)


def run_worker(rank, world_size, args):
    torch.manual_seed(args.seed + rank)
    _init_rpc(worker_name(rank, world_size), rank, world_size, args)
    if rank == 0:
        # Rank 0 is the agent
        run_agent(world_size, args)
    # Other ranks are observers: they wait passively for the agent's calls
    _shutdown(rank, world_size, args)


# --------- Roles by rank --------------------


def worker_name(rank, world_size):
    return AGENT_NAME if rank == 0 else OBSERVER_NAME.format(rank)


def run_rank(rank, args):
    """What one process does: rank 0 is the agent, the others observe."""
    run_worker(rank, args.world_size, args)


# --------- Starting, watching and stopping ranks --------------------
# Plumbing the tutorial leaves out: bounded waits, clean failures, several
# machines and launchers. This section is the same, to the letter, in all four
# example scripts (tests/test_plumbing.py checks); each script supplies
# RPC_TRANSPORTS, worker_name(rank, world_size) and run_rank(rank, args) above.


class RankFailure(Exception):
    """A failure explained in words; the message is the whole report."""


def _loopback(addr):
    try:
        return ipaddress.ip_address(socket.gethostbyname(addr)).is_loopback
    except OSError:
        return False


def _interface_towards(addr, port):
    """Name and address of the local interface that routes to addr (Linux)."""
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((addr, int(port)))  # UDP: picks a route, sends nothing
        local_ip = probe.getsockname()[0]
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
            except OSError:
                continue
            if socket.inet_ntoa(packed[20:24]) == local_ip:
                return name, local_ip
    return None, local_ip


def _set_rendezvous_env(rank, args):
    os.environ["MASTER_ADDR"] = args.master_addr
    os.environ["MASTER_PORT"] = str(args.master_port)
    ifname = args.ifname
    if ifname is None and not _loopback(args.master_addr):
        # Gloo and TensorPipe otherwise advertise whatever the hostname
        # resolves to, often 127.0.0.1 on cloud images, and peers on other
        # machines then fail to connect ("connectFullMesh failed").
        try:
            ifname, local_ip = _interface_towards(args.master_addr, args.master_port)
        except OSError as exc:
            raise RankFailure(f"cannot reach --master_addr {args.master_addr} from this machine ({exc}).")
        if ifname:
            print(f"Rank {rank}: using network interface {ifname} ({local_ip}) to reach {args.master_addr}")
    if ifname:
        os.environ["GLOO_SOCKET_IFNAME"] = ifname
        os.environ["TP_SOCKET_IFNAME"] = ifname


def _init_rpc(name, rank, world_size, args):
    # rpc.init_rpc's rendezvous waits 30 minutes for missing peers; a watchdog
    # bounds it by --timeout instead.
    where = f"{args.master_addr}:{args.master_port}"
    watchdog = threading.Timer(
        args.timeout,
        _exit_with_report,
        args=(rank, world_size, f"waited {args.timeout:g} s for all {world_size} processes of the RPC group to meet at {where}, "
                    f"and not all arrived. Start every rank with the same --world_size, --master_addr and "
                    f"--master_port (ranks 0..{world_size - 1}), check that {where} is reachable, or raise --timeout."),
    )
    watchdog.daemon = True
    watchdog.start()
    options = rpc.TensorPipeRpcBackendOptions(
        init_method="env://",
        rpc_timeout=args.timeout,
        _transports=RPC_TRANSPORTS,  # chosen per script, with the reason, at its top
    )
    try:
        rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=options)
    except Exception as exc:
        if "EADDRINUSE" in str(exc) or "address already in use" in str(exc).lower():
            raise RankFailure(
                f"port {args.master_port} on {args.master_addr} is already in use, so rank 0 cannot listen "
                f"there. Another run (or another program) holds it: stop it, or pick a free port with "
                f"--master_port for every rank."
            ) from exc
        if "connectFullMesh" in str(exc):
            raise RankFailure(
                f"the processes met at {where} but could not connect to each other ({str(exc).splitlines()[0]}). "
                f"On several machines, pass --ifname with the interface that reaches the others, and let TCP "
                f"through the firewalls between them."
            ) from exc
        raise
    finally:
        watchdog.cancel()
    _start_peer_watch(rank, world_size, args)


_peer_watch_stop = threading.Event()
_DONE_KEY = "rpc_example_done/{}"


def _store(args):
    return dist.TCPStore(args.master_addr, args.master_port, is_master=False, timeout=timedelta(seconds=args.timeout))


def _lost_peers(rank, world_size, args, store):
    """Peers that do not answer an RPC while the group is still at work."""
    lost = []
    for peer in range(world_size):
        if peer == rank:
            continue
        try:
            rpc.rpc_sync(worker_name(peer, world_size), time.time, timeout=args.timeout)
        except Exception:
            lost.append(peer)
    if lost:
        # Once every rank has said it is done (in _shutdown), a peer that is
        # gone has simply finished. Not before: ranks that only serve others
        # say so as soon as they start, and can still die mid-run.
        try:
            if store.check([_DONE_KEY.format(peer) for peer in range(world_size)]):
                return []
        except Exception:  # the store lives in rank 0: no answer means rank 0 is gone
            pass
    return lost


def _start_peer_watch(rank, world_size, args):
    # A rank only notices a dead peer when it next sends it an RPC; a rank
    # that waits for others (as in rpc.shutdown) would wait forever. So every
    # rank pings its peers once a second until all are done.
    store = _store(args)

    def watch():
        while not _peer_watch_stop.wait(1.0):
            lost = _lost_peers(rank, world_size, args, store)
            if lost and not _peer_watch_stop.is_set():
                _exit_with_report(rank, world_size, _lost_message(lost, world_size))

    threading.Thread(target=watch, name="peer-watch", daemon=True).start()


def _lost_message(lost, world_size):
    names = ", ".join(f"rank {peer} ({worker_name(peer, world_size)})" for peer in lost)
    return (f"lost contact with {names}: the process died or its machine became unreachable. "
            f"Look at that rank's own output for the cause, then start all ranks again.")


def _shutdown(rank, world_size, args):
    """Wait until every rank is done, then leave the RPC group."""
    # The tutorials call rpc.shutdown() alone; its barrier waits forever for
    # a peer that died. This waits for the same thing while the peer watch
    # runs, and only then lets rpc.shutdown() (now quick) run.
    store = _store(args)
    store.set(_DONE_KEY.format(rank), "1")
    keys = [_DONE_KEY.format(peer) for peer in range(world_size)]
    while not store.check(keys):
        time.sleep(0.2)
    _peer_watch_stop.set()
    rpc.shutdown(timeout=args.timeout)


def _exit_with_report(rank, world_size, message, exc=None):
    """Print one short paragraph (and the traceback with --debug) and end the process."""
    if exc is not None and os.environ.get("RPC_EXAMPLE_DEBUG"):
        traceback.print_exception(exc)
    print(f"\nError on rank {rank} ({worker_name(rank, world_size)}): {message}\n"
          f"(Pass --debug or set RPC_EXAMPLE_DEBUG=1 to see the Python traceback.)", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)  # rpc and its threads cannot be trusted to wind down after a failure


def _quiet_known_warnings():
    """Hide two known-harmless warnings that torch.distributed prints on every run."""
    # rpc's own internal use of a gloo Backend object:
    warnings.filterwarnings("ignore", message=r"You are using a Backend .* as a ProcessGroup")
    # DistributedOptimizer still runs on the deprecated TorchScript functional
    # optimizers, and torch forces that warning on with simplefilter("always"),
    # so no filter reaches it: drop it where it is shown.
    show = warnings.showwarning

    def showwarning(message, *args, **kwargs):
        if "`TorchScript` support for functional optimizers is deprecated" not in str(message):
            show(message, *args, **kwargs)

    warnings.showwarning = showwarning


def _rank_main(rank, args, parent_pid=None):
    """Entry point of one rank's process, from the launcher or the command line."""
    if args.debug:
        os.environ["RPC_EXAMPLE_DEBUG"] = "1"
    _quiet_known_warnings()
    if parent_pid is not None:
        # A launcher killed with SIGKILL cannot stop its ranks; they stop themselves.
        def exit_with_parent():
            while os.getppid() == parent_pid:
                time.sleep(1)
            os._exit(1)

        threading.Thread(target=exit_with_parent, daemon=True).start()
    try:
        _set_rendezvous_env(rank, args)
        run_rank(rank, args)
    except KeyboardInterrupt:
        print(f"Rank {rank}: interrupted.", file=sys.stderr, flush=True)
        os._exit(130)
    except RankFailure as exc:
        _exit_with_report(rank, args.world_size, str(exc), exc)
    except Exception as exc:
        lost = _lost_peers(rank, args.world_size, args, _store(args)) if rpc.api._is_current_rpc_agent_set() else []
        message = _lost_message(lost, args.world_size) if lost else f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}"
        _exit_with_report(rank, args.world_size, message, exc)


def _launch_all(args):
    """Start every rank as a child process; if one fails or we are stopped, stop them all."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank_main, args=(rank, args, os.getpid()), name=worker_name(rank, args.world_size))
             for rank in range(args.world_size)]

    def stop_on_sigterm(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop_on_sigterm)
    for proc in procs:
        proc.start()
    try:
        while any(p.exitcode is None for p in procs) and not any(p.exitcode for p in procs):
            time.sleep(0.2)
        failed = next((p for p in procs if p.exitcode), None)
        if failed is None:
            return 0
        # Give the others a moment to report what they saw, then stop them.
        deadline = time.monotonic() + 3
        while any(p.exitcode is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.2)
        print(f"{failed.name} failed (exit code {failed.exitcode}); stopping every rank.", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("Interrupted: stopping every rank.", file=sys.stderr)
        return 130
    finally:
        for proc in procs:
            if proc.exitcode is None:
                proc.terminate()
        for proc in procs:
            proc.join(3)
            if proc.exitcode is None:
                proc.kill()
                proc.join()


def _add_common_flags(parser, world_size):
    """The command line that all four example scripts share (CONVENTIONS.md)."""
    parser.add_argument("--world_size", "--world-size", type=int, default=world_size,
                        help="Total number of participating processes, all roles counted.")
    parser.add_argument("--rank", type=int, default=None,
                        help="Run only this rank (one terminal or machine each). Without it, every rank is started here.")
    parser.add_argument("--master_addr", "--master-addr", default="localhost", help="Address of rank 0.")
    parser.add_argument("--master_port", "--master-port", type=int, default=29500, help="Port rank 0 listens on.")
    parser.add_argument("--ifname", default=None,
                        help="Network interface for multi-machine runs; None: the one that reaches --master_addr.")
    parser.add_argument("--timeout", type=float, default=60.0, help="Longest wait, in seconds, for a peer or an RPC.")
    parser.add_argument("--debug", action="store_true", help="Show the Python traceback of a failure.")


def _check_common_args(parser, args, min_world_size, roles):
    """Exit 2 with one line for a bad common flag; take torchrun's RANK etc. when --rank is absent."""
    if args.rank is None and "RANK" in os.environ:  # started by torchrun or a similar launcher
        args.rank = int(os.environ["RANK"])
        args.world_size = int(os.environ.get("WORLD_SIZE", args.world_size))
        args.master_addr = os.environ.get("MASTER_ADDR", args.master_addr)
        args.master_port = int(os.environ.get("MASTER_PORT", args.master_port))
    if args.world_size < min_world_size:
        parser.error(f"--world_size must be at least {min_world_size} ({roles}), got {args.world_size}")
    if args.rank is not None and not 0 <= args.rank < args.world_size:
        parser.error(f"--rank must be in [0, {args.world_size}) for --world_size {args.world_size}, got {args.rank}")
    if not 0 < args.master_port < 65536:
        parser.error(f"--master_port must be in 1..65535, got {args.master_port}")
    if args.timeout <= 0:
        parser.error(f"--timeout must be positive, got {args.timeout}")


# --------- Command line --------------------


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="RPC Reinforcement Learning Example",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _add_common_flags(parser, world_size=2)
    parser.add_argument("--log_interval", type=int, default=10, metavar="N", help="Episodes between status lines.")
    parser.add_argument("--gamma", type=float, default=0.99, metavar="G", help="How much to value future rewards.")
    parser.add_argument("--seed", type=int, default=1, metavar="S", help="Random seed (policy, actions, environments).")
    parser.add_argument("--lr", type=float, default=1e-2, help="Learning rate of Adam.")
    parser.add_argument("--max_episodes", type=int, default=0, metavar="N",
                        help="Stop after N episodes even if not solved (0: run until solved, as the tutorial).")
    args = parser.parse_args(argv)
    _check_common_args(parser, args, min_world_size=2, roles="one agent and at least one observer")
    for flag in ("log_interval", "lr"):
        if getattr(args, flag) <= 0:
            parser.error(f"--{flag} must be positive, got {getattr(args, flag)}")
    if not 0 < args.gamma <= 1:
        parser.error(f"--gamma must be in (0, 1], got {args.gamma}")
    if args.max_episodes < 0:
        parser.error(f"--max_episodes must be 0 (until solved) or positive, got {args.max_episodes}")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.rank is not None:
        _rank_main(args.rank, args)
        return 0
    return _launch_all(args)


if __name__ == "__main__":
    sys.exit(main())
