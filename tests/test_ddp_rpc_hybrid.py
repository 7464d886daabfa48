"""ddp_rpc_hybrid.py: DDP trainers, a master and a parameter server, on CPU.

The tutorial's world size 4 (two trainers) runs one rank per network namespace in test_failures.py."""
import re

import torch

import ddp_rpc_hybrid as hybrid
from conftest import DDP_EPOCHS, assert_succeeded, summary

SCRIPT = "ddp_rpc_hybrid.py"


def test_the_smallest_world_size(shared_runs):
    # One rank per process: trainer 0, the master, the parameter server. The master prints the Summary.
    ranks = shared_runs[SCRIPT]
    assert_succeeded(*ranks)
    proc = ranks[0]
    figures = summary(ranks[1].out)
    assert figures["epochs"] == str(DDP_EPOCHS), proc.out
    for trainer in (0,):  # world size 3: one trainer, the master and the parameter server
        losses = re.findall(rf"^Training done for epoch (\d+) loss (\d+\.\d{{4}}) \(trainer{trainer}\)$", proc.out, re.M)
        assert [int(epoch) for epoch, _ in losses] == list(range(DDP_EPOCHS)), proc.out
        losses = [float(loss) for _, loss in losses]
        assert figures[f"trainer{trainer}_loss"] == f"{losses[-1]:.4f}", proc.out
        assert losses[-1] < losses[0] - 0.3, f"the loss should fall: {losses}"
    assert float(figures["fc_norm"]) > 0 and figures["fc_in_sync"] == "true", proc.out
    # The trainer says where its DDP group runs, once the group is up: a GPU where the host has one.
    where = "cuda:0 with nccl" if torch.cuda.device_count() >= 1 else "cpu with gloo"
    assert re.search(rf"^trainer0: DDP on {where}$", proc.out, re.M), proc.out
    assert "Summary:" not in proc.out + ranks[2].out


def test_batches_are_embedding_bags_of_learnable_classes():
    indices, offsets, target = next(hybrid.get_next_batch(torch.Generator().manual_seed(0), 1, torch.device("cpu")))
    assert 20 <= len(indices) <= 50 and offsets[0] == 0 and len(offsets) == len(target)
    bags = torch.tensor_split(indices, offsets[1:])
    per_class = hybrid.NUM_EMBEDDINGS // hybrid.NUM_CLASSES
    assert all(1 <= len(bag) <= 10 and bool((bag // per_class == label).all()) for bag, label in zip(bags, target))
