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
import contextlib
import fcntl
import ipaddress
import json
import multiprocessing.connection
import multiprocessing.forkserver
import multiprocessing.util
import os
import re
import shutil
import signal
import socket
import struct
import sys
import threading
import time
import traceback
import warnings
from datetime import timedelta
from itertools import count

if __name__ == "__main__" and "--debug" not in sys.argv:
    # Before torch loads: its C++ log would repeat each failure as warnings, errors and stack dumps.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
if __name__ == "__mp_main__":  # a rank that _launch_all (below) started, still starting: it has nothing to say yet
    signal.signal(signal.SIGINT, lambda *_: os._exit(130))

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
# TCP (uv) only: the shared-memory transport busy-polls and starves other runs on the machine (README,
# "Sharing a machine"); the choice is a private option until pytorch/pytorch#33982.
RPC_TRANSPORTS = ["uv"]


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
        for _ in range(10000):  # the tutorial's cap, for environments that have no time limit of their own
            # Send state to agent and get action back. The tutorial's agent_rref.rpc_sync().select_action(...)
            # ships the RRef with every call, and its bookkeeping slows each step; a plain RPC to the agent's
            # process reaches the same method.
            action = rpc.rpc_sync(agent_rref.owner(), agent_select_action, args=(self.id, state))
            state, reward, terminated, truncated, _ = self.env.step(action)
            rewards.append(reward)
            if terminated or truncated:
                break
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
            # timeout=0: an episode can outlast --timeout; the peer watch still catches an observer that dies.
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
    print(f"This will run until reward threshold of {agent.reward_threshold} is reached{limit}.")

    solved = False
    start = time.perf_counter()
    for i_episode in count(1):
        agent.run_episode()
        last_reward = agent.finish_episode()

        if i_episode % args.log_interval == 0:
            print(f"Episode {i_episode}\tLast reward: {last_reward:.2f}\tAverage reward: {agent.running_reward:.2f}")

        if agent.running_reward > agent.reward_threshold:
            print(f"Solved! Running reward is now {agent.running_reward}!")
            solved = True
            break
        if i_episode == args.max_episodes:  # the tutorial has no bound; 0 keeps it so
            break
    seconds = time.perf_counter() - start
    print(f"Summary: episodes={i_episode} steps={agent.total_steps} seconds={seconds:.2f} "
          f"us_per_step={seconds / agent.total_steps * 1e6:.0f} solved={str(solved).lower()}")


def run_worker(rank, world_size, args):
    torch.manual_seed(args.seed + rank)
    # The policy is tiny: a second intra-op thread only spins, and competes with the other ranks for the cores.
    torch.set_num_threads(1)
    # The agent answers every select_action on one RPC thread: autograd orders the backward pass by each thread's
    # own node counter, so graphs built on whichever of 16 threads was free sum the gradients in a different order
    # from run to run, and the same --seed drifts apart. Observers keep several: one plays, another answers pings.
    _init_rpc(worker_name(rank, world_size), rank, world_size, args, num_worker_threads=1 if rank == 0 else 16)
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
# What the tutorials leave out: bounded waits, one paragraph per failure, several
# machines, launchers. The same text in all four scripts; each script supplies
# RPC_TRANSPORTS, worker_name(rank, world_size) and run_rank(rank, args) above.


class RankFailure(Exception):
    """A failure explained in words: the message is the whole report."""


