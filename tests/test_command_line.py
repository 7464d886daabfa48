"""Bad arguments: exit 2, a short usage line and one line naming the problem; --help says which flags must agree."""
import importlib

import pytest

CASES = [
    # the common flags, in every script
    *[(module, argv, problem) for module in ("rpc_parameter_server", "rpc_rl_cartpole", "rpc_rnn_model_parallel",
                                             "ddp_rpc_hybrid")
      for argv, problem in [
          (["--world_size=3", "--rank=3"], "--rank must be in [0, 3) for --world_size 3, got 3"),
          (["--rank=-1"], "--rank must be in [0, "),
          (["--timeout=0"], "argument --timeout: must be positive, got 0"),
          (["--master_port=70000"], "--master_port must be in 1..65535, got 70000"),
      ]],
    # world sizes too small for the roles, and each script's own flags
    ("rpc_parameter_server", ["--world_size=1"], "--world_size must be at least 2 (one parameter server and at least one trainer)"),
    ("rpc_parameter_server", ["--num_gpus=3"], "--num_gpus must be between 0 and 2, got 3"),
    ("rpc_parameter_server", ["--batch_size=0"], "argument --batch_size: must be positive, got 0"),
    ("rpc_parameter_server", ["--epoch=1"], "unrecognized arguments: --epoch=1"),  # no prefix matching
    ("rpc_parameter_server", ["--train_samples=-5"], "--train_samples must be 0 (all) or positive, got -5"),
    ("rpc_rl_cartpole", ["--world_size=1"], "--world_size must be at least 2 (one agent and at least one observer)"),
    ("rpc_rl_cartpole", ["--max_episodes=-1"], "--max_episodes must be 0 (until solved) or positive, got -1"),
    ("rpc_rl_cartpole", ["--gamma=0"], "--gamma must be in (0, 1], got 0.0"),
    ("rpc_rnn_model_parallel", ["--world_size=3"], "--world_size must be 2 (the tutorial's parameter server and one trainer), got 3"),
    ("rpc_rnn_model_parallel", ["--nhid=0"], "argument --nhid: must be positive, got 0"),
    ("rpc_rnn_model_parallel", ["--epochs=0"], "argument --epochs: must be positive, got 0"),  # README's example
    ("rpc_rnn_model_parallel", ["--nhid=x"], "argument --nhid: invalid positive value: 'x'"),
    ("rpc_rnn_model_parallel", ["--dropout=1"], "--dropout must be in [0, 1), got 1.0"),
    ("ddp_rpc_hybrid", ["--world_size=2"], "--world_size must be at least 3 (at least one trainer, the master and the parameter server)"),
    ("ddp_rpc_hybrid", ["--ddp_port=29600"], "unrecognized arguments: --ddp_port=29600"),  # DDP meets on --master_port
    ("ddp_rpc_hybrid", ["--batches_per_epoch=0"], "argument --batches_per_epoch: must be positive, got 0"),
]


@pytest.mark.parametrize("module, argv, problem", CASES, ids=[f"{m}:{' '.join(a)}" for m, a, _ in CASES])
def test_bad_arguments_exit_2(module, argv, problem, capsys, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):  # as if not started by torchrun
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit) as exit_info:
        importlib.import_module(module).main(argv)
    assert exit_info.value.code == 2
    usage, error = capsys.readouterr().err.strip().splitlines()  # two lines, not argparse's whole synopsis
    assert usage.startswith("usage: ") and usage.endswith(" [flags]   (--help lists them)")
    assert f": error: {problem}" in error and len(error) < 200


@pytest.mark.parametrize("module", sorted({module for module, _, _ in CASES}))
def test_help_says_which_flags_must_agree(module, capsys):
    with pytest.raises(SystemExit) as exit_info:
        importlib.import_module(module).main(["--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the text to the terminal's width
    assert "start every rank with the same flags; only --rank, --master_addr, --ifname, --timeout and --debug" in text
