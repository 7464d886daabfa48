"""ddp_rpc_hybrid.py: DDP trainers, a master and a parameter server, on CPU."""
import re

import torch

import ddp_rpc_hybrid as hybrid
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
        # Each trainer says where its DDP runs: its own GPU where every trainer has one, else the CPU (and why).
        gpus = torch.cuda.device_count()
        where = "cuda:\\d with nccl" if gpus >= 2 else "cpu with gloo" + " \\(no GPU for trainer1\\)" * (gpus == 1)
        assert re.search(rf"^trainer{trainer}: DDP on {where}$", proc.out, re.M), proc.out
        losses = trainer_losses(proc.out, trainer)
        assert figures[f"trainer{trainer}_loss"] == f"{losses[-1]:.4f}", proc.out
        assert losses[-1] < losses[0] - 0.3, f"the loss should fall: {losses}"
    assert float(figures["fc_norm"]) > 0 and figures["fc_in_sync"] == "true", proc.out


def test_one_command_at_the_smallest_world_size(shared_runs):
    # World size 3: one trainer, the master and the parameter server.
    proc = shared_runs["ddp 3"]
    assert_succeeded(proc)
    figures = summary(proc.out)
    losses = trainer_losses(proc.out, 0)
    assert figures["trainer0_loss"] == f"{losses[-1]:.4f}" and "trainer1_loss" not in figures, proc.out
    assert losses[-1] < losses[0] - 0.3, f"the loss should fall: {losses}"


def test_batches_are_embedding_bags_of_learnable_classes():
    indices, offsets, target = next(hybrid.get_next_batch(torch.Generator().manual_seed(0), 1, torch.device("cpu")))
    assert 20 <= len(indices) <= 50 and offsets[0] == 0 and len(offsets) == len(target)
    bags = torch.tensor_split(indices, offsets[1:])
    per_class = hybrid.NUM_EMBEDDINGS // hybrid.NUM_CLASSES
    assert all(1 <= len(bag) <= 10 and bool((bag // per_class == label).all()) for bag, label in zip(bags, target))


def test_one_trainer_has_no_replica_to_compare(shared_runs):
    # World size 3: the one trainer's replica compared with itself would prove nothing.
    assert summary(shared_runs["ddp 3"].out)["fc_in_sync"] == "n/a", shared_runs["ddp 3"]
