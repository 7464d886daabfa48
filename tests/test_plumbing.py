from conftest import BANNER, ROOT, SCRIPTS, assert_succeeded


def test_the_launching_section_is_one_text_in_every_script():
    sections = {(ROOT / f"{script}.py").read_text().split(BANNER)[1] for script in SCRIPTS}
    assert len(sections) == 1 and len(sections.pop()) <= 5000


def test_an_import_starts_nothing_and_a_copied_tutorial_part_keeps_ctrl_c(run, tmp_path):
    # In a fresh Python, each script imported, then its tutorial part run as a learner's program.
    (tmp_path / "own_program.py").write_text(
        "import contextlib, io, os, signal, sys, threading\n"
        "import gymnasium, psutil, torch  # first: gymnasium sets a variable\n"
        "environment, threads = dict(os.environ), threading.enumerate()\n"
        "for name in sys.argv[1:]:\n"
        "    with contextlib.redirect_stdout(io.StringIO()) as printed:\n"
        "        assert callable(__import__(name).main) and printed.getvalue() == '', name\n"
        "    assert threading.enumerate() == threads and psutil.Process().children() == [], name\n"
        "    assert dict(os.environ) == environment, name\n"
        "for name in sys.argv[1:]:\n"
        f"    code = open(sys.modules[name].__file__).read().split({BANNER!r})[0]\n"
        "    exec(code, {'__name__': '__main__'})\n"
        "    print(signal.pthread_sigmask(signal.SIG_BLOCK, []) == set(),\n"
        "          signal.getsignal(signal.SIGINT) is signal.default_int_handler)\n")
    proc = run(tmp_path / "own_program.py", *SCRIPTS, env={"PYTHONPATH": str(ROOT)})
    assert_succeeded(proc.wait())
    assert (proc.out, proc.err) == ("True True\n" * len(SCRIPTS), ""), proc
