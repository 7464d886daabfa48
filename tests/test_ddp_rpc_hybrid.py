import re

import pytest

from conftest import assert_succeeded, summary


@pytest.mark.parametrize("world_size, in_sync", [(4, "true"), (3, "n/a")])
def test_one_command_trainers_learn_in_sync(run, world_size, in_sync):
    # The tutorial's world size 4: two trainers, a master, a parameter server; 3: one trainer.
    proc = run("ddp_rpc_hybrid.py", f"--world_size={world_size}", "--epochs=2").wait()
    assert_succeeded(proc)
    figures = summary(proc.out)
    assert (figures["epochs"], figures["fc_in_sync"]) == ("2", in_sync), proc  # DDP's replicas
    for trainer in range(world_size - 2):  # epochs 0 and 1, learning
        first, last = re.findall(rf"^Training done for epoch \d loss (\S+) \(trainer{trainer}\)$",
                                 proc.out, re.M)
        assert figures[f"trainer{trainer}_loss"] == last and float(last) < float(first) - 0.3, proc
