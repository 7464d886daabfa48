"""Bad arguments: exit 2, argparse's usage and one line naming the problem; --help."""
import importlib
import re

import pytest

from conftest import SCRIPTS

CASES = [
    # the common flags, in every script
    *[(module, argv, problem) for module in SCRIPTS for argv, problem in [
        (["--world-size=3", "--rank=3"], "--rank must be in [0, 3)"),  # the spelling of other tools too
        (["--world_size=2", "--rank=-1"], "--rank must be in [0, 2)"),
        (["--timeout=soon"], "argument --timeout: invalid float value: 'soon'"),
        (["--epoch=1"], "unrecognized arguments: --epoch=1"),  # no prefix matching
    ]],
    # world sizes too small for the roles, and the parameter server's GPUs
    ("rpc_rnn_model_parallel", ["--world_size=3"], "--world_size must be 2: the parameter server and the trainer"),
    ("rpc_parameter_server", ["--world_size=1"], "--world_size must be at least 2: a parameter server and a trainer"),
    ("rpc_rl_cartpole", ["--world_size=1"], "--world_size must be at least 2: an agent and an observer"),
    ("ddp_rpc_hybrid", ["--world_size=2"], "--world_size must be at least 3: a trainer, the master and the server"),
    ("rpc_parameter_server", ["--num_gpus=3"], "--num_gpus must be between 0 and 2, got 3"),
]


@pytest.fixture(autouse=True)
def no_torchrun(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):  # as a user's shell, not torchrun's
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("module, argv, problem", CASES, ids=[f"{m}:{' '.join(a)}" for m, a, _ in CASES])
def test_bad_arguments_exit_2(module, argv, problem, capsys):
    with pytest.raises(SystemExit) as exit_info:
        importlib.import_module(module).parse_args(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: "), err
    assert err.strip().splitlines()[-1].endswith(f": error: {problem}"), err


@pytest.mark.parametrize("module", SCRIPTS)
def test_help_shows_each_default_once_and_truly(module, capsys):
    with pytest.raises(SystemExit):
        importlib.import_module(module).parse_args(["--help"])
    out = capsys.readouterr().out
    entries = [" ".join(entry.split()) for entry in re.split(r"\n(?=  -)", out)]  # one per flag
    for entry in entries:
        assert entry.count("(default:") <= 1, entry
    assert "--timeout TIMEOUT Seconds to wait for a peer, 5x to meet. (default: 60)" in entries
    assert "--master_port MASTER_PORT Port of rank 0 (one command: a free one). (default: 29500)" in entries
