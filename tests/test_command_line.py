"""Bad arguments: exit 2 before anything starts, argparse's usage and one line naming the flag and its
range (a whole command: tests/test_failures.py); --help explains every flag with its default."""
import importlib
import re

import pytest

from conftest import SCRIPTS

CASES = [
    # the common flags, in every script
    *[(module, argv, problem) for module in SCRIPTS for size in [2 if "rnn" in module else 5] for argv, problem in [
        ([f"--world-size={size}", f"--rank={size}"], f"--rank must be in [0, {size})"),
        ([f"--world_size={size}", "--rank=-1"], f"--rank must be in [0, {size})"),
        (["--timeout=soon"], "argument --timeout: invalid number value: 'soon'"),
        (["--timeout=0"], "argument --timeout: 0 is not in [1, 86400]"),  # torch's 0 would mean no limit
        (["--timeout=-5"], "argument --timeout: -5 is not in [1, 86400]"),
        (["--master_port=70000"], "argument --master_port: 70000 is not in [1, 65535]"),
        (["--master_port=-1"], "argument --master_port: -1 is not in [1, 65535]"),
        (["--seed=-1"], "argument --seed: -1 is not in [0, inf]"),
        (["--epoch=1"], "unrecognized arguments: --epoch=1"),  # no prefix matching
    ]],
    # world sizes too small (or large) for the roles, and each script's own flags
    ("rpc_rnn_model_parallel", ["--world_size=3"], "argument --world_size/--world-size: 3 is not in [2, 2]"),
    ("rpc_parameter_server", ["--world_size=1"], "argument --world_size/--world-size: 1 is not in [2, inf]"),
    ("rpc_rl_cartpole", ["--world_size=1"], "argument --world_size/--world-size: 1 is not in [2, inf]"),
    ("ddp_rpc_hybrid", ["--world_size=2"], "argument --world_size/--world-size: 2 is not in [3, inf]"),
    ("rpc_parameter_server", ["--num_gpus=3"], "argument --num_gpus: 3 is not in [0, 2]"),
    ("rpc_parameter_server", ["--num_gpus=-1"], "argument --num_gpus: -1 is not in [0, 2]"),
    ("rpc_parameter_server", ["--epochs=0"], "argument --epochs: 0 is not in [1, inf]"),
    ("rpc_rnn_model_parallel", ["--epochs=0"], "argument --epochs: 0 is not in [1, inf]"),
    ("rpc_rnn_model_parallel", ["--epochs=-1"], "argument --epochs: -1 is not in [1, inf]"),
    ("ddp_rpc_hybrid", ["--epochs=0"], "argument --epochs: 0 is not in [1, inf]"),
    ("rpc_rl_cartpole", ["--log_interval=0"], "argument --log_interval: 0 is not in [1, inf]"),
    ("rpc_rl_cartpole", ["--max_episodes=-3"], "argument --max_episodes: -3 is not in [0, inf]"),
    ("rpc_rl_cartpole", ["--gamma=1.5"], "argument --gamma: 1.5 is not in [0, 1]"),
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
    assert err.strip().splitlines()[-1].split(": error: ")[1].startswith(problem), err


@pytest.mark.parametrize("module", SCRIPTS)
def test_help_explains_every_flag_with_its_default(module, capsys):
    with pytest.raises(SystemExit):
        importlib.import_module(module).parse_args(["--help"])
    out = capsys.readouterr().out
    options = re.split(r"^(?:options|optional arguments):\n", out, flags=re.M)[1].split("\n\n")[0]  # 3.10: the latter
    entries = [" ".join(entry.split()) for entry in re.split(r"\n(?=  -)", options)][1:]  # but -h
    for entry in entries:  # the flag, its metavar, a help text, then the default once
        flags_then_text = r"(-[-\w]+( [A-Z_]+)?,? ?)+ [A-Z(][^()]*(\(.*\))?[^()]*\. \(default: [^()]*\)"
        assert re.fullmatch(flags_then_text, entry), entry
    assert "--master_port MASTER_PORT Rank 0's port (None: 29500; one command: a free one). (default: None)" \
        in entries, entries
