import importlib
import re

import pytest

from conftest import IN_PROCESS, SCRIPTS

pytestmark = [pytest.mark.usefixtures("user_shell"), IN_PROCESS]
CASES = [  # the shared flags in one script: the launching section is one text (test_plumbing)
    ("rpc_rl_cartpole", argv, problem) for argv, problem in [
        (["--world-size=3", "--rank=3"], "--rank must be in [0, --world_size=3)"),
        (["--rank=-1"], "--rank must be in [0, --world_size=2)"),
        (["--timeout=soon"], "argument --timeout: invalid number value: 'soon'"),
        (["--timeout=0"], "argument --timeout: 0 is not in [1, 86400]"),  # torch's 0: no limit
        (["--master_port=70000"], "argument --master_port: 70000 is not in [1, 65535]"),
        (["--seed=-1"], "argument --seed: -1 is not in [0, inf]"),
        (["--world=3"], "unrecognized arguments: --world=3"),  # no prefix matching
    ]] + [  # each script's world sizes and own flags
    (script, [f"--world_size={n}"], f"argument --world_size/--world-size: {n} is not in {room}")
    for script, n, room in [
        ("rpc_rnn_model_parallel", 3, "[2, 2]"), ("rpc_parameter_server", 1, "[2, inf]"),
        ("rpc_rl_cartpole", 1, "[2, inf]"), ("ddp_rpc_hybrid", 2, "[3, inf]"),
        ("rpc_batch_parameter_server", 1, "[2, inf]"), ("rpc_batch_cartpole", 1, "[2, inf]")]] + [
    (script, [f"--{flag}={value}"], f"argument --{flag}: {value} is not in {room}")
    for script, flag, value, room in [
        ("rpc_parameter_server", "num_gpus", 3, "[0, 2]"),
        ("rpc_parameter_server", "epochs", 0, "[1, inf]"),
        ("ddp_rpc_hybrid", "epochs", 0, "[1, inf]"),
        ("rpc_rl_cartpole", "gamma", 1.5, "[0, 1]"),
        ("rpc_rl_cartpole", "log_interval", 0, "[1, inf]"),
        ("rpc_rl_cartpole", "max_episodes", -3, "[0, inf]"),
        ("rpc_batch_parameter_server", "batches", 0, "[1, inf]"),
        ("rpc_batch_cartpole", "n_steps", 0, "[1, inf]")]]


@pytest.mark.parametrize("script, argv, problem", CASES,
                         ids=[f"{script}:{' '.join(argv)}" for script, argv, _ in CASES])
def test_a_bad_value_exits_2_naming_the_flag_and_its_range(script, argv, problem, capsys):
    with pytest.raises(SystemExit) as exit_info:
        importlib.import_module(script).parse_args(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("usage: "), err
    assert err.endswith(f": error: {problem}\n"), err


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_explains_every_flag_with_its_default(script, capsys):
    with pytest.raises(SystemExit):
        importlib.import_module(script).parse_args(["--help"])
    out = capsys.readouterr().out
    options = re.split(r"^(?:options|optional arguments):\n", out, flags=re.M)[1].split("\n\n")[0]
    for entry in re.split(r"\n(?=  -)", options)[1:]:  # but -h: flags, a help text, the default
        assert re.fullmatch(r"(-[-\w]+( [A-Z_]+)?,? ?)+ [A-Z(][^()]*(\(.*\))?[^()]*\. "
                            r"\(default: [^()]*\)", " ".join(entry.split())), entry
    assert "--timeout TIMEOUT Seconds to wait (meet: 5x). (default: 60)" in " ".join(out.split())
