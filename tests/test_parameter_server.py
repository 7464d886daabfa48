"""rpc_parameter_server.py: run as a user would, with two trainers on tiny MNIST."""
import re
import shutil

import pytest
import torch

import rpc_parameter_server as ps
from conftest import MNIST_BATCH_SIZE, MNIST_LOG_INTERVAL, MNIST_TRAIN, PS_EPOCHS, assert_no_traceback, in_rpc_group

SCRIPT = "rpc_parameter_server.py"


def test_one_command_with_two_trainers(smoke_runs):
    # World size 3: the tutorial's code would crash here as soon as one
    # trainer steps while the other is between forward and backward.
    proc = smoke_runs[SCRIPT]
    assert proc.returncode == 0, proc
    assert_no_traceback(proc.err)
    batches = MNIST_TRAIN // MNIST_BATCH_SIZE  # per epoch
    for rank in (1, 2):
        # Each rank's own loss lines, whole and in order: a line every MNIST_LOG_INTERVAL batches of every epoch.
        logged = re.findall(rf"^Rank {rank} training batch (\d+) loss \d+\.\d{{4}} epoch (\d+)$", proc.out, re.M)
        assert logged == [(str(batch), str(epoch)) for epoch in range(PS_EPOCHS)
                          for batch in range(0, batches, MNIST_LOG_INTERVAL)], proc.out
        assert re.search(rf"^Summary: rank={rank} batches={PS_EPOCHS * batches} seconds=[\d.]+ ms_per_batch=[\d.]+ "
                         rf"accuracy=[\d.]+$", proc.out, re.M), proc.out
    assert proc.out.count("Training complete!") == 2 and proc.out.count("Summary:") == 2
    assert len(re.findall(r"^Accuracy (0\.\d{4}|1\.0000)$", proc.out, re.M)) == 2
    assert "RPC shutdown on parameter server." in proc.out
    ps.Net().load_state_dict(torch.load(proc.cwd / "model.pt"))  # the saved weights fit the tutorial's Net


def test_missing_data_is_explained(tmp_path, capsys):
    # The one-command form checks the data before it starts any rank; a lone
    # trainer (--rank) raises the same message from the same load_mnist.
    assert ps.main(["--world_size=2", "--data_dir", str(tmp_path / "nowhere"), "--no-download"]) == 1
    message = capsys.readouterr().err
    assert str(tmp_path / "nowhere" / "MNIST" / "raw") in message
    for name in ps.MNIST_FILES:
        assert name in message
    assert "--no-download forbids fetching it" in message
    assert_no_traceback(message)


def test_unreadable_data_is_explained(tiny_mnist, tmp_path):
    # Not a network problem: a file cut short (an interrupted copy), with or without --download, and a
    # --data_dir that is a file.
    shutil.copytree(tiny_mnist, tmp_path / "cut")
    images = tmp_path / "cut" / "MNIST" / "raw" / "train-images-idx3-ubyte"
    images.write_bytes(images.read_bytes()[:1000])
    for download in ("--download", "--no-download"):
        args = ps.parse_args(["--rank=1", download, "--data_dir", str(tmp_path / "cut")])
        with pytest.raises(ps.RankFailure, match=r"^MNIST in .*/cut/MNIST/raw could not be read \(shape .*\): one of "
                                                 r"its four files is truncated or damaged"):
            ps.load_mnist(args, rank=1)
    (tmp_path / "a_file").touch()
    args = ps.parse_args(["--rank=1", "--data_dir", str(tmp_path / "a_file")])
    with pytest.raises(ps.RankFailure, match=r"^MNIST could not be read or written in .*/a_file/MNIST/raw \(Not a "
                                             r"directory: .*\)\. Check that folder's permissions and free space"):
        ps.load_mnist(args, rank=1)


@in_rpc_group
def test_get_accuracy_evaluates_the_remote_model_in_eval_mode():
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
