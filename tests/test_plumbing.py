"""What all four scripts share: the plumbing section, and imports that start nothing."""
import importlib
import multiprocessing
import threading

import pytest

from conftest import ROOT

SCRIPTS = ["rpc_parameter_server", "rpc_rl_cartpole", "rpc_rnn_model_parallel", "ddp_rpc_hybrid"]
# The plumbing, and the command line's common flags, between these markers.
SHARED = [("# --------- Starting, watching and stopping ranks", "# --------- Command line"),
          ("# --------- Command line", "def parse_args(")]


def shared_text(module):
    text = (ROOT / f"{module}.py").read_text()
    for begin, end in SHARED:
        assert text.count(begin) == 1 and text.count(end) == 1, f"{module}.py lacks {begin!r} or {end!r}"
    return [text[text.index(begin):text.index(end)] for begin, end in SHARED]


def test_plumbing_is_the_same_in_every_script():
    # The failure tests provoke most failures on one script; this is what makes
    # that hold for the other copies too.
    reference = shared_text(SCRIPTS[0])
    for module in SCRIPTS[1:]:
        assert shared_text(module) == reference, f"{module}.py's plumbing or common flags differ from {SCRIPTS[0]}.py's"


REPORTER = """
import os, sys
import rpc_rnn_model_parallel as script

class Unprintable(Exception):
    def __str__(self):
        raise ValueError("no words")

def fail(exc):
    def run_rank(rank, args):
        raise exc
    return run_rank

for exc in [AssertionError(), Unprintable(), RuntimeError(42), KeyboardInterrupt()]:
    if os.fork() == 0:  # this process never touches CUDA
        script.run_rank = fail(exc)
        script._rank_main(1, script.parse_args(["--rank=1"]))
    _, status = os.wait()
    print("exit", os.waitstatus_to_exitcode(status), file=sys.stderr, flush=True)
"""


def test_the_report_survives_any_exception(run, tmp_path):
    # The tutorial's own bare `assert` raises an AssertionError with no message.
    (tmp_path / "reporter.py").write_text(REPORTER)
    proc = run(tmp_path / "reporter.py", env={"PYTHONPATH": str(ROOT)}).wait()
    assert proc.returncode == 0, proc
    reports = proc.err.strip().split("\n\n")
    assert "Traceback" not in proc.err, proc
    assert reports[0].startswith("Error on rank 1 (trainer): AssertionError at ") and "reporter.py:" in reports[0]
    assert reports[1].startswith("Error on rank 1 (trainer): Unprintable\n") and reports[1].endswith("exit 1")
    assert reports[2].startswith("Error on rank 1 (trainer): RuntimeError: 42\n") and reports[2].endswith("exit 1")
    assert reports[3] == "Error on rank 1 (trainer): interrupted.\nexit 130", proc


@pytest.mark.parametrize("module", SCRIPTS)
def test_importing_a_script_starts_nothing(module, capsys):
    threads, children = threading.active_count(), multiprocessing.active_children()
    imported = importlib.import_module(module)
    assert callable(imported.main)
    assert threading.active_count() == threads
    assert multiprocessing.active_children() == children
    assert capsys.readouterr() == ("", "")
