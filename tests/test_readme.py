import importlib
import re
import shlex

import pytest

from conftest import IN_PROCESS, ROOT, SCRIPTS

README = (ROOT / "README.md").read_text()


@IN_PROCESS
def test_the_readmes_commands_are_ci_s_and_the_scripts_flags_parse(user_shell):
    commands = [line.split("#")[0].strip() for block in re.findall(
        r"^```bash\n(.*?)^```", README, re.M | re.S) for line in block.splitlines()]
    runs = [command for command in commands if re.match(r"python (rpc|ddp)_|torchrun ", command)]
    ci = (ROOT / ".ci" / "run").read_text().splitlines()[-3:]  # it installs and tests as we say
    assert set(ci) <= set(commands) and ci[-1] == "python -m pytest", commands
    for script in SCRIPTS:  # each in one command; some one terminal per rank, or in torchrun
        assert any(f"python {script}.py" in command and "--rank" not in command for command in runs)
    assert any("--rank" in run for run in runs) and any("torchrun" in run for run in runs), runs
    for command in runs:  # argparse exits 2 on a flag it does not know
        words = shlex.split(command)
        script = next(word for word in words if word.endswith(".py"))
        importlib.import_module(script[:-3]).parse_args(words[words.index(script) + 1:])


@IN_PROCESS
@pytest.mark.parametrize("script", SCRIPTS)
def test_each_scripts_diagram_names_its_workers_and_its_calls(script):
    # Worker names the script gives; calls and Class.methods it makes or defines.
    section = README.split(f"### `{script}.py`")[1].split("\n#")[0]
    diagram = re.search(r"```mermaid\n(sequenceDiagram\n.*?)```", section, re.S)[1]
    source = (ROOT / f"{script}.py").read_text()
    names = {importlib.import_module(script).worker_name(rank, size)
             for size in range(2, 6) for rank in range(size)}
    assert set(re.findall(r"participant (\w+)", diagram)) <= names, diagram
    for call in re.findall(r"(\w+)\(", diagram):
        assert re.search(rf"\b{call}\(", source), call
    for cls, method in re.findall(r"\b([A-Z]\w*)\.(\w+)", diagram):
        assert f"class {cls}" in source and f"def {method}(" in source, (cls, method)
