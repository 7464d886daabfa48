"""Several machines, played by network namespaces (two_hosts)."""
import ipaddress
import re
import socket
import subprocess
import time
from pathlib import Path

from conftest import LIVE, changed_copy, free_port, one_error_line


def test_a_vanished_machine_ends_every_process_on_both(run, two_hosts, tmp_path):
    # DDP across A, which says it has GPUs, and B, until A's link goes down: no connection
    # closes, only a timeout can notice.
    a, b = two_hosts
    gpus = changed_copy(tmp_path, "ddp_rpc_hybrid.py", "import torch\n",
                        "import torch\ntorch.cuda.device_count = lambda: 2\n")
    common = ["--world_size=4", "--master_addr", a[2], "--master_port", free_port(),
              "--epochs", 10 ** 5, "--timeout=20"]
    ranks = [run(gpus if rank == 0 else "ddp_rpc_hybrid.py", *common, f"--rank={rank}",
                 "--ifname", host[1], prefix=["ip", "netns", "exec", host[0]],
                 env={"OMP_NUM_THREADS": "1", **LIVE}) for rank, host in enumerate([a, b, b, b])]
    ranks[1].wait_for("Training done for epoch 1 ")
    subprocess.run(["ip", "-n", a[0], "link", "set", a[1], "down"], check=True)
    down = time.monotonic()
    for rank, proc in enumerate(ranks):
        assert proc.wait(3 * 25).ended - down < 3 * 25, proc  # 3x --timeout and a few s
        lost = re.search(r"cannot reach rank (\d) \(\w+\)$", one_error_line(proc))
        assert lost and (lost[1] == "0") != (rank == 0) and "terminate called" not in proc.err


def test_a_run_on_one_machine_listens_on_loopback_only(run, two_hosts):
    # Its hostname resolves to its address. torch's store, which runs no code, listens on "*".
    netns, _, addr = two_hosts[1]
    hosts = Path(f"/etc/netns/{netns}/hosts")  # what ip netns exec shows as /etc/hosts
    hosts.parent.mkdir(parents=True)
    hosts.write_text(f"127.0.0.1 localhost\n{addr} {socket.gethostname()}\n")
    rnn = run("rpc_rnn_model_parallel.py", "--epochs", 10 ** 5, env=LIVE,
              prefix=["ip", "netns", "exec", netns])
    rnn.wait_for("Training epoch 1 ")
    table = subprocess.run(["ip", "netns", "exec", netns, "ss", "-ltnH"], capture_output=True,
                           text=True).stdout  # the host runs nothing else
    seen = {line.split()[3].rsplit(":", 1)[0] for line in table.splitlines()}
    assert "127.0.0.1" in seen, table
    assert all(addr == "*" or ipaddress.ip_address(addr.strip("[]")).is_loopback for addr in seen)


def test_torchrun_across_two_machines(run, two_hosts):
    # The README's command for several machines, on the RNN.
    endpoint = f"{two_hosts[0][2]}:{free_port()}"
    agents = [run("rpc_rnn_model_parallel.py", "--epochs=2", "--ifname", ifname,
                  prefix=["ip", "netns", "exec", netns],
                  python_args=["-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
                               "--rdzv_backend=c10d", f"--rdzv_endpoint={endpoint}",
                               f"--rdzv_conf=is_host={int(endpoint.startswith(addr + ':'))}",
                               f"--local_addr={addr}"])
              for netns, ifname, addr in two_hosts]
    for agent in agents:
        assert agent.wait().returncode == 0, agent
    assert "".join(agent.out for agent in agents).count("Summary: epochs=2 ") == 1, agents
