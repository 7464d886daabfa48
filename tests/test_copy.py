"""A learner copies the tutorial's classes and helpers into a program of their own (tests/learner.py): each takes
the tutorial's own call, and none needs the plumbing."""
import re

import pytest
import torch

import ddp_rpc_hybrid as hybrid
from conftest import SCRIPT_FILES, assert_succeeded, in_rpc_group

@pytest.mark.parametrize("script", SCRIPT_FILES)
def test_a_copied_class_takes_the_tutorials_call(script, shared_runs):
    proc = shared_runs[f"copy {script}"]
    assert proc.returncode == 0, proc.err  # the whole of it: the cause may be far from the end
    assert_succeeded(proc)
    assert re.findall(r"^Copied: pattern=(\w+)", proc.out, re.M) == [script[:-3].removeprefix("rpc_")], proc


def check_hybrid_model_takes_a_rank_a_string_or_a_device():
    # The tutorial passes a rank (cuda:rank); a learner may pass "cpu" or a torch.device. Where CUDA is, a rank is
    # its GPU; here, the CPU.
    store = torch.distributed.HashStore()  # a group of one: DDP needs a process group
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    table = hybrid.RemoteModule("parameter_server", torch.nn.EmbeddingBag, args=(hybrid.NUM_EMBEDDINGS,
                                hybrid.EMBEDDING_DIM), kwargs={"mode": "sum"})
    rank_device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    for device, expected in ((0, rank_device), ("cpu", torch.device("cpu")), (torch.device("cpu"), "cpu")):
        model = hybrid.HybridModel(table, device)
        assert model.device == torch.device(expected)
        out = model(torch.tensor([1, 2, 3, 4]), torch.tensor([0, 2]))
        assert out.shape == (2, hybrid.NUM_CLASSES)


def test_hybrid_model_takes_a_rank_a_string_or_a_device():
    in_rpc_group(check_hybrid_model_takes_a_rank_a_string_or_a_device)
