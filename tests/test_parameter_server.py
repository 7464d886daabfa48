"""rpc_parameter_server.py on tiny MNIST: one command with one trainer, and one terminal per rank (two trainers:
tests/learner.py)."""
import re
from pathlib import Path

from conftest import MNIST_TRAIN, PS_EPOCHS, assert_succeeded, summary

BATCHES = MNIST_TRAIN // 32  # a trainer's batches in an epoch, at the tutorial's batch size


def loss_lines(out, rank):
    """Each of the rank's loss lines, whole and in order: (batch, loss)."""
    return re.findall(rf"^Rank {rank} training batch (\d+) loss (\d+\.\d{{4}})$", out, re.M)


def test_one_command_learns(shared_runs):
    # World size 2: the parameter server and one trainer, both started by torch.multiprocessing.
    proc = shared_runs["ps"]
    assert_succeeded(proc)
    lines = loss_lines(proc.out, 1)
    # A line every 5 batches of every epoch, as the tutorial's.
    assert [int(batch) for batch, _ in lines] == list(range(0, BATCHES, 5)) * PS_EPOCHS, proc.out
    for line in ("PS master initializing RPC", "RPC initialized! Running parameter server...",
                 "Worker rank 1 initializing RPC", "Training complete!", "Getting accuracy....",
                 "RPC shutdown on parameter server."):
        assert line in proc.out.splitlines(), proc.out
    figures = summary(proc.out)
    assert figures["rank"] == "1" and figures["batches"] == str(PS_EPOCHS * BATCHES), proc.out
    assert f"Accuracy {figures['accuracy']}" in proc.out.splitlines(), proc.out
    losses = [float(loss) for _, loss in lines]
    assert losses[-1] < losses[0] / 2 and float(figures["accuracy"]) >= 0.5, f"it should learn: {proc.out}"


def test_one_trainer_same_seed_same_numbers(shared_runs):
    # One trainer drives the parameter server alone: one terminal per rank prints the one-command run's numbers
    # (for the one epoch that it trains), whether the trainer's loader has workers or not.
    (server, trainer), one_command = shared_runs["ps ranks"], shared_runs["ps"]
    assert_succeeded(server, trainer)
    assert "Summary:" not in server.out, server  # the trainer's terminal shows the training
    epoch = loss_lines(trainer.out, 1)
    assert epoch and epoch == loss_lines(one_command.out, 1)[:len(epoch)], (trainer, one_command)


def test_a_data_loader_with_workers_in_a_one_command_rank(shared_runs):
    # A learner's change: the trainers load MNIST with two worker processes. Each rank of a one-command run may
    # start processes of its own.
    assert_succeeded(shared_runs["ps"])
    assert "num_workers=2" in Path(shared_runs["ps"].proc.args[1]).read_text()
