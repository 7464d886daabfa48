"""What all four scripts share: imports that start nothing, torchrun, and the interface that reaches the master,
on this host and across two hosts."""
import re

import pytest

from conftest import (RNN_EPOCHS, ROOT, SCRIPTS, assert_succeeded, free_port, own_address, summary, tiny_mnist_flags,
                      wait_all)

IMPORT_ONLY = """
import contextlib, io, os, sys, threading
import gymnasium, torch  # what the scripts import, and what that does (gymnasium sets a variable), first
sys.path.insert(0, sys.argv[1])
environment = dict(os.environ)

def children():
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1]) == os.getpid():
                found.append(open(f"/proc/{pid}/cmdline").read())
        except OSError:
            pass
    return found

for name in sys.argv[2:]:
    threads, printed = threading.enumerate(), io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        module = __import__(name)
    assert callable(module.main), f"{name} has no main()"
    assert not printed.getvalue(), f"importing {name} printed {printed.getvalue()!r}"
    assert threading.enumerate() == threads, f"importing {name} started threads: {threading.enumerate()}"
    assert not children(), f"importing {name} started processes: {children()}"
    assert dict(os.environ) == environment, f"importing {name} changed the environment"
"""


def test_importing_a_script_starts_nothing(run, tmp_path):
    # A fresh Python (pytest's has imported the scripts) imports the four in turn and checks after each.
    (tmp_path / "import_only.py").write_text(IMPORT_ONLY)
    proc = run(tmp_path / "import_only.py", ROOT, *SCRIPTS).wait()
    assert (proc.returncode, proc.out, proc.err) == (0, "", ""), proc


def test_torchrun_sets_the_ranks(shared_runs):
    # torchrun hosts its own store at MASTER_PORT; the script joins it, and runs one rank per process.
    proc = shared_runs["rnn torchrun"]
    assert_succeeded(proc)
    assert proc.out.count("Summary:") == 1 and "Summary: epochs=2 " in proc.out, proc
    assert "Starting " not in proc.out, proc


def test_a_master_addr_of_this_host_picks_its_interface(shared_runs):
    # Needs neither root nor a second machine: this host's own address is reached through its own interface.
    if own_address() is None:
        pytest.skip("this host has no non-loopback IPv4 address")
    ifname, addr = own_address()
    ranks = shared_runs["rnn ranks"]
    assert_succeeded(*ranks)
    for rank, proc in enumerate(ranks):
        assert re.search(rf"^Rank {rank}: using network interface {re.escape(ifname)} to reach {re.escape(addr)}$",
                         proc.out, re.M), proc
    assert summary(ranks[1].out)["epochs"] == str(RNN_EPOCHS), ranks[1]  # and the run trained


def test_two_machines_pick_the_interface_that_reaches_the_master(run, two_hosts, tiny_mnist):
    # Here, as on many cloud images, the hostname resolves to 127.0.0.1; without the right interface Gloo
    # and TensorPipe tell the peer to connect to 127.0.0.1 and fail. DDP at the tutorial's world size 4 with
    # trainer 1 on host B and the other ranks on A, and the parameter server example with its trainer on B,
    # with --master_addr only: RPC and DDP's group each go over the interface that reaches the master.
    (host_a, host_b), (addr_a, _) = two_hosts
    common, ddp_port, ps_port = ["--master_addr", addr_a, "--timeout", 60], free_port(), free_port()
    ddp = [run("ddp_rpc_hybrid.py", "--world_size=4", *common, "--master_port", ddp_port, "--epochs", 2,
               f"--rank={rank}", netns=host_b if rank == 1 else host_a) for rank in range(4)]
    ps = [run("rpc_parameter_server.py", "--world_size=2", *common, "--master_port", ps_port, "--epochs=1",
              *tiny_mnist_flags(tiny_mnist), f"--rank={rank}", netns=host_b if rank == 1 else host_a)
          for rank in range(2)]
    wait_all(ddp + ps)
    assert_succeeded(*ddp, *ps)
    for ranks in (ddp, ps):
        for rank, proc in enumerate(ranks):
            veth = "v" + (host_b if rank == 1 else host_a)[3:]
            assert re.search(rf"^Rank {rank}: using network interface {veth} to reach {re.escape(addr_a)}$",
                             proc.out, re.M), proc
    assert re.search(r"^Summary: .*fc_in_sync=true$", ddp[2].out, re.M), ddp[2]
    assert re.search(r"^Summary: rank=1 .* accuracy=", ps[1].out, re.M), ps[1]
