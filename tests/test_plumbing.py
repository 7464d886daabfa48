"""What all four scripts share: imports that start nothing, torchrun, and the interface that reaches the master
(across two hosts: tests/test_several_machines.py)."""
import re

import pytest

from conftest import RNN_EPOCHS, ROOT, SCRIPTS, assert_succeeded, own_address, summary

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
        assert re.search(rf"^Rank {rank}: interface {re.escape(ifname)}$", proc.out, re.M), proc
    assert summary(ranks[1].out)["epochs"] == str(RNN_EPOCHS), ranks[1]  # and the run trained
