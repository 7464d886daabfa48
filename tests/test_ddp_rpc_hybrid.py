"""ddp_rpc_hybrid.py: two DDP trainers, a master and a parameter server, on CPU.

One rank per terminal is tried in test_failures.py, where one of them is killed."""
import re

import torch

import ddp_rpc_hybrid as hybrid
from conftest import DDP_EPOCHS, assert_no_traceback, summary

SCRIPT = "ddp_rpc_hybrid.py"


def test_one_command_two_ddp_trainers_in_sync(smoke_runs):
    proc = smoke_runs[SCRIPT]
    assert proc.returncode == 0, proc
    assert_no_traceback(proc.err)
    figures = summary(proc.out)
    assert figures["epochs"] == str(DDP_EPOCHS), proc.out
    for trainer in (0, 1):
        losses = re.findall(rf"^Training done for epoch (\d+) loss (\d+\.\d{{4}}) \(trainer{trainer}\)$", proc.out, re.M)
        assert [int(epoch) for epoch, _ in losses] == list(range(DDP_EPOCHS)), proc.out
        losses = [float(loss) for _, loss in losses]
        assert figures[f"trainer{trainer}_loss"] == f"{losses[-1]:.4f}", proc.out
        assert losses[-1] < losses[0] - 0.3, f"the loss should fall: {losses}"
    # The master compared the trainers' fc weights: DDP kept the replicas equal.
    assert float(figures["fc_norm"]) > 0 and figures["fc_in_sync"] == "true", proc.out
    # Each trainer says where its DDP group runs, once the group is up: a GPU each where the host has two.
    for trainer in (0, 1):
        where = f"cuda:{trainer} with nccl" if torch.cuda.device_count() >= 2 else "cpu with gloo"
        assert re.search(rf"^trainer{trainer}: DDP on {where}$", proc.out, re.M), proc.out


def test_batches_are_embedding_bags_of_learnable_classes():
    indices, offsets, target = next(hybrid.get_next_batch(torch.Generator().manual_seed(0), 1, torch.device("cpu")))
    assert 20 <= len(indices) <= 50 and offsets[0] == 0 and len(offsets) == len(target)
    bags = torch.tensor_split(indices, offsets[1:])
    per_class = hybrid.NUM_EMBEDDINGS // hybrid.NUM_CLASSES
    assert all(1 <= len(bag) <= 10 and bool((bag // per_class == label).all()) for bag, label in zip(bags, target))
