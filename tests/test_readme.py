"""README.md's commands: each is of a kind that a test runs, and each script command parses as
written (the RNN's sample output: test_rnn_model_parallel.py)."""
import importlib
import re
import shlex

import pytest

from conftest import IN_PROCESS, ROOT, SCRIPTS

README = (ROOT / "README.md").read_text()
COMMANDS = [line.split("#")[0].strip() for block in re.findall(r"^```bash\n(.*?)^```$", README,
                                                                re.M | re.S)
            for line in block.splitlines() if line.split("#")[0].strip()]
RUNS = [command for command in COMMANDS if command.startswith(("python rpc_", "python ddp_",
                                                                 "torchrun "))]
# Each script and the flags the README gives it, once.
ARGUMENTS = sorted({(word, tuple(words[words.index(word) + 1:])) for command in RUNS
                    for words in [shlex.split(command)] for word in words if word.endswith(".py")})


def test_every_command_is_a_known_kind():
    assert set(COMMANDS) - set(RUNS) <= {
        "pip install -r requirements.txt", "pip install pytest pytest-xdist psutil",
        "python -m pytest", "pip install torch torchvision --index-url "
        "https://download.pytorch.org/whl/cpu"}, COMMANDS
    assert "python -m pytest" in COMMANDS  # .ci/run runs the README's test command
    for script in SCRIPTS:  # each in one command, and some in one terminal per rank and torchrun
        assert any(f"python {script}.py" in command and "--rank" not in command for command in RUNS)
    assert any("--rank" in command for command in RUNS), RUNS
    assert any(command.startswith("torchrun") for command in RUNS), RUNS


@IN_PROCESS
@pytest.mark.parametrize("script, argv", ARGUMENTS, ids=[" ".join([s, *a]) for s, a in ARGUMENTS])
def test_each_scripts_flags_parse(script, argv, user_shell):
    importlib.import_module(script[:-3]).parse_args(list(argv))  # argparse exits 2 on a bad flag


def test_a_learner_with_the_batch_tutorials_rpc_timeout_0_is_told_what_to_write():
    # The batch tutorial's launcher passed rpc_timeout=0, with which init_rpc fails: the README says
    # so, and gives the call's own timeout=0 instead.
    section = README.split("### `rpc_batch_parameter_server.py`")[1].split("###")[0]
    assert "`rpc_timeout=0`" in section and "`timeout=0`" in section, section
