"""ddp_rpc_hybrid.py: DDP trainers, a master and a parameter server, on CPU."""
import re

from conftest import DDP_EPOCHS, assert_succeeded, summary


def trainer_losses(out, trainer):
    losses = re.findall(rf"^Training done for epoch (\d+) loss (\d+\.\d{{4}}) \(trainer{trainer}\)$", out, re.M)
    assert [int(epoch) for epoch, _ in losses] == list(range(DDP_EPOCHS)), out
    return [float(loss) for _, loss in losses]


def test_one_command_two_trainers_learn_in_sync(shared_runs):
    # The tutorial's world size 4: two trainers, the master, the parameter server. The master prints the Summary.
    proc = shared_runs["ddp 4"]
    assert_succeeded(proc)
    figures = summary(proc.out)
    assert figures["epochs"] == str(DDP_EPOCHS), proc.out
    for trainer in (0, 1):
        losses = trainer_losses(proc.out, trainer)
        assert figures[f"trainer{trainer}_loss"] == f"{losses[-1]:.4f}", proc.out
        assert losses[-1] < losses[0] - 0.3, f"the loss should fall: {losses}"
    assert figures["fc_in_sync"] == "true", proc.out  # the two replicas are equal


def test_one_command_at_the_smallest_world_size(shared_runs):
    # World size 3: one trainer, the master and the parameter server; one replica, none to compare it with.
    proc = shared_runs["ddp 3"]
    assert_succeeded(proc)
    figures = summary(proc.out)
    losses = trainer_losses(proc.out, 0)
    assert figures["trainer0_loss"] == f"{losses[-1]:.4f}" and "trainer1_loss" not in figures, proc.out
    assert losses[-1] < losses[0] - 0.3, f"the loss should fall: {losses}"
    assert figures["fc_in_sync"] == "n/a", proc.out