def _pick_interface(rank, args):
    """Gloo and TensorPipe advertise the hostname's address (often 127.0.0.1): name the interface instead."""
    names = [name for _, name in socket.if_nameindex()]
    try:
        address = socket.gethostbyname(args.master_addr)
    except OSError as exc:
        raise RankFailure(f"--master_addr {args.master_addr} does not resolve to an address here ({exc.strerror}): "
                          f"fix --master_addr (rank 0's address as this machine sees it).") from exc
    if args.ifname is None and not ipaddress.ip_address(address).is_loopback:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:
                probe.connect((address, args.master_port))  # UDP: picks the route, sends nothing
            except OSError as exc:
                raise RankFailure(f"this machine has no route to --master_addr {args.master_addr} ({exc.strerror}): "
                                  f"fix --master_addr, or name the interface that reaches it with --ifname.") from exc
            local = socket.inet_aton(probe.getsockname()[0])
            for name in names:  # SIOCGIFADDR: the interface that has the route's address
                with contextlib.suppress(OSError):
                    if fcntl.ioctl(probe, 0x8915, struct.pack("256s", name.encode()))[20:24] == local:
                        args.ifname = name
                        print(f"Rank {rank}: using network interface {name} to reach {args.master_addr}")
    if args.ifname is not None and args.ifname not in names:
        raise RankFailure(f"there is no network interface --ifname {args.ifname} here; this machine has {', '.join(names)}.")
    if args.ifname:
        os.environ["GLOO_SOCKET_IFNAME"] = os.environ["NCCL_SOCKET_IFNAME"] = os.environ["TP_SOCKET_IFNAME"] = args.ifname


_watching, _finished, _report_lock = threading.Event(), threading.Event(), threading.Lock()
_states = None  # from the launcher: each rank's 0 (starting), 1 (watching its peers), 2 (reported), 3 (gone)
# Flags that may differ from rank to rank; every other flag must be the same on every rank of a run.
RANK_OWN_FLAGS = {"rank", "master_addr", "ifname", "timeout", "debug", "data_dir", "download", "save_model"}


@contextlib.contextmanager
def _deadline(rank, args, why):
    """Past --timeout, print why() as the report and end the process: for waits torch leaves unbounded."""
    timer = threading.Timer(args.timeout, lambda: _exit_with_report(rank, args, why()))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _init_rpc(name, rank, world_size, args, num_worker_threads=16):
    """rpc.init_rpc, with every wait bounded by --timeout (init_rpc alone: 30 minutes, and days in its group).
    Returns the store the ranks met on."""
    _pick_interface(rank, args)
    where = f"{args.master_addr}:{args.master_port}"
    waiting = f"Rank {rank}: waiting up to {args.timeout:g} s for all {world_size} processes to meet at {where}"
    serve = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"  # torchrun serves its own
    why = (f"waited {args.timeout:g} s for rank 0 at {where}, and no rank 0 answered. Start rank 0 with the same "
           f"--master_addr and --master_port, and check that {where} is reachable and that no other program listens "
           f"there.")
    if not serve:
        print(waiting)  # a client waits from the start; rank 0 only once it listens
    try:
        with _deadline(rank, args, lambda: why):  # the store's own timeouts miss a listener that never answers
            # A client tries to connect twice, each time for the timeout it is given: half of --timeout.
            store = dist.TCPStore(args.master_addr, args.master_port, world_size, serve,
                                  timedelta(seconds=args.timeout / (1 if serve else 2)), wait_for_workers=False,
                                  multi_tenant=True)
            if serve:
                print(waiting)
            store.set_timeout(timedelta(seconds=args.timeout))
            if rank == 0:
                store.set("world_size", str(world_size))
            theirs = int(store.get("world_size"))  # the first answer: a rank 0 is there
            why = (f"waited {args.timeout:g} s for all {world_size} processes to meet at {where}, and not all came. "
                   f"Start ranks 0..{world_size - 1} with the same --world_size, --master_addr and --master_port "
                   f"within --timeout of each other, and check that {where} is reachable.")
            if theirs != world_size or store.add(f"rank{rank}", 1) > 1:
                raise RankFailure(f"the group at {where} is not this run's: its --world_size is {theirs} (this rank's: "
                                  f"{world_size}), or its rank {rank} is taken. Start every rank of a run with the same "
                                  f"--world_size, and give each run its own --master_port.")
            flags = {key: value for key, value in vars(args).items() if key not in RANK_OWN_FLAGS}
            store.set(f"flags{rank}", json.dumps(flags, default=str))
            store.set(f"pid{rank}", str(os.getpid()))  # which process is which rank, for whoever must stop one
            store.wait([f"rank{peer}" for peer in range(world_size)])
            ranks_flags = [json.loads(store.get(f"flags{peer}")) for peer in range(world_size)]
            differ = [f"rank {peer} has --{key} {value}, rank 0 --{key} {ranks_flags[0].get(key)}"
                      for peer, theirs in enumerate(ranks_flags) for key, value in theirs.items()
                      if value != ranks_flags[0].get(key)]
            store.set(f"compared{rank}", "1")
            if differ and serve:  # the store goes with this process: let every rank read the flags first
                store.wait([f"compared{peer}" for peer in range(world_size)])
    except dist.DistError as exc:
        if "address already in use" in str(exc).lower():
            raise RankFailure(f"port {args.master_port} on {args.master_addr} is already in use, so rank 0 cannot "
                              f"listen there: stop what holds it, or give every rank another --master_port.") from exc
        raise RankFailure(why) from exc
    if differ:
        raise RankFailure(f"the ranks were started with different flags: {'; '.join(differ)}. Start every rank with "
                          f"the same flags; only --{', --'.join(sorted(RANK_OWN_FLAGS & vars(args).keys()))} may differ.")
    # init_rpc's rendezvous shares the store above (multi_tenant) and finds every rank already there.
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = args.master_addr, str(args.master_port)
    options = rpc.TensorPipeRpcBackendOptions(init_method="env://", rpc_timeout=args.timeout, _transports=RPC_TRANSPORTS,
                                           num_worker_threads=num_worker_threads)
    why = (f"all {world_size} processes met at {where}, but RPC did not start within {args.timeout:g} s: a rank "
           f"stopped, or a firewall blocks the ports that TensorPipe and Gloo listen on (README, \"Running on several "
           f"machines\").")
    with _deadline(rank, args, lambda: why):  # init_rpc's own group waits about 24 days for a rank that died
        rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=options)

    def watch():  # a rank hears of a dead peer only when it calls it: so call every peer each second
        while not _finished.wait(1.0):
            lost = _lost_peers(rank, world_size, args)
            if lost and not _finished.is_set():
                _exit_with_report(rank, args, lost, shared=True)

    threading.Thread(target=watch, daemon=True).start()
    _watching.set()
    if _states is not None:
        _states[rank] = 1
    return store


