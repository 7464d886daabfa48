"""Several machines: a machine that vanishes, ranks that a person starts one by one, ranks
that are not of one run, and torchrun across two machines. The machines are two network namespaces
(conftest's two_hosts); their tests skip, saying why, where namespaces cannot be made. The ranks started by hand
and the mismatched ones are among conftest's shared runs.

Time limits here tell "bounded" from "hangs" only, each far above the slowest seen on two shared cores."""
import re
import subprocess
import time

import pytest

from conftest import (Run, assert_no_traceback, free_port, stop_all, tiny_mnist_flags, two_gpus, two_hosts,
                      wait_all)

TIMEOUT = 10  # --timeout of the runs whose machine vanishes: how long a rank waits for an answer
# Every process is gone within VANISHED of the link going down (seen while the whole suite ran: 10.3 s; beside a
# second copy of it: 11.3 s).
VANISHED = 3 * (TIMEOUT + 5)
HANG = 240  # a run's own limit: only keeps a hang from running forever


def error_lines(proc):
    return re.findall(r"^Error on rank .*$", proc.err, re.M)


def one_error_line(proc):
    """Exit status 1, exactly one error line, which it returns, and no traceback but torch's own report of
    an exception raised inside an RPC that ran here (CartPole's episode, DDP's training)."""
    assert proc.returncode == 1, proc
    assert_no_traceback(re.sub(r"(?ms)^On WorkerInfo\(.*?^Traceback .*?^\S.*?$", "", proc.err))
    lines = error_lines(proc)
    assert len(lines) == 1, proc
    return lines[0]


# Each script one terminal per rank, rank 0 on host A and the others on B, so that every role loses its peers
# when A's link goes down: (script, world size, flags, the rank that shows training under way, its line).
# Roles that only wait (the RNN's and the parameter server's idle rank 0, DDP's master and parameter server) name
# the rank they lost; the others may be inside an RPC (CartPole's observer too: its episode asks the agent for
# each action) or trainer 1 inside a DDP collective with trainer 0, which times out.
VANISHING = [("rpc_rnn_model_parallel.py", 2, ["--epochs", 100000], 1, "Training epoch 1 loss"),
             ("rpc_parameter_server.py", 2, ["--epochs", 100000], 1, "training batch 2 loss"),
             ("rpc_rl_cartpole.py", 2, ["--max_episodes", 100000, "--log_interval", 1], 0, "Episode 1\t"),
             ("ddp_rpc_hybrid.py", 4, ["--epochs", 100000], 1, "Training done for epoch 1 ")]
ONLY_WAIT = {("rpc_rnn_model_parallel.py", 0), ("rpc_parameter_server.py", 0), ("ddp_rpc_hybrid.py", 2),
             ("ddp_rpc_hybrid.py", 3)}
TIMED_OUT = ("RPC ran for more than set timeout", "Timed out waiting")  # an RPC's timeout, a Gloo collective's


def torchrun(host, addr, endpoint, nproc):
    """torchrun's flags for one machine of two: c10d rendezvous at endpoint, hosted by the machine that has that
    address (is_host: its hostname resolves to 127.0.0.1, so torchrun cannot tell), each machine naming its own
    address (--local_addr: else the ranks are told MASTER_ADDR=localhost)."""
    return ["-m", "torch.distributed.run", "--nnodes=2", f"--nproc_per_node={nproc}", "--rdzv_backend=c10d",
            f"--rdzv_endpoint={endpoint}", f"--rdzv_conf=is_host={int(endpoint.startswith(addr + ':'))}",
            f"--local_addr={addr}"]


TORCHRUN = {"ddp_rpc_hybrid.py": 2, "rpc_rnn_model_parallel.py": 1}  # processes per machine


