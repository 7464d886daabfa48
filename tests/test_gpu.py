"""The GPU paths, where the host has GPUs; skipped, with the reason, where it has none.

torch.cuda.device_count() here does not stop the other tests from starting
processes: they never fork the test process, they spawn or exec."""
import re

import pytest
import torch

from conftest import tiny_mnist_flags

GPUS = torch.cuda.device_count()
needs_gpu = pytest.mark.skipif(GPUS == 0, reason="no CUDA GPU on this host")


@needs_gpu
def test_parameter_server_with_one_gpu(run, tiny_mnist):
    proc = run("rpc_parameter_server.py", "--world_size=3", "--num_gpus=1", "--timeout", 60,
               *tiny_mnist_flags(tiny_mnist)).wait()
    assert proc.returncode == 0, proc
    assert "Putting first 2 convs on cuda:0" in proc.out and "Putting rest of layers on cuda:0" in proc.out, proc
    assert proc.out.count("Summary: rank=") == 2, proc


def check_embedding_table_on_cuda():
    import rpc_rnn_model_parallel as rnn

    table = rnn.EmbeddingTable(ntoken=10, ninp=4, dropout=0.0)
    assert table.encoder.weight.device.type == "cuda"
    out = table(torch.tensor([[1, 2, 3]]))
    assert out.device.type == "cpu" and out.shape == (1, 3, 4)  # moved back before it travels over RPC


@needs_gpu
def test_rnn_embedding_table_on_cuda(alone_in_rpc):
    alone_in_rpc(check_embedding_table_on_cuda)


@needs_gpu
def test_ddp_one_trainer_per_gpu_over_nccl_in_sync(run):
    trainers = min(GPUS, 2)
    proc = run("ddp_rpc_hybrid.py", f"--world_size={trainers + 2}", "--epochs", 4, "--timeout", 60).wait()
    assert proc.returncode == 0, proc
    assert "All trainers train on CPU" not in proc.out, proc
    assert re.search(r"fc_in_sync=true$", proc.out, re.M), proc