def _lost_peers(rank, world_size, args):
    """A report naming every peer that does not answer within --timeout, or None."""
    try:
        pings = {peer: rpc.rpc_async(worker_name(peer, world_size), time.monotonic, timeout=args.timeout)
                 for peer in range(world_size) if peer != rank}
    except RuntimeError:  # RPC has just shut down: the run ended well
        return None
    lost = []
    for peer, ping in pings.items():
        try:
            ping.wait()
        except Exception:
            lost.append(f"rank {peer} ({worker_name(peer, world_size)})")
    return lost and (f"lost contact with {', '.join(lost)}: the process died or its machine became unreachable. "
                     f"Look at that rank's own output for the cause, then start all ranks again.")


def _shutdown(rank, world_size, args):
    """rpc.shutdown() alone would wait forever for a dead peer: wait here, where the peer watch runs."""
    store = dist.TCPStore(args.master_addr, args.master_port, timeout=timedelta(seconds=args.timeout))
    store.set(f"done{rank}", "1")
    while not store.check([f"done{peer}" for peer in range(world_size)]):
        time.sleep(0.1)
    _finished.set()
    _watching.clear()  # an error from here on is this rank's own, not a lost peer
    rpc.shutdown(timeout=args.timeout)
    store.set(f"closed{rank}", "1")
    if rank == 0:  # the store lives in this process, and rpc.shutdown on other ranks may still use it
        store.wait([f"closed{peer}" for peer in range(world_size)])


def _describe(exc):
    """One line for an unexpected exception; for one raised inside an RPC, the remote cause and its rank."""
    try:
        text = str(exc).strip()
    except Exception:
        return type(exc).__name__
    remote = re.search(r"On WorkerInfo\(id=(\d+), name=(.*?)\):\n(.*)", text)
    if remote:  # torch sends the callee's repr(exception) and its traceback: keep the first
        return (f"an RPC that ran on rank {remote[1]} ({remote[2]}) raised {remote[3]}. Its traceback is in rank "
                f"{remote[1]}'s output (torch prints it there).")
    if text:
        return f"{type(exc).__name__}: {text.splitlines()[0]}"
    return type(exc).__name__ + "".join(f" at {f.filename}:{f.lineno}" for f in traceback.extract_tb(exc.__traceback__)[-1:])


