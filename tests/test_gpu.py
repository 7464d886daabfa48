import pytest

from conftest import IN_PROCESS, assert_succeeded

pytestmark = IN_PROCESS


@pytest.mark.parametrize("needs, command, shown, line", [
    (1, ["rpc_parameter_server.py", "--world_size=3", "--num_gpus=1"], "0",
     "Putting rest of layers on cuda:0"),
    (1, ["rpc_rnn_model_parallel.py", "--epochs=2"], "0", "Summary: epochs=2 "),  # a GPU table
    (2, ["ddp_rpc_hybrid.py", "--epochs=2"], "0,1", " fc_in_sync=true"),  # a GPU each
    # One GPU for two trainers: trainer 1 has no cuda:1, so both must agree on the CPU.
    (1, ["ddp_rpc_hybrid.py", "--epochs=2"], "0", " fc_in_sync=true")])
def test_a_gpu_path_trains(run, tmp_path, tiny_mnist, gpus, needs, command, shown, line):
    if gpus < needs:
        pytest.skip(f"needs {needs} CUDA GPU(s); this host has {gpus}")
    (tmp_path / "data").symlink_to(tiny_mnist)  # the parameter server's --data_dir
    proc = run(*command, env={"CUDA_VISIBLE_DEVICES": shown}).wait()
    assert_succeeded(proc)
    assert line in proc.out, proc
