"""README.md's commands and sample output: every script command it gives parses as written, and the sample
output of the one command that runs here as written, the RNN's, is what the script prints."""
import importlib
import re
import shlex

import pytest

from conftest import ROOT, summary

README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"^```(\w*)\n(.*?)^```$", README, re.M | re.S)
COMMANDS = [line.split("#")[0].strip() for kind, block in BLOCKS if kind == "bash" for line in block.splitlines()]
COMMANDS = [command for command in COMMANDS if command]
SCRIPTS = [command for command in COMMANDS if command.startswith(("python rpc_", "python ddp_", "torchrun "))]


def test_every_command_is_a_known_kind():
    others = set(COMMANDS) - set(SCRIPTS)
    assert others <= {"pip install -r requirements.txt", "pip install pytest", "python -m pytest",
                      "pip install torch==2.14.1 torchvision==0.29.2 --index-url https://download.pytorch.org/whl/cpu"}, others
    assert "python -m pytest" in COMMANDS  # .ci/run runs the README's test command
    for script in ("rpc_parameter_server.py", "rpc_rl_cartpole.py", "rpc_rnn_model_parallel.py", "ddp_rpc_hybrid.py"):
        assert any(script in command and "--rank" not in command for command in SCRIPTS), script  # one command
    assert any("--rank" in command for command in SCRIPTS) and any("torchrun" in command for command in SCRIPTS)


@pytest.mark.parametrize("command", SCRIPTS)
def test_each_script_command_parses(command, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):  # as a user's shell, not torchrun's
        monkeypatch.delenv(name, raising=False)
    words = shlex.split(command)
    script = next(word for word in words if word.endswith(".py"))
    module = importlib.import_module(script[:-3])
    assert (ROOT / script).exists()
    module.parse_args(words[words.index(script) + 1:])  # argparse exits 2 on a flag that does not exist


def test_the_rnn_sample_output_is_what_the_script_prints(shared_runs):
    # The README's RNN command is the smoke run's: its sample lines (but for the time it took) must be true.
    sample = next(block for kind, block in BLOCKS if not kind and "Training epoch 0 loss" in block)
    printed = shared_runs["rnn"].out.splitlines()
    for line in sample.splitlines():
        if line == "...":
            continue
        if line.startswith("Summary:"):
            assert summary(line, timings=False) == summary("\n".join(printed), timings=False)
        else:
            assert line in printed, line