def _exit_with_report(rank, args, message, exc=None, code=1, shared=False):
    """Print one paragraph (with --debug, the traceback too), then end the process whatever else happens.
    shared: the peers see the same cause (a lost peer, a Ctrl-C to every process) and will report it too."""
    try:
        _report_lock.acquire()  # one report per process, from whichever thread comes first
        try:  # an unexpected exception most often means that a peer died under it
            lost = not message and _watching.is_set() and _lost_peers(rank, args.world_size, args)
            message, shared = message or lost or _describe(exc), shared or bool(lost)
        except Exception:
            message = message or type(exc).__name__
        if exc is not None and args.debug:
            traceback.print_exception(exc)
        hint = "" if args.debug or code != 1 else "\n(Run with --debug to see the traceback and torch's own log.)"
        print(f"\nError on rank {rank} ({worker_name(rank, args.world_size)}): {message}{hint}", file=sys.stderr)
        sys.stdout.flush(), sys.stderr.flush()
        if not args.debug:  # the paragraph is this rank's last word: torch's threads may still print as peers go
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stderr.fileno())
        # Stay reachable while peers have yet to report the same cause, so that they say what they saw, not
        # that this rank vanished: in a one-command run until each has (the launcher's states tell), else 2 s.
        launched = _states is not None  # shared memory: it outlives a killed launcher
        if launched:
            _states[rank] = 2
        end = time.monotonic() + (10 if launched else 2 if code == 1 and args.world_size > 2 else 0)
        while shared and _watching.is_set() and time.monotonic() < end and (
                not launched or 1 in [state for peer, state in enumerate(_states) if peer != rank]):
            time.sleep(0.05)
    finally:
        os._exit(code)  # rpc's threads cannot be trusted to wind down after a failure


def _run_rank_reporting(rank, args):
    try:
        with warnings.catch_warnings():  # rpc's own use of a gloo Backend as a ProcessGroup: not ours to fix
            warnings.filterwarnings("ignore", message="You are using a Backend .* as a ProcessGroup")
            run_rank(rank, args)
    except KeyboardInterrupt as exc:
        _exit_with_report(rank, args, "interrupted.", exc, code=130, shared=True)
    except RankFailure as exc:
        _exit_with_report(rank, args, str(exc), exc)
    except BaseException as exc:
        _exit_with_report(rank, args, None, exc)


def _rank_main(rank, args, states=None):
    """One rank's process, started by the launcher below or from the command line."""
    global _states
    _states = states
    for stream in (sys.stdout, sys.stderr):  # whole lines, even with PYTHONUNBUFFERED=1: ranks never merge
        stream.reconfigure(line_buffering=True, write_through=False)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the launched rank's quiet start-up handler ends here
    if states is not None:  # stop with the launcher (the kernel's parent-death signal would come from the fork server)
        def stop_with_launcher(launcher=multiprocessing.parent_process().sentinel):
            multiprocessing.connection.wait([launcher])  # its end of the pipe closes when it dies
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

        threading.Thread(target=stop_with_launcher, daemon=True).start()
    # The rank runs in a thread of its own: the main thread then takes Ctrl-C at once, where torch's waits
    # (Future.wait, init_rpc) would hold it until they return.
    worker = threading.Thread(target=_run_rank_reporting, args=(rank, args), daemon=True)
    worker.start()
    try:
        worker.join()
    except KeyboardInterrupt as exc:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # one report: a second signal would cut it short, silently
        # In a rank it launched: did this come because the launcher died? (Its pipe is closed then.)
        parent = multiprocessing.parent_process()
        orphan = parent is not None and bool(multiprocessing.connection.wait([parent.sentinel], 0.5))
        _exit_with_report(rank, args, "the launcher is gone (it was killed), so this rank stops too." if orphan
                          else "interrupted.", exc, code=130, shared=True)


