"""rpc_parameter_server.py: run as a user would, at world size 2 and 3 on tiny MNIST."""
import re

import torch

from conftest import alone_in_rpc, free_port

import rpc_parameter_server as ps

SCRIPT = "rpc_parameter_server.py"


def tiny_flags(mnist_root, port, *extra):
    return ["--data_dir", mnist_root, "--no-download", "--batch_size", 8, "--log_interval", 2,
            "--master_port", port, "--timeout", 30, *extra]


def assert_trainer_output(out, rank):
    assert f"Rank {rank} training batch 0 loss " in out
    assert f"Rank {rank} training batch 2 loss " in out
    assert "Training complete!" in out and "Getting accuracy...." in out
    assert re.search(r"^Accuracy 0\.\d{4}$|^Accuracy 1\.0000$", out, re.M)
    summary = re.search(rf"^Summary: rank={rank} batches=8 seconds=[\d.]+ ms_per_batch=[\d.]+ accuracy=[\d.]+$", out, re.M)
    assert summary, out


def test_one_command_with_two_trainers(run, tiny_mnist, tmp_path):
    # World size 3: one command, and the tutorial's code would crash here as
    # soon as one trainer steps while the other is between forward and backward.
    model_path = tmp_path / "model.pt"
    proc = run(SCRIPT, "--world_size", 3, *tiny_flags(tiny_mnist, free_port(), "--save_model", model_path)).wait()
    assert proc.returncode == 0, proc
    for rank in (1, 2):
        assert_trainer_output(proc.out, rank)
    assert proc.out.count("Summary:") == 2
    assert "RPC shutdown on parameter server." in proc.out
    ps.Net().load_state_dict(torch.load(model_path))  # the saved weights fit the tutorial's Net


def test_one_terminal_per_rank(run, tiny_mnist):
    port = free_port()
    server = run(SCRIPT, "--world_size=2", "--rank=0", *tiny_flags(tiny_mnist, port))
    trainer = run(SCRIPT, "--world_size=2", "--rank=1", *tiny_flags(tiny_mnist, port))
    trainer.wait(), server.wait()
    assert trainer.returncode == 0, trainer
    assert server.returncode == 0, server
    assert_trainer_output(trainer.out, 1)
    assert "RPC initialized! Running parameter server..." in server.out
    assert "RPC shutdown on parameter server." in server.out


def test_missing_data_is_explained(tmp_path, capsys):
    # The one-command form checks the data before it starts any rank; a lone
    # trainer (--rank) raises the same message from the same load_mnist.
    assert ps.main(["--world_size=2", "--data_dir", str(tmp_path / "nowhere"), "--no-download"]) == 1
    message = capsys.readouterr().err
    assert str(tmp_path / "nowhere" / "MNIST" / "raw") in message
    for name in ps.MNIST_FILES:
        assert name in message
    assert "--download" in message
    assert "Traceback" not in message


def check_get_accuracy_evaluates_in_eval_mode():
    torch.manual_seed(0)
    net = ps.TrainerNet()
    batch = torch.randn(16, 1, 28, 28)
    net.train()
    assert not torch.equal(net(batch), net(batch)), "dropout should be on while training"

    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(batch, torch.zeros(16, dtype=torch.long)), batch_size=8)
    ps.get_accuracy(loader, net)
    assert ps.param_server.model.training is False, "get_accuracy's forward passes ran the remote model in train mode"
    assert torch.equal(net(batch), net(batch)), "the same batch must give the same output in evaluation"


def test_get_accuracy_evaluates_the_remote_model_in_eval_mode():
    alone_in_rpc(ps.PS_NAME, check_get_accuracy_evaluates_in_eval_mode)
