"""rpc_rnn_model_parallel.py: the RNN split between a parameter server and a trainer."""
import re

import torch.distributed.rpc as rpc
import torch.nn as nn
from torch.distributed.rpc import PyRRef  # RRefs that come back over RPC are PyRRef, the base of RRef

import rpc_rnn_model_parallel as rnn
from conftest import RNN_EPOCHS, assert_succeeded, in_rpc_group, summary


def epoch_losses(out):
    return [float(x) for x in re.findall(r"^Training epoch \d+ loss (\d+\.\d{4})$", out, re.M)]


def test_one_command_learns(shared_runs):
    # The README's command as written: both ranks started by torch.multiprocessing on a free port.
    proc = shared_runs["rnn"]
    assert_succeeded(proc)
    assert re.search(r"^Starting 2 ranks on port \d+$", proc.out, re.M), proc
    losses = epoch_losses(proc.out)
    assert len(losses) == RNN_EPOCHS and losses[-1] < losses[0] - 0.1, f"the loss should fall: {proc.out}"
    assert summary(proc.out, timings=False) == {"epochs": str(RNN_EPOCHS), "final_loss": f"{losses[-1]:.4f}"}, proc


def test_same_seed_same_numbers(shared_runs):
    # The one-command run and one rank per process, both of the default --seed: the trainer alone drives
    # training, so every loss must match exactly.
    ps, trainer = shared_runs["rnn ranks"]
    assert_succeeded(ps, trainer)
    assert "Summary:" not in ps.out, ps  # the trainer's terminal shows the training
    one_command = shared_runs["rnn"]
    assert epoch_losses(trainer.out) == epoch_losses(one_command.out), (trainer, one_command)
    assert summary(trainer.out, timings=False) == summary(one_command.out, timings=False)


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


def test_parameter_rrefs_cover_all_three_parts():
    in_rpc_group(check_parameter_rrefs_cover_all_three_parts)