_held = None  # while the launcher starts ranks: the stop signals that came, acted on once every rank has started


def _interrupt(signum, frame):  # Ctrl-C, or `kill`, to the launcher: stop every rank
    for each in (signal.SIGINT, signal.SIGTERM):  # first, so that a second Ctrl-C cannot stop the stopping
        signal.signal(each, signal.SIG_IGN)
    if _held is not None:  # a rank cut off mid-spawn would print multiprocessing's own traceback
        _held.append(signum)
    else:
        raise KeyboardInterrupt(signal.Signals(signum).name)


def _launch_all(args):
    """Every rank in a process of its own, as mp.spawn starts them; when one fails, or on Ctrl-C, all stop."""
    reserved = socket.socket()  # bound until the run ends, never listening: the OS gives its port to no one else
    if args.master_port is None:  # a free port, so that two runs never meet
        reserved.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # rank 0 can still listen on it
        reserved.bind(("", 0))  # every address: held on one only, a listener on another could still be given it
        args.master_port = reserved.getsockname()[1]
    global _held
    _held = []  # a stop signal from here on waits until every rank has started, so that none is left behind
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _interrupt)
    print(f"Starting {args.world_size} ranks; rank 0 listens on {args.master_addr}:{args.master_port}", flush=True)
    # For the ranks only (glibc reads these at start-up): one malloc arena, and large blocks kept rather than
    # returned, cut the parameter server's page faults per batch from 5,393 to 290 and its time by about a quarter.
    for name, value in (("MALLOC_ARENA_MAX", "1"), ("MALLOC_MMAP_THRESHOLD_", "33554432"),
                        ("MALLOC_TRIM_THRESHOLD_", "268435456")):
        os.environ.setdefault(name, value)
    # The ranks fork from one server that imports this script, and so torch, once; it never touches CUDA.
    # It starts in the current folder and ignores this process's sys.path: PYTHONPATH tells it where the script is.
    here = os.path.dirname(os.path.abspath(__file__))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
    context = mp.get_context("forkserver")
    context.set_forkserver_preload([os.path.splitext(os.path.basename(__file__))[0]])
    states, ranks, failure, code = context.Array("b", args.world_size, lock=False), [], None, 0
    hold = ()  # the states of the ranks that the launcher waits for before it stops them
    try:
        ranks = mp.start_processes(_rank_main, args=(args, states), nprocs=args.world_size, join=False,
                                   start_method="forkserver").processes
        held, _held = _held, None
        if held:
            raise KeyboardInterrupt(signal.Signals(held[0]).name)
        left = {rank.sentinel: index for index, rank in enumerate(ranks)}
        while left and failure is None:
            for sentinel in multiprocessing.connection.wait(list(left)):
                index = left.pop(sentinel)
                ranks[index].join()  # the sentinel can be ready a moment before the exit status is
                exit_code, states[index] = ranks[index].exitcode, 3  # 3: gone, so no rank waits for its report
                if exit_code and failure is None:
                    how = signal.Signals(-exit_code).name if exit_code < 0 else f"exit code {exit_code}"
                    failure = f"Rank {index} ({worker_name(index, args.world_size)}) ended with {how}: stopped every rank."
                    # Ranks that watch their peers report the loss within seconds; the others have nothing to say.
                    code, hold = 1, (1,)
    except KeyboardInterrupt as exc:
        print("Interrupted: stopping every rank.", file=sys.stderr)
        code = 130
        if exc.args == ("SIGINT",):  # Ctrl-C reached the ranks too: let each say so
            hold = (0, 1)
    finally:
        _held = None
        for signum in (signal.SIGINT, signal.SIGTERM):  # nor a Ctrl-C after a failure
            signal.signal(signum, signal.SIG_IGN)
        end = time.monotonic() + 10
        while any(rank.is_alive() and states[i] in hold for i, rank in enumerate(ranks)) and time.monotonic() < end:
            time.sleep(0.05)
        children = multiprocessing.active_children()
        for stop in ("terminate", "kill"):  # all at once, not one after another
            end = time.monotonic() + 3
            for child in children:
                if child.is_alive():
                    getattr(child, stop)()
            for child in children:
                child.join(max(0.0, end - time.monotonic()))
    reserved.close()
    # Every rank is gone: end the fork server at once, or it would spend about 0.5 s of CPU unloading torch only to
    # exit. (Python offers no public handle on it.) The script ends with os._exit, which skips multiprocessing's
    # clean-up: remove its folder, which holds the fork server's socket.
    server = getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)
    if server:
        with contextlib.suppress(ProcessLookupError):
            os.kill(server, signal.SIGTERM)  # it keeps the default action: end without clean-up
    shutil.rmtree(multiprocessing.util.get_temp_dir(), ignore_errors=True)
    if failure:
        print(failure, file=sys.stderr)
    return code


