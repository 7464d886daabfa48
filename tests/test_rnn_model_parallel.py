"""rpc_rnn_model_parallel.py: the RNN split between a parameter server and a trainer."""
import re

import torch.nn as nn
from torch.distributed.rpc import PyRRef  # RRefs that come back over RPC are PyRRef, the base of RRef

from conftest import alone_in_rpc, free_port

import rpc_rnn_model_parallel as rnn

SCRIPT = "rpc_rnn_model_parallel.py"


def epoch_losses(out):
    return [float(x) for x in re.findall(r"^Training epoch \d+ loss (\d+\.\d{4})$", out, re.M)]


def assert_learns(trainer_out, epochs=4):
    losses = epoch_losses(trainer_out)
    assert len(losses) == epochs, trainer_out
    assert losses[-1] < losses[0] - 0.1, f"the loss should fall: {losses}"
    assert re.search(rf"^Summary: epochs={epochs} seconds=[\d.]+ final_loss={losses[-1]:.4f}$", trainer_out, re.M)


def test_one_command(run):
    proc = run(SCRIPT, "--epochs", 4, "--master_port", free_port(), "--timeout", 30).wait()
    assert proc.returncode == 0, proc
    assert_learns(proc.out)


def test_one_terminal_per_rank(run):
    flags = ["--world_size=2", "--epochs", 4, "--master_port", free_port(), "--timeout", 30]
    ps, trainer = run(SCRIPT, *flags, "--rank=0"), run(SCRIPT, *flags, "--rank=1")
    trainer.wait(), ps.wait()
    assert ps.returncode == 0 and trainer.returncode == 0, (ps, trainer)
    assert_learns(trainer.out)
    assert "Training epoch" not in ps.out


def check_parameter_rrefs_cover_all_three_parts():
    # This process is "ps": the embedding table and decoder are created here.
    model = rnn.RNNModel(rnn.PS_NAME, ntoken=10, ninp=4, nhid=6, nlayers=2, dropout=0.0)
    rrefs = model.parameter_rrefs()
    parts = [model.emb_table_rref.local_value(), model.rnn, model.decoder_rref.local_value()]
    expected = [p for part in parts for p in part.parameters()]
    assert len(rrefs) == len(expected) == 1 + 4 * 2 + 2  # embedding; 2 LSTM layers x 4; decoder weight and bias
    assert all(isinstance(r, PyRRef) for r in rrefs)
    assert all(r.local_value() is p for r, p in zip(rrefs, expected))
    assert isinstance(parts[0].encoder, nn.Embedding) and isinstance(parts[2].decoder, nn.Linear)


def test_parameter_rrefs_cover_all_three_parts():
    alone_in_rpc(rnn.PS_NAME, check_parameter_rrefs_cover_all_three_parts)
