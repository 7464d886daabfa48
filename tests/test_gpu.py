"""The GPU paths, where the host has the GPUs a test needs; skipped, with the reason, where it has fewer.

torch.cuda.device_count() here does not stop the other tests from starting
processes: they never fork the test process, they spawn or exec."""
import re

import pytest
import torch

from conftest import DDP_EPOCHS, assert_no_traceback, free_port, in_rpc_group, summary, tiny_mnist_flags

GPUS = torch.cuda.device_count()


def needs_gpus(count):
    return pytest.mark.skipif(GPUS < count, reason=f"needs {count} CUDA GPU(s); this host has {GPUS}")


@needs_gpus(1)
def test_parameter_server_with_one_gpu(run, tiny_mnist):
    proc = run("rpc_parameter_server.py", "--world_size=3", "--num_gpus=1", "--timeout", 60,
               *tiny_mnist_flags(tiny_mnist)).wait()
    assert proc.returncode == 0, proc
    assert_no_traceback(proc.err)
    assert "Putting first 2 convs on cuda:0" in proc.out and "Putting rest of layers on cuda:0" in proc.out, proc
    assert proc.out.count("Summary: rank=") == 2, proc


def check_rnn_embedding_table_on_cuda():
    import rpc_rnn_model_parallel as rnn

    table = rnn.EmbeddingTable(ntoken=10, ninp=4, dropout=0.0, seed=0)
    assert table.encoder.weight.device.type == "cuda"
    out = table(torch.tensor([[1, 2, 3]]))
    assert out.device.type == "cpu" and out.shape == (1, 3, 4)  # moved back before it travels over RPC


@needs_gpus(1)
def test_rnn_embedding_table_on_cuda():
    in_rpc_group(check_rnn_embedding_table_on_cuda)  # spawned: this test process never touches CUDA


def ddp_one_command(run, **env):
    """DDP at the tutorial's world size 4, one command with `env` added: it succeeds, its replicas in sync."""
    proc = run("ddp_rpc_hybrid.py", "--world_size=4", f"--epochs={DDP_EPOCHS}", "--timeout", 60, env=env).wait()
    assert proc.returncode == 0, proc
    assert_no_traceback(proc.err)
    assert summary(proc.out)["fc_in_sync"] == "true", proc
    return proc


@needs_gpus(2)  # two trainers, so that NCCL really carries DDP's gradients between two GPUs
def test_ddp_one_trainer_per_gpu_over_nccl_in_sync(run):
    proc = ddp_one_command(run)
    for trainer in (0, 1):
        assert re.search(rf"^trainer{trainer}: DDP on cuda:{trainer} with nccl$", proc.out, re.M), proc


@needs_gpus(2)
def test_ddp_one_command_gives_each_trainer_its_own_gpu_whatever_local_rank_says(run):
    # Started from a shell or a job that set LOCAL_RANK: a one-command run still numbers its trainers by rank.
    proc = ddp_one_command(run, LOCAL_RANK="0")
    for trainer in (0, 1):
        assert re.search(rf"^trainer{trainer}: DDP on cuda:{trainer} with nccl$", proc.out, re.M), proc


@needs_gpus(2)
def test_ddp_trainers_on_two_hosts_each_use_their_own_hosts_gpu(run):
    # Two hosts with one GPU each (CUDA_VISIBLE_DEVICES shows each trainer a GPU of its own as cuda:0), a trainer
    # on each, started by hand with LOCAL_RANK=0 as torchrun sets it on each host: two trainers, one GPU per
    # host, yet both train on their GPU over NCCL.
    common = ["--world_size=4", "--master_port", free_port(), f"--epochs={DDP_EPOCHS}", "--timeout", 60]
    ranks = [run("ddp_rpc_hybrid.py", *common, f"--rank={rank}",
                 env={"CUDA_VISIBLE_DEVICES": str(rank) if rank < 2 else "", "LOCAL_RANK": "0"}) for rank in range(4)]
    for proc in ranks:
        proc.wait()
        assert proc.returncode == 0, proc
        assert_no_traceback(proc.err)
    for trainer in (0, 1):
        assert re.search(rf"^trainer{trainer}: DDP on cuda:0 with nccl$", ranks[trainer].out, re.M), ranks[trainer]
    assert summary(ranks[2].out)["fc_in_sync"] == "true", ranks[2]  # rank 2, the master


@needs_gpus(1)
def test_ddp_a_trainer_without_its_gpu_puts_every_trainer_on_the_cpu(run):
    # One GPU shown: trainer0 has cuda:0, trainer1 no cuda:1. DDP needs one device type: both use the CPU and Gloo.
    proc = ddp_one_command(run, CUDA_VISIBLE_DEVICES="0")
    for trainer in (0, 1):
        assert re.search(rf"^trainer{trainer}: DDP on cpu with gloo \(no GPU for trainer1\)$", proc.out, re.M), proc
