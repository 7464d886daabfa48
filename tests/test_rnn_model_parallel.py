"""rpc_rnn_model_parallel.py: the RNN split between a parameter server and a trainer.

More runs of the script are in test_failures.py: two at once, torchrun, one rank
per network namespace."""
import re

import torch.distributed.rpc as rpc
import torch.nn as nn
from torch.distributed.rpc import PyRRef  # RRefs that come back over RPC are PyRRef, the base of RRef

import rpc_rnn_model_parallel as rnn

SCRIPT = "rpc_rnn_model_parallel.py"


def test_one_command_learns(smoke_runs):
    proc = smoke_runs[SCRIPT].wait()
    assert proc.returncode == 0, proc
    losses = [float(x) for x in re.findall(r"^Training epoch \d+ loss (\d+\.\d{4})$", proc.out, re.M)]
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.1, f"the loss should fall: {proc.out}"
    assert re.search(rf"^Summary: epochs=4 seconds=[\d.]+ final_loss={losses[-1]:.4f}$", proc.out, re.M), proc
    assert "Traceback" not in proc.err, proc


def check_parameter_rrefs_cover_all_three_parts():
    # This process plays the parameter server: the embedding table and decoder are created here.
    model = rnn.RNNModel(rpc.get_worker_info().name, ntoken=10, ninp=4, nhid=6, nlayers=2, dropout=0.0)
    rrefs = model.parameter_rrefs()
    parts = [model.emb_table_rref.local_value(), model.rnn, model.decoder_rref.local_value()]
    expected = [p for part in parts for p in part.parameters()]
    assert len(rrefs) == len(expected) == 1 + 4 * 2 + 2  # embedding; 2 LSTM layers x 4; decoder weight and bias
    assert all(isinstance(r, PyRRef) for r in rrefs)
    assert all(r.local_value() is p for r, p in zip(rrefs, expected))
    assert isinstance(parts[0].encoder, nn.Embedding) and isinstance(parts[2].decoder, nn.Linear)


def test_parameter_rrefs_cover_all_three_parts(alone_in_rpc):
    alone_in_rpc(check_parameter_rrefs_cover_all_three_parts)
