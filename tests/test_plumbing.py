"""What all the scripts share: imports that start nothing, and a failure's one line for any error (torchrun and the
failures: tests/test_several_machines.py and tests/test_failures.py)."""
import importlib
import socket

import pytest

from conftest import ROOT, SCRIPTS

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
    # A fresh Python (pytest's has imported the scripts) imports the scripts in turn and checks after each.
    (tmp_path / "import_only.py").write_text(IMPORT_ONLY)
    proc = run(tmp_path / "import_only.py", ROOT, *SCRIPTS).wait()
    assert (proc.returncode, proc.out, proc.err) == (0, "", ""), proc


@pytest.mark.parametrize("error", [
    RuntimeError(), ValueError("two\nlines"), socket.gaierror(), KeyError("id=3, name=ps)"),
    RuntimeError("On WorkerInfo(id=1, name=trainer1):\nTraceback (most recent call last):\n  File ..."),
], ids=repr)
def test_any_error_is_described_in_one_line(error):
    # A rank's last line comes from describe(), which must never raise, whatever torch or a learner's code raised:
    # the launcher would print its traceback.
    line = importlib.import_module(SCRIPTS[0]).describe(error)
    assert line and "\n" not in line, line


# torch's report of an exception raised inside an RPC, as the caller gets it where an RRef held the error: one
# report nested in another, each naming the worker where the function ran, then its traceback.
NESTED = ("ValueError: On WorkerInfo(id=0, name=ps):\nValueError('On WorkerInfo(id=0, name=ps):\nValueError('bug')\n"
          "Traceback (most recent call last):\n  File \"a.py\", line 9, in __init__\nValueError: bug\n')\n"
          "Traceback (most recent call last):\n  File \"b.py\", line 7, in _call_method\n"
          "ValueError: On WorkerInfo(id=0, name=ps):\nValueError('bug')\nTraceback (most recent call last):\n"
          "  File \"a.py\", line 9, in __init__\nValueError: bug\n\n\nAt:\n  internal.py(236): _handle_exception")


@pytest.mark.parametrize("report, line", [
    (NESTED, "rank 0 (ps): ValueError('bug')"),  # the rank and the innermost exception
    # a later release that words its report otherwise: the line quotes its first line, still a true one
    (NESTED.replace("On WorkerInfo(id=0, name=ps)", "From worker 0 (ps)"), "ValueError: ValueError: From worker 0 (ps):"),
], ids=["torch's report", "reworded"])
def test_an_rpcs_exception_names_its_rank_or_quotes_the_report(report, line):
    assert importlib.import_module(SCRIPTS[0]).describe(ValueError(report)) == line


HEADER_KEEPS_CTRL_C = """
import signal, sys
sys.argv = [sys.argv[1]]
exec(open(sys.argv[0]).read().split("# --------- Launching ranks")[0], {"__name__": "__main__"})
print(signal.pthread_sigmask(signal.SIG_BLOCK, []) == set(), signal.getsignal(signal.SIGINT) is signal.default_int_handler)
"""


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_program_that_copies_the_tutorial_part_keeps_ctrl_c(run, tmp_path, script):
    # Everything above the banner, run as a learner's own program: Ctrl-C still raises KeyboardInterrupt there.
    (tmp_path / "own_program.py").write_text(HEADER_KEEPS_CTRL_C)
    proc = run(tmp_path / "own_program.py", ROOT / f"{script}.py").wait()
    assert (proc.returncode, proc.out) == (0, "True True\n"), proc
