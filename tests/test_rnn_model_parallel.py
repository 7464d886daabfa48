"""rpc_rnn_model_parallel.py: the RNN split between a parameter server and a trainer."""
import re

from conftest import RNN_EPOCHS, assert_succeeded, summary


def epoch_losses(out):
    return [float(x) for x in re.findall(r"^Training epoch \d+ loss (\d+\.\d{4})$", out, re.M)]


def test_one_command_learns(shared_runs):
    # The README's command as written: both ranks started by torch.multiprocessing on a free port.
    proc = shared_runs["rnn"]
    assert_succeeded(proc)
    losses = epoch_losses(proc.out)
    assert len(losses) == RNN_EPOCHS and losses[-1] < losses[0] - 0.5, f"the loss should fall: {proc.out}"
    assert summary(proc.out, timings=False) == {"epochs": str(RNN_EPOCHS), "final_loss": f"{losses[-1]:.4f}"}, proc


def test_same_seed_same_numbers(shared_runs):
    # The one-command run and one rank per process, both of the default --seed: the trainer alone drives
    # training, so every loss must match exactly.
    ps, trainer = shared_runs["rnn ranks"]
    assert_succeeded(ps, trainer)
    assert "Summary:" not in ps.out, ps  # the trainer's terminal shows the training
    one_command = shared_runs["rnn"]
    assert epoch_losses(trainer.out) == epoch_losses(one_command.out), (trainer, one_command)