# --------- Command line --------------------


def _positive(cast):
    def positive(text):  # an argparse type: a number above zero
        if cast(text) <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return cast(text)
    return positive


def _add_common_flags(parser, world_size):
    """The command line that all four scripts share (README, "Running the scripts")."""
    parser.usage = "%(prog)s [flags]   (--help lists them)"  # a bad flag: two lines, not the whole synopsis
    parser.epilog = ("One terminal per rank: start every rank with the same flags; only --rank, --master_addr, "
                     "--ifname, --timeout and --debug (and --data_dir, --download, --save_model where a script has "
                     "them) may differ. Ranks whose flags differ stop with an error naming them.")
    parser.add_argument("--world_size", "--world-size", type=int, default=world_size,
                        help="Processes in the RPC group, all roles counted.")
    parser.add_argument("--rank", type=int, default=None,
                        help="Run only this rank (a terminal or machine each). None: start every rank here.")
    parser.add_argument("--master_addr", default="localhost", help="Address of rank 0.")
    parser.add_argument("--master_port", type=int, default=None,
                        help="Port of rank 0. None: 29500 with --rank, else a free one.")
    parser.add_argument("--ifname", default=None,
                        help="Network interface for runs across machines. None: the one that reaches --master_addr.")
    parser.add_argument("--timeout", type=_positive(float), default=60.0, help="Longest wait for a peer or an RPC, in seconds.")
    parser.add_argument("--debug", action="store_true", help="On a failure, show the traceback and torch's own log.")


def _check_common_args(parser, args, min_world_size, roles):
    """Exit 2 with one line for a bad common flag; without --rank, take torchrun's RANK etc."""
    if args.rank is None and "RANK" in os.environ:
        args.rank, args.world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        args.master_addr, args.master_port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if args.world_size < min_world_size:
        parser.error(f"--world_size must be at least {min_world_size} ({roles}), got {args.world_size}")
    if args.rank is not None and not 0 <= args.rank < args.world_size:
        parser.error(f"--rank must be in [0, {args.world_size}) for --world_size {args.world_size}, got {args.rank}")
    if args.master_port is not None and not 0 < args.master_port < 65536:
        parser.error(f"--master_port must be in 1..65535, got {args.master_port}")
    if args.rank is not None and args.master_port is None:
        args.master_port = 29500


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="RPC Reinforcement Learning Example",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,  # a mistyped flag fails instead of matching a longer one
    )
    _add_common_flags(parser, world_size=2)
    parser.add_argument("--log_interval", type=_positive(int), default=10, metavar="N", help="Episodes between status lines.")
    parser.add_argument("--gamma", type=float, default=0.99, metavar="G", help="How much to value future rewards.")
    parser.add_argument("--seed", type=int, default=1, metavar="S", help="Random seed (policy, actions, environments).")
    parser.add_argument("--lr", type=_positive(float), default=1e-2, help="Learning rate of Adam.")
    parser.add_argument("--max_episodes", type=int, default=0, metavar="N",
                        help="Stop after N episodes even if not solved (0: run until solved, as the tutorial).")
    args = parser.parse_args(argv)
    _check_common_args(parser, args, min_world_size=2, roles="one agent and at least one observer")
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
    code = main()
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(code)  # all is done: skip the interpreter's teardown of torch (about 0.7 s of CPU)