@pytest.fixture(scope="module")
def machines(tmp_path_factory, tiny_mnist):
    """Runs across two pairs of machines, started together so that torchrun's runs train while the others wait
    out their --timeout, all ended before any test reads them. "vanished": the runs of VANISHING, by script (a
    list of ranks), rank 0 on host A and the others on B, each under way when A's link went down, "down" seconds
    later all had ended, "hosts" and "addrs" of that pair (no rank sees a GPU, but DDP's rank 0 runs two_gpus());
    "torchrun": by script of TORCHRUN, the two torchrun processes, one on each machine of the other pair,
    "torchrun addrs" their addresses."""
    started, runs = [], {"vanished": {}, "torchrun": {}}

    def start(script, *args, netns, **kwargs):
        started.append(Run(script, args, cwd=tmp_path_factory.mktemp("machine"), netns=netns, **kwargs))
        return started[-1]

    with two_hosts() as ((host_a, host_b), (addr_a, _)), two_hosts() as (hosts, addrs):
        runs.update(hosts=(host_a, host_b), addrs=addr_a, **{"torchrun addrs": addrs})
        for script, world_size, flags, _, _ in VANISHING:
            common = [f"--world_size={world_size}", "--master_addr", addr_a, "--master_port", free_port(),
                      "--timeout", TIMEOUT, *flags, *(tiny_mnist_flags(tiny_mnist) if "server" in script else [])]
            gpus = two_gpus(tmp_path_factory.mktemp("gpus")) if script == "ddp_rpc_hybrid.py" else script
            runs["vanished"][script] = [start(gpus if rank == 0 else script, *common, f"--rank={rank}",
                                              netns=host_b if rank else host_a,
                                              env={"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
                                        for rank in range(world_size)]
        for script, nproc in TORCHRUN.items():
            endpoint = f"{addrs[0]}:{free_port()}"
            runs["torchrun"][script] = [start(script, "--epochs=2", netns=host, python_args=torchrun(
                host, addr, endpoint, nproc)) for host, addr in zip(hosts, addrs)]
        try:
            for script, _, _, printer, line in VANISHING:
                runs["vanished"][script][printer].wait_for(line)
            subprocess.run(["ip", "-n", host_a, "link", "set", "v" + host_a[3:], "down"], check=True)
            down = time.monotonic()
            wait_all([proc for ranks in runs["vanished"].values() for proc in ranks], VANISHED)
            runs["down"] = time.monotonic() - down
            wait_all(started, HANG)
            yield runs
        finally:
            stop_all(started)


def test_a_vanished_machine_ends_every_process_on_both(machines):
    # A power loss or a pulled cable closes no connection: only a timeout can notice (CartPole's observer, DDP's
    # trainer 1, master and parameter server once waited with no limit: timeout=0, Gloo's 30 minutes). Until then,
    # every script trains across the two machines with --master_addr only: here, as on many cloud images, the
    # hostname resolves to 127.0.0.1, and each rank must pick the interface that reaches the master.
    (host_a, host_b), addr_a = machines["hosts"], machines["addrs"]
    assert machines["down"] < VANISHED
    for script, ranks in machines["vanished"].items():
        for rank, proc in enumerate(ranks):
            veth = "v" + (host_b if rank else host_a)[3:]
            assert f"Rank {rank}: interface {veth}\n" in proc.out, proc
            line = one_error_line(proc)
            lost = re.search(r"lost contact with rank (\d+)$", line)
            if (script, rank) in ONLY_WAIT or not any(phrase in line for phrase in TIMED_OUT):
                # ... and it names a rank on the other machine
                assert lost and (int(lost[1]) == 0) != (rank == 0), f"{script} rank {rank}: {proc}"


def test_a_trainer_without_a_gpu_puts_every_trainer_on_the_cpu(machines):
    # trainer0 on a host that says it has two GPUs, trainer1 on one with none (the vanished case's DDP run, before
    # the link went down). DDP needs one device type in all replicas: both train on the CPU with Gloo, and each says
    # why, instead of trainer0 choosing NCCL on its GPU and the group failing.
    ranks = machines["vanished"]["ddp_rpc_hybrid.py"]
    for trainer in (0, 1):
        assert f"trainer{trainer}: DDP on cpu with gloo (no GPU for trainer1)\n" in ranks[trainer].out, ranks[trainer]
    assert "Training done for epoch 1 " in ranks[1].out, ranks[1]


def test_torchrun_across_two_machines(machines):
    # The README's multi-node command, on the DDP example (two processes per machine) and the RNN (one each).
    addrs = machines["torchrun addrs"]
    for script, both in machines["torchrun"].items():
        for agent in both:
            assert agent.returncode == 0, agent
        out = "".join(agent.out for agent in both)
        # every rank reached the master over the link between the machines, not over 127.0.0.1
        assert len(re.findall(r"^Rank \d: interface v\w+$", out, re.M)) == 2 * TORCHRUN[script], both
        assert out.count("Summary:") == 1, both
    assert "fc_in_sync=true" in "".join(agent.out for agent in machines["torchrun"]["ddp_rpc_hybrid.py"])


def test_ranks_started_by_hand_wait_minutes_for_each_other(shared_runs):
    # The RNN's ranks with the README's flags, rank 1 started after rank 0 said what it waits for. Each says it
    # once: without --timeout, minutes (a lone one still ends after that, the README says); they meet and train.
    ranks = shared_runs["rnn ranks"]
    where = re.search(r"--master_addr (\S+) --master_port (\d+)", " ".join(ranks[0].proc.args)).groups()
    for rank, proc in enumerate(ranks):
        assert proc.returncode == 0, proc
        assert_no_traceback(proc.err)
        assert re.findall(r"^Rank \d+ waits .*$", proc.err, re.M) == [
            f"Rank {rank} waits 300 s for all at {':'.join(where)}"], proc
    assert "Summary: epochs=" in ranks[1].out, ranks[1]


def test_ranks_of_two_scripts_on_one_port_both_stop(shared_runs):
    # Without a check both would exit 0 without training: each script's done-RPC would answer the other's.
    rnn, cartpole = shared_runs["scripts"]
    prefix = "not all 2 ranks met at port "
    assert prefix in one_error_line(rnn) and "name trainer" in one_error_line(rnn), rnn
    assert prefix in one_error_line(cartpole) and "name agent" in one_error_line(cartpole), cartpole


def test_ranks_of_two_world_sizes_on_one_port_both_stop(shared_runs):
    # Each names the world size it waited for, and the flag to check.
    for world_size, proc in enumerate(shared_runs["sizes"], start=2):
        line = one_error_line(proc)
        assert f"): not all {world_size} ranks met at port " in line and "check --world_size" in line, proc

