"""Several machines, played by network namespaces (conftest's two_hosts, skipped where they cannot
be made): a machine that vanishes, torchrun across two, and who can reach a run on one."""
import ipaddress
import re
import socket
import subprocess
import time
from pathlib import Path

from conftest import LIVE, changed_copy, free_port, one_error_line


def test_a_vanished_machine_ends_every_process_on_both(run, two_hosts, tmp_path):
    # DDP trains across two machines, rank 0 on A, the others on B, each rank given its host's
    # --ifname, as the README says; A says that it has two GPUs and B none, so the trainers must
    # agree on the CPU. Then A's link goes down, as in a power loss: no connection is closed, only a
    # timeout can notice, whatever a rank is doing. Every rank ends, naming a rank on the other
    # machine: rank 0 a peer, the others rank 0.
    a, b = two_hosts
    gpus = changed_copy(tmp_path, "ddp_rpc_hybrid.py", "import torch\n",
                        "import torch\ntorch.cuda.device_count = lambda: 2\n")
    common = ["--world_size=4", "--master_addr", a.addr, "--master_port", free_port(),
              "--epochs", 10 ** 5, "--timeout=20"]
    ranks = [run(gpus if rank == 0 else "ddp_rpc_hybrid.py", *common, f"--rank={rank}", "--ifname",
                 host.ifname, prefix=["ip", "netns", "exec", host.netns],
                 env={"OMP_NUM_THREADS": "1", **LIVE})
             for rank, host in [(0, a), (1, b), (2, b), (3, b)]]
    ranks[1].wait_for("Training done for epoch 1 ")
    subprocess.run(["ip", "-n", a.netns, "link", "set", a.ifname, "down"], check=True)
    down = time.monotonic()
    for rank, proc in enumerate(ranks):
        proc.wait(down - proc.started + 3 * (20 + 5))  # --timeout: 20 s
        assert "terminate called" not in proc.err, proc
        lost = re.search(r"cannot reach rank (\d) \(\w+\)$", one_error_line(proc))
        assert lost and (lost[1] == "0") != (rank == 0), proc


def test_a_run_on_one_machine_listens_on_loopback_only(run, two_hosts):
    # The RNN's one command on a host whose hostname resolves to its network address, as on many
    # desktops: RPC runs whatever a peer sends, so its ranks listen on loopback alone. torch's
    # store, which runs no code, listens on every address (*).
    host = two_hosts[1]
    Path(f"/etc/netns/{host.netns}").mkdir(parents=True, exist_ok=True)
    hosts = f"127.0.0.1 localhost\n{host.addr} {socket.gethostname()}\n"
    Path(f"/etc/netns/{host.netns}/hosts").write_text(hosts)  # ip netns exec reads it as /etc/hosts
    rnn, seen = run("rpc_rnn_model_parallel.py", prefix=["ip", "netns", "exec", host.netns]), set()
    while rnn.proc.poll() is None:
        table = subprocess.run(["ip", "netns", "exec", host.netns, "ss", "-ltnpH"],
                               capture_output=True, text=True).stdout
        pids = rnn.left()
        seen.update(line.split()[3].rsplit(":", 1)[0] for line in table.splitlines()
                    if any(int(pid) in pids for pid in re.findall(r"pid=(\d+)", line)))
    assert rnn.wait().returncode == 0, rnn
    assert "127.0.0.1" in seen, seen
    assert all(addr == "*" or ipaddress.ip_address(addr.strip("[]")).is_loopback for addr in seen)


def test_torchrun_across_two_machines(run, two_hosts):
    # The README's command for several machines, on the RNN, one process on each machine:
    # c10d rendezvous hosted by A, each agent naming its own address and each rank its --ifname.
    endpoint = f"{two_hosts[0].addr}:{free_port()}"
    agents = [run("rpc_rnn_model_parallel.py", "--epochs=2", "--ifname", host.ifname,
                  prefix=["ip", "netns", "exec", host.netns],
                  python_args=["-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
                               "--rdzv_backend=c10d", f"--rdzv_endpoint={endpoint}",
                               f"--rdzv_conf=is_host={int(host == two_hosts[0])}",
                               f"--local_addr={host.addr}"])
              for host in two_hosts]
    for agent in agents:
        assert agent.wait().returncode == 0, agent
    assert "".join(agent.out for agent in agents).count("Summary: epochs=2 ") == 1, agents
