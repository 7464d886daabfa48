"""What all four scripts share: the plumbing section, its reports, the interface choice,
and imports that start nothing."""
import re
import subprocess
import sys
from typing import NamedTuple

import pytest

from conftest import RNN_EPOCHS, ROOT, SCRIPTS, assert_no_traceback, own_address, summary

# The plumbing, and the command line's common flags, between these markers.
SHARED = {"plumbing": ("# --------- Starting, watching and stopping ranks", "# --------- Command line"),
          "common flags": ("# --------- Command line", "def parse_args(")}


def shared_text(module):
    text = (ROOT / f"{module}.py").read_text()
    for begin, end in SHARED.values():
        assert text.count(begin) == 1 and text.count(end) == 1, f"{module}.py lacks {begin!r} or {end!r}"
    return {part: text[text.index(begin):text.index(end)] for part, (begin, end) in SHARED.items()}


def test_plumbing_is_the_same_in_every_script():
    # The failure tests provoke most failures on one script; this is what makes
    # that hold for the other copies too.
    reference = shared_text(SCRIPTS[0])
    for module in SCRIPTS[1:]:
        assert shared_text(module) == reference, f"{module}.py's plumbing or common flags differ from {SCRIPTS[0]}.py's"


class Report(NamedTuple):
    raised: str  # what rank 1 raises, as Python source
    starts: str  # how the rank's report begins
    status: int  # the rank's exit status


REPORTS = [
    Report("AssertionError()", "Error on rank 1 (trainer): AssertionError at ", 1),  # the tutorial's bare `assert`
    Report("Unprintable()", "Error on rank 1 (trainer): Unprintable\n", 1),
    Report("RuntimeError(42)", "Error on rank 1 (trainer): RuntimeError: 42\n", 1),
    Report("KeyboardInterrupt()", "Error on rank 1 (trainer): interrupted.", 130),
]
REPORTER = f"""
import os, sys
sys.path.insert(0, {str(ROOT)!r})
import rpc_rnn_model_parallel as script

class Unprintable(Exception):
    def __str__(self):
        raise ValueError("no words")

def fail(exc):
    def run_rank(rank, args):
        raise exc
    return run_rank

for exc in [{", ".join(report.raised for report in REPORTS)}]:
    if os.fork() == 0:  # this process never touches CUDA
        script.run_rank = fail(exc)
        script._rank_main(1, script.parse_args(["--rank=1"]))
    _, status = os.wait()
    print("exit", os.waitstatus_to_exitcode(status), file=sys.stderr, flush=True)
"""


def test_the_report_survives_any_exception(run, tmp_path):
    (tmp_path / "reporter.py").write_text(REPORTER)
    proc = run(tmp_path / "reporter.py").wait()
    assert proc.returncode == 0, proc
    assert_no_traceback(proc.err)
    reports = proc.err.strip().split("\n\n")
    assert len(reports) == len(REPORTS), proc
    for report, expected in zip(reports, REPORTS):
        assert report.startswith(expected.starts) and report.endswith(f"\nexit {expected.status}"), proc
    assert re.match(r".* at .*reporter\.py:\d+\n", reports[0]), proc  # where the message-less exception was raised
    assert reports[-1] == "Error on rank 1 (trainer): interrupted.\nexit 130", proc  # no --debug hint: nothing failed


def test_a_master_addr_of_this_host_picks_its_interface(shared_runs):
    # Needs neither root nor a second machine: this host's own address is reached through its own interface.
    if own_address() is None:
        pytest.skip("this host has no non-loopback IPv4 address")
    ifname, addr = own_address()
    ranks = shared_runs["rnn ranks at own address"]
    for rank, proc in enumerate(ranks):
        assert proc.returncode == 0, proc
        assert re.search(rf"^Rank {rank}: using network interface {re.escape(ifname)} to reach {re.escape(addr)}$",
                         proc.out, re.M), proc
    assert summary(ranks[1].out)["epochs"] == str(RNN_EPOCHS), ranks[1]  # and the run trained


IMPORT_ONLY = """
import contextlib, io, os, sys, threading

def children():
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1]) == os.getpid():
                found.append(open(f"/proc/{pid}/cmdline").read())
        except OSError:
            pass
    return found

for name in sys.argv[1:]:
    threads, printed = threading.enumerate(), io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        module = __import__(name)
    assert callable(module.main), f"{name} has no main()"
    assert not printed.getvalue(), f"importing {name} printed {printed.getvalue()!r}"
    assert threading.enumerate() == threads, f"importing {name} started threads: {threading.enumerate()}"
    assert not children(), f"importing {name} started processes: {children()}"
"""


def test_importing_a_script_starts_nothing():
    # A fresh interpreter: pytest has already imported every script, so an import here would run nothing.
    # One interpreter imports the four in turn and checks after each; torch then loads once, not four times.
    proc = subprocess.run([sys.executable, "-c", IMPORT_ONLY, *SCRIPTS], cwd=ROOT, text=True, capture_output=True,
                          timeout=120)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", ""), f"exit {proc.returncode}\n{proc.stdout}{proc.stderr}"
