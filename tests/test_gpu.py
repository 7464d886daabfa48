"""The GPU paths, where the host has the GPUs a test needs; skipped, with the reason, where it has fewer.

torch.cuda.device_count() here does not stop the other tests from starting processes: they never fork the
test process, they exec a fresh Python."""
import subprocess
import sys

import pytest
import torch

from conftest import DDP_EPOCHS, HANG, ROOT, assert_succeeded, summary

GPUS = torch.cuda.device_count()


def needs_gpus(count):
    return pytest.mark.skipif(GPUS < count, reason=f"needs {count} CUDA GPU(s); this host has {GPUS}")


@needs_gpus(1)
def test_parameter_server_puts_the_model_on_one_gpu(run, tiny_mnist):
    proc = run("rpc_parameter_server.py", "--world_size=3", "--num_gpus=1", "--data_dir", tiny_mnist).wait()
    assert_succeeded(proc)
    assert "Putting first 2 convs on cuda:0" in proc.out and "Putting rest of layers on cuda:0" in proc.out, proc
    assert proc.out.count("Summary: rank=") == 2, proc


@needs_gpus(1)
def test_rnn_table_on_the_gpu_trains(run):
    # The table lives on cuda (asked of the class in a fresh process); what it returns crosses RPC on the CPU.
    where = subprocess.run([sys.executable, "-c", "import rpc_rnn_model_parallel as rnn; "
                            "print(rnn.EmbeddingTable(10, 2, 0.5).encoder.weight.device.type)"],
                           cwd=ROOT, capture_output=True, text=True, timeout=HANG)
    assert where.stdout.strip() == "cuda", where
    assert_succeeded(run("rpc_rnn_model_parallel.py").wait())


@needs_gpus(2)
def test_ddp_two_trainers_on_two_gpus_stay_in_sync(run):
    # A GPU for each trainer: DDP over the tutorial's Gloo between cuda:0 and cuda:1.
    proc = run("ddp_rpc_hybrid.py", f"--epochs={DDP_EPOCHS}").wait()
    assert_succeeded(proc)
    assert summary(proc.out)["fc_in_sync"] == "true", proc


@needs_gpus(1)
def test_ddp_two_trainers_and_one_gpu_stay_in_sync(run):
    # One GPU shown for two trainers: trainer 1 has no cuda:1, so both must agree on the CPU (DDP needs one device
    # type in all replicas; a trainer that did not would fail: test_several_machines.py's gpu_host).
    proc = run("ddp_rpc_hybrid.py", f"--epochs={DDP_EPOCHS}", env={"CUDA_VISIBLE_DEVICES": "0"}).wait()
    assert_succeeded(proc)
    assert summary(proc.out)["fc_in_sync"] == "true", proc
