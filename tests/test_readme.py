"""README.md's commands and sample output: every script command it gives parses as written, and the sample
output of the one command that runs here as written, the RNN's, is what the script prints."""
import importlib
import re
import shlex

import pytest

from conftest import ROOT, SCRIPT_FILES

README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"^```(\w*)\n(.*?)^```$", README, re.M | re.S)
COMMANDS = [line.split("#")[0].strip() for kind, block in BLOCKS if kind == "bash" for line in block.splitlines()]
COMMANDS = [command for command in COMMANDS if command]
SCRIPTS = [command for command in COMMANDS if command.startswith(("python rpc_", "python ddp_", "torchrun "))]
# Each script and the flags the README gives it, once: torchrun's commands give none.
ARGUMENTS = sorted({(script, tuple(words[words.index(script) + 1:])) for command in SCRIPTS
                    for words in [shlex.split(command)] for script in words if script.endswith(".py")})


def test_every_command_is_a_known_kind():
    others = set(COMMANDS) - set(SCRIPTS)
    assert others <= {"pip install -r requirements.txt", "pip install pytest psutil", "python -m pytest",
                      "pip install torch torchvision --index-url https://download.pytorch.org/whl/cpu"}, others
    assert "python -m pytest" in COMMANDS  # .ci/run runs the README's test command
    for script in SCRIPT_FILES:  # each with one command, and one terminal per rank, and torchrun
        assert any(script in command and "--rank" not in command and "torchrun" not in command
                   for command in SCRIPTS), script
    assert any("--rank" in command for command in SCRIPTS) and any("torchrun" in command for command in SCRIPTS)


@pytest.mark.parametrize("script, argv", ARGUMENTS, ids=[" ".join([s, *a]) for s, a in ARGUMENTS])
def test_each_scripts_flags_parse(script, argv, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):  # as a user's shell, not torchrun's
        monkeypatch.delenv(name, raising=False)
    importlib.import_module(script[:-3]).parse_args(list(argv))  # argparse exits 2 on a flag that does not exist


def test_a_learner_with_the_batch_tutorials_rpc_timeout_0_is_told_what_to_write():
    # The batch tutorial's launcher passes rpc_timeout=0, with which init_rpc fails: the README says so, and
    # gives the call's own timeout=0 instead.
    section = README.split("### `rpc_batch_parameter_server.py`")[1].split("###")[0]
    assert "`rpc_timeout=0`" in section and "`timeout=0`" in section, section


def test_the_rnn_sample_output_is_what_the_script_prints(shared_runs):
    # The README's RNN command is the smoke run's: its sample lines must be what it prints, to 0.01 in each loss
    # (another CPU may round the last digits otherwise), but for the time it took.
    sample = next(block for kind, block in BLOCKS if not kind and "Training epoch 0 loss" in block)
    printed = [line for line in shared_runs["rnn"].out.splitlines() if line.startswith(("Training", "Summary"))]
    shown = [line for line in sample.splitlines() if line != "..."]
    assert len(shown) > 2 and all(any(close(line, out) for out in printed) for line in shown), (shown, printed)


def close(shown, printed):
    """The same line but for timings, with each other number within 0.01."""
    shown, printed = (re.sub(r"seconds=\S+", "", line) for line in (shown, printed))
    numbers = [re.findall(r"\d+\.\d+|\d+", line) for line in (shown, printed)]
    return (re.sub(r"\d+\.\d+|\d+", "#", shown) == re.sub(r"\d+\.\d+|\d+", "#", printed)
            and all(abs(float(a) - float(b)) <= 0.01 for a, b in zip(*numbers)))
