"""What the scripts share: one launching section, an import that starts nothing, a tutorial part
that keeps Python's Ctrl-C, and a line that names the rank where an RPC raised (test_failures.py:
the launching section's guards at work)."""
import importlib

import pytest

from conftest import IN_PROCESS, ROOT, SCRIPTS, assert_succeeded

BANNER = "# --------- Launching ranks"


def test_the_launching_section_is_one_text_in_every_script():
    sections = {(ROOT / f"{script}.py").read_text().split(BANNER)[1] for script in SCRIPTS}
    assert len(sections) == 1 and len(sections.pop()) <= 5000


IMPORT_ONLY = """
import contextlib, io, os, sys, threading
import gymnasium, psutil, torch  # what the scripts import first: gymnasium sets a variable
sys.path.insert(0, sys.argv[1])
environment = dict(os.environ)
for name in sys.argv[2:]:
    threads, printed = threading.enumerate(), io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        module = __import__(name)
    assert callable(module.main) and printed.getvalue() == "", (name, printed.getvalue())
    assert threading.enumerate() == threads, (name, threading.enumerate())
    assert psutil.Process().children() == [] and dict(os.environ) == environment, name
"""


def test_importing_a_script_starts_nothing(run, tmp_path):
    # In a fresh Python, not pytest's, which has imported them: the scripts one after the other.
    (tmp_path / "import_only.py").write_text(IMPORT_ONLY)
    proc = run(tmp_path / "import_only.py", ROOT, *SCRIPTS).wait()
    assert (proc.returncode, proc.out, proc.err) == (0, "", ""), proc


KEEPS_CTRL_C = f"""
import signal, sys
for script in sys.argv[1:]:  # everything above the banner, as a learner's own program
    exec(open(script).read().split("{BANNER}")[0], {{"__name__": "__main__"}})
    print(signal.pthread_sigmask(signal.SIG_BLOCK, []) == set(),
          signal.getsignal(signal.SIGINT) is signal.default_int_handler)
"""


def test_a_program_that_copies_a_tutorial_part_keeps_ctrl_c(run, tmp_path):
    # Ctrl-C still raises KeyboardInterrupt there: no signal blocked, SIGINT's handler Python's.
    (tmp_path / "own_program.py").write_text(KEEPS_CTRL_C)
    proc = run(tmp_path / "own_program.py", *[ROOT / f"{script}.py" for script in SCRIPTS]).wait()
    assert_succeeded(proc)
    assert proc.out == "True True\n" * len(SCRIPTS), proc


# torch's report of an exception raised inside an RPC, as the caller gets it where an RRef held
# the error: one report nested in another, each naming the worker where the function ran.
NESTED = ("ValueError: On WorkerInfo(id=0, name=ps):\nValueError('On WorkerInfo(id=0, name=ps):\n"
          "ValueError('bug')\nTraceback (most recent call last):\n  File \"a.py\", line 9, in f\n"
          "ValueError: bug\n')\nTraceback (most recent call last):\n  File \"b.py\", line 7, in g\n"
          "ValueError: On WorkerInfo(id=0, name=ps):\nValueError('bug')\nTraceback (most recent "
          "call last):\n  File \"a.py\", line 9, in f\nValueError: bug\n\n\nAt:\n  internal.py(236)")


@IN_PROCESS
@pytest.mark.parametrize("report, line", [
    (NESTED, "rank 0 (ps): ValueError('bug')"),  # the rank and the innermost exception
    # a release that words its report otherwise: the line quotes its first line, still true
    (NESTED.replace("On WorkerInfo(id=0, name=ps)", "From worker 0 (ps)"),
     "ValueError: ValueError: From worker 0 (ps):"),
], ids=["torch's report", "reworded"])
def test_an_rpcs_exception_names_its_rank_or_quotes_the_report(report, line):
    assert importlib.import_module(SCRIPTS[0]).describe(ValueError(report)) == line
