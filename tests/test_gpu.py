"""The GPU paths, where the host has the GPUs a test needs; skipped, saying why, where it has
fewer. Each run is a fresh process: asking torch for the GPUs here forks nothing that used CUDA."""
import pytest

from conftest import IN_PROCESS, ROOT, assert_succeeded, summary

pytestmark = IN_PROCESS


@pytest.fixture
def needs(gpus):
    def at_least(count):
        if gpus < count:
            pytest.skip(f"needs {count} CUDA GPU(s); this host has {gpus}")
    return at_least


def test_parameter_server_puts_the_model_on_one_gpu(run, tiny_mnist, needs):
    needs(1)
    proc = run("rpc_parameter_server.py", "--world_size=3", "--num_gpus=1", "--data_dir", tiny_mnist)
    assert_succeeded(proc.wait())
    assert "Putting first 2 convs on cuda:0\n" in proc.out, proc
    assert "Putting rest of layers on cuda:0\n" in proc.out, proc
    assert proc.out.count("Summary: rank=") == 2, proc


def test_rnn_table_on_the_gpu_trains(run, tmp_path, needs):
    # The table lives on cuda (asked in a fresh process); what it returns crosses RPC on the CPU.
    needs(1)
    (tmp_path / "where.py").write_text("import rpc_rnn_model_parallel as rnn\n"
                                       "print(rnn.EmbeddingTable(10, 2, 0.5).encoder.weight.device)\n")
    assert run(tmp_path / "where.py", env={"PYTHONPATH": str(ROOT)}).wait().out.startswith("cuda")
    assert_succeeded(run("rpc_rnn_model_parallel.py").wait())


@pytest.mark.parametrize("shown", ["0,1", "0"])
def test_ddp_two_trainers_stay_in_sync_with_gpus(run, needs, shown):
    # A GPU each: DDP over the tutorial's Gloo between cuda:0 and cuda:1. One GPU shown to two
    # trainers: trainer 1 has no cuda:1, so both agree on the CPU (DDP needs one device type).
    needs(len(shown.split(",")))
    proc = run("ddp_rpc_hybrid.py", "--epochs=2", env={"CUDA_VISIBLE_DEVICES": shown}).wait()
    assert_succeeded(proc)
    assert summary(proc.out)["fc_in_sync"] == "true", proc
