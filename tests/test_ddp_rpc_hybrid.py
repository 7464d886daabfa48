"""ddp_rpc_hybrid.py: two DDP trainers, a master and a parameter server, on CPU."""
import re

import torch

from conftest import free_port

import ddp_rpc_hybrid as hybrid

SCRIPT = "ddp_rpc_hybrid.py"
EPOCHS = 4


def flags():
    # The DDP port gets its own free port: --master_port + 1 may be taken.
    return ["--epochs", EPOCHS, "--master_port", free_port(), "--ddp_port", free_port(), "--timeout", 30]


def epoch_losses(out):
    return [float(x) for x in re.findall(r"^Training done for epoch \d+ loss (\d+\.\d{4})$", out, re.M)]


def summary(out):
    found = re.search(r"^Summary: epochs=(\d+) seconds=[\d.]+ trainer0_loss=([\d.]+) trainer1_loss=([\d.]+) "
                      r"fc_norm=[\d.]+ fc_in_sync=(true|false)$", out, re.M)
    assert found, out
    return found.groups()


def test_one_command_two_ddp_trainers_in_sync(run):
    proc = run(SCRIPT, *flags()).wait()
    assert proc.returncode == 0, proc
    losses = epoch_losses(proc.out)
    assert len(losses) == 2 * EPOCHS, proc.out  # from both trainers
    epochs, loss0, loss1, in_sync = summary(proc.out)
    assert int(epochs) == EPOCHS
    assert max(float(loss0), float(loss1)) < min(losses[:2]) - 0.3, f"the loss should fall: {losses}"
    # The master compared the trainers' fc weights: DDP kept the replicas equal.
    assert in_sync == "true"


def test_one_terminal_per_rank(run):
    shared = ["--world_size=4", *flags()]
    ranks = [run(SCRIPT, *shared, f"--rank={rank}") for rank in range(4)]
    for proc in ranks:
        proc.wait()
    assert [proc.returncode for proc in ranks] == [0, 0, 0, 0], ranks
    for trainer in ranks[:2]:
        losses = epoch_losses(trainer.out)
        assert len(losses) == EPOCHS and losses[-1] < losses[0] - 0.3, trainer.out
    assert summary(ranks[2].out)[3] == "true"  # the master (rank 2) reports
    assert not epoch_losses(ranks[2].out + ranks[3].out)


def test_batches_are_embedding_bags_of_learnable_classes():
    indices, offsets, target = next(hybrid.get_next_batch(torch.Generator().manual_seed(0), 1, torch.device("cpu")))
    assert 20 <= len(indices) <= 50 and offsets[0] == 0 and len(offsets) == len(target)
    bags = torch.tensor_split(indices, offsets[1:])
    per_class = hybrid.NUM_EMBEDDINGS // hybrid.NUM_CLASSES
    assert all(1 <= len(bag) <= 10 and bool((bag // per_class == label).all()) for bag, label in zip(bags, target))
