import re

from conftest import ROOT, assert_succeeded, summary, terminals


def epoch_losses(out):
    return dict(re.findall(r"^Training epoch (\d+) loss (\d+\.\d{4})$", out, re.M))


def test_the_readmes_command_prints_its_sample_and_one_terminal_per_rank_repeats_it(run):
    # The trainer alone drives training. Rank 1 starts 2 s after rank 0 listens, as by a person.
    proc = run("rpc_rnn_model_parallel.py")
    ranks = terminals(run, "rpc_rnn_model_parallel.py", 2, late=2)
    assert_succeeded(proc.wait(), *[rank.wait() for rank in ranks])
    losses = [float(loss) for loss in epoch_losses(proc.out).values()]
    assert len(losses) == 10 and losses[-1] < losses[0] - 0.5, proc
    assert "Summary:" not in ranks[0].out, ranks[0]  # the trainer's terminal shows the training
    assert epoch_losses(ranks[1].out) == epoch_losses(proc.out), (ranks[1], proc)
    # The README's sample is this run's, each loss to the 0.01 it allows another host.
    readme = (ROOT / "README.md").read_text().split("### `rpc_rnn_model_parallel.py`")[1]
    sample = next(text for kind, text in re.findall(r"^```(\w*)\n(.*?)^```", readme, re.M | re.S)
                  if not kind)
    shown = {**epoch_losses(sample), "final": summary(sample)["final_loss"]}
    printed = {**epoch_losses(proc.out), "final": summary(proc.out)["final_loss"]}
    assert len(shown) > 2 and all(abs(float(shown[key]) - float(printed[key])) <= 0.01
                                  for key in shown), (shown, printed)
