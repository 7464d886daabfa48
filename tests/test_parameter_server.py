"""rpc_parameter_server.py on tiny MNIST: one command with one trainer, one terminal per rank with one and with two."""
import re
import shutil

import pytest
import torch

import rpc_parameter_server as ps
from conftest import MNIST_BATCH_SIZE, MNIST_LOG_INTERVAL, MNIST_TRAIN, PS_EPOCHS, assert_succeeded, in_rpc_group, summary


def loss_lines(out, rank):
    """(batch, epoch) of each of the rank's loss lines, whole and in order."""
    return re.findall(rf"^Rank {rank} training batch (\d+) loss \d+\.\d{{4}} epoch (\d+)$", out, re.M)


def test_one_command_learns(shared_runs):
    # World size 2: the parameter server and one trainer, both started by torch.multiprocessing.
    proc = shared_runs["ps"]
    assert_succeeded(proc)
    batches = MNIST_TRAIN // MNIST_BATCH_SIZE  # per epoch
    # A line every MNIST_LOG_INTERVAL batches of every epoch.
    assert loss_lines(proc.out, 1) == [(str(batch), str(epoch)) for epoch in range(PS_EPOCHS)
                                       for batch in range(0, batches, MNIST_LOG_INTERVAL)], proc.out
    for line in ("PS master initializing RPC", "RPC initialized! Running parameter server...",
                 "Worker rank 1 initializing RPC", "Training complete!", "Getting accuracy....",
                 "RPC shutdown on parameter server."):
        assert line in proc.out.splitlines(), proc.out
    figures = summary(proc.out)
    assert figures["rank"] == "1" and figures["batches"] == str(PS_EPOCHS * batches), proc.out
    assert f"Accuracy {figures['accuracy']}" in proc.out.splitlines(), proc.out
    losses = [float(loss) for loss in re.findall(r"^Rank 1 training batch \d+ loss (\d+\.\d{4})", proc.out, re.M)]
    assert losses[-1] < losses[0] / 2 and float(figures["accuracy"]) >= 0.5, f"it should learn: {proc.out}"


def test_one_trainer_same_seed_same_numbers(shared_runs):
    # One trainer drives the parameter server alone: one terminal per rank prints the one-command run's numbers.
    (server, trainer), one_command = shared_runs["ps ranks"], shared_runs["ps"]
    assert_succeeded(server, trainer)
    assert "Summary:" not in server.out, server  # the trainer's terminal shows the training
    assert loss_lines(trainer.out, 1) and re.findall(r"^Rank 1 training batch .*$", trainer.out, re.M) == \
        re.findall(r"^Rank 1 training batch .*$", one_command.out, re.M), (trainer, one_command)
    assert summary(trainer.out, timings=False) == summary(one_command.out, timings=False)


def test_two_trainers(shared_runs):
    # World size 3: the tutorial's code would crash here as soon as one trainer steps while the other is
    # between forward and backward.
    ranks = shared_runs["ps 3 ranks"]
    assert_succeeded(*ranks)
    batches = MNIST_TRAIN // MNIST_BATCH_SIZE
    for rank in (1, 2):
        assert len(loss_lines(ranks[rank].out, rank)) == PS_EPOCHS * batches // MNIST_LOG_INTERVAL, ranks[rank]
        assert re.search(r"^Accuracy (0\.\d{4}|1\.0000)$", ranks[rank].out, re.M), ranks[rank]
        assert summary(ranks[rank].out)["batches"] == str(PS_EPOCHS * batches), ranks[rank]
    ps.Net().load_state_dict(torch.load(ranks[0].cwd / "model.pt"))  # the saved weights fit the tutorial's Net


def test_missing_or_unreadable_data_is_explained(tiny_mnist, tmp_path):
    # One line that says where MNIST was looked for, and why it could not be loaded: missing with --no-download,
    # a file cut short (an interrupted copy), a --data_dir that is a file.
    args = ps.parse_args(["--rank=1", "--no-download", "--data_dir", str(tmp_path / "nowhere")])
    with pytest.raises(RuntimeError, match=r"^MNIST could not be loaded from .*/nowhere/MNIST/raw \(Dataset not "
                                           r"found.*\): put its four files there, or point --data_dir"):
        ps.load_mnist(args, rank=1)
    assert not (tmp_path / "nowhere").exists()  # --no-download leaves no folder behind
    shutil.copytree(tiny_mnist, tmp_path / "cut")
    images = tmp_path / "cut" / "MNIST" / "raw" / "train-images-idx3-ubyte"
    images.write_bytes(images.read_bytes()[:1000])
    args = ps.parse_args(["--rank=1", "--no-download", "--data_dir", str(tmp_path / "cut")])
    with pytest.raises(RuntimeError, match=r"^MNIST could not be loaded from .*/cut/MNIST/raw \(shape "):
        ps.load_mnist(args, rank=1)
    (tmp_path / "a_file").touch()
    args = ps.parse_args(["--rank=1", "--data_dir", str(tmp_path / "a_file")])  # --download makes the folder
    with pytest.raises(RuntimeError, match=r"^MNIST could not be loaded from .*/a_file/MNIST/raw \(.*Not a dir"):
        ps.load_mnist(args, rank=1)


def check_get_accuracy_evaluates_the_remote_model_in_eval_mode():
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
    in_rpc_group(check_get_accuracy_evaluates_the_remote_model_in_eval_mode)
