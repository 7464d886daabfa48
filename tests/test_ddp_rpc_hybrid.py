"""ddp_rpc_hybrid.py: DDP trainers, a master and a parameter server, on CPU."""
import re

import pytest

from conftest import assert_succeeded, summary


def trainer_losses(out, trainer):
    losses = re.findall(rf"^Training done for epoch (\d+) loss (\d\.\d{{4}}) \(trainer{trainer}\)$",
                        out, re.M)
    assert [int(epoch) for epoch, _ in losses] == [0, 1], out
    return [float(loss) for _, loss in losses]


@pytest.mark.parametrize("world_size, in_sync", [(4, "true"), (3, "n/a")],
                         ids=["two trainers", "one trainer"])
def test_one_command_trainers_learn_in_sync(run, world_size, in_sync):
    # The tutorial's world size 4: two trainers, the master, the parameter server; at 3, one
    # trainer, whose replica has none to match. The master prints the Summary.
    proc = run("ddp_rpc_hybrid.py", f"--world_size={world_size}", "--epochs=2").wait()
    assert_succeeded(proc)
    figures = summary(proc.out)
    assert figures["epochs"] == "2" and figures["fc_in_sync"] == in_sync, proc  # DDP's replicas
    assert f"trainer{world_size - 2}_loss" not in figures, proc
    for trainer in range(world_size - 2):
        losses = trainer_losses(proc.out, trainer)
        assert figures[f"trainer{trainer}_loss"] == f"{losses[-1]:.4f}", proc
        assert losses[-1] < losses[0] - 0.3, f"the loss should fall: {proc}"
