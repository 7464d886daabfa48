"""ddp_rpc_hybrid.py: two DDP trainers, a master and a parameter server, on CPU.

One rank per terminal is tried in test_failures.py, where one of them is killed."""
import re

import torch

import ddp_rpc_hybrid as hybrid

SCRIPT = "ddp_rpc_hybrid.py"
EPOCHS = 4  # as conftest.smoke_runs starts it


def epoch_losses(out, trainer):
    return [float(x) for x in re.findall(rf"^Training done for epoch \d+ loss (\d+\.\d{{4}}) \(trainer{trainer}\)$", out, re.M)]


def summary(out):
    found = re.search(r"^Summary: epochs=(\d+) seconds=[\d.]+ trainer0_loss=([\d.]+) trainer1_loss=([\d.]+) "
                      r"fc_norm=[\d.]+ fc_in_sync=(true|false)$", out, re.M)
    assert found, out
    return found.groups()


def test_one_command_two_ddp_trainers_in_sync(smoke_runs):
    proc = smoke_runs[SCRIPT].wait()
    assert proc.returncode == 0, proc
    epochs, *last_losses, in_sync = summary(proc.out)
    assert int(epochs) == EPOCHS
    for trainer, last in enumerate(last_losses):
        losses = epoch_losses(proc.out, trainer)
        assert len(losses) == EPOCHS and losses[-1] == float(last), proc.out
        assert losses[-1] < losses[0] - 0.3, f"the loss should fall: {losses}"
    # The master compared the trainers' fc weights: DDP kept the replicas equal.
    assert in_sync == "true"


def test_batches_are_embedding_bags_of_learnable_classes():
    indices, offsets, target = next(hybrid.get_next_batch(torch.Generator().manual_seed(0), 1, torch.device("cpu")))
    assert 20 <= len(indices) <= 50 and offsets[0] == 0 and len(offsets) == len(target)
    bags = torch.tensor_split(indices, offsets[1:])
    per_class = hybrid.NUM_EMBEDDINGS // hybrid.NUM_CLASSES
    assert all(1 <= len(bag) <= 10 and bool((bag // per_class == label).all()) for bag, label in zip(bags, target))
