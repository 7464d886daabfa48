"""A learner copies the parameter server's tutorial part into a program of their own (tests/learner.py), with
two trainers: the tutorial's ParameterServer serves both, with nothing from the plumbing. (Each class of the four
scripts with the tutorials' own calls: tests/test_classes.py.)"""
from conftest import assert_succeeded


def test_a_copied_parameter_server_serves_two_trainers(shared_runs):
    proc = shared_runs["copy"]
    assert proc.returncode == 0, proc.err  # the whole of it: the cause may be far from the end
    assert_succeeded(proc)
    assert sorted(line for line in proc.out.splitlines() if line.startswith("Copied: ")) == [
        "Copied: trainer 1 trained", "Copied: trainer 2 trained"], proc
