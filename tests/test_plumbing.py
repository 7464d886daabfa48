"""What all four scripts share: the plumbing section, and imports that start nothing."""
import importlib
import multiprocessing
import threading

import pytest

from conftest import ROOT

SCRIPTS = ["rpc_parameter_server", "rpc_rl_cartpole", "rpc_rnn_model_parallel", "ddp_rpc_hybrid"]
BEGIN = "# --------- Starting, watching and stopping ranks"
END = "# --------- Command line"


def plumbing(module):
    text = (ROOT / f"{module}.py").read_text()
    assert text.count(BEGIN) == 1 and text.count(END) == 1, f"{module}.py lacks the section banners"
    return text[text.index(BEGIN):text.index(END)]


def test_plumbing_is_the_same_in_every_script():
    # The failure tests provoke each failure on one or two scripts; this is
    # what makes that hold for the other copies too.
    reference = plumbing(SCRIPTS[0])
    for module in SCRIPTS[1:]:
        assert plumbing(module) == reference, f"{module}.py's plumbing section differs from {SCRIPTS[0]}.py's"


@pytest.mark.parametrize("module", SCRIPTS)
def test_importing_a_script_starts_nothing(module, capsys):
    threads = threading.active_count()
    imported = importlib.import_module(module)
    assert callable(imported.main)
    assert threading.active_count() == threads
    assert multiprocessing.active_children() == []
    assert capsys.readouterr() == ("", "")
