"""rpc_parameter_server.py on tiny MNIST: the README's command (two trainers), a learner's DataLoader workers
in one command, one terminal per rank (a copied ParameterServer with two trainers: tests/learner.py)."""
import re

from conftest import MNIST_TRAIN, PS_EPOCHS, assert_succeeded, summary

BATCHES = MNIST_TRAIN // 32  # a trainer's batches in an epoch, at the tutorial's batch size


def loss_lines(out, rank):
    """Each of the rank's loss lines, whole and in order: (batch, loss)."""
    return re.findall(rf"^Rank {rank} training batch (\d+) loss (\d+\.\d{{4}})$", out, re.M)


def test_the_readmes_command_learns_with_two_trainers(shared_runs):
    # World size 3: the parameter server and two trainers, all started by torch.multiprocessing, one epoch.
    proc = shared_runs["ps"]
    assert_succeeded(proc)
    for line in ("PS master initializing RPC", "RPC initialized! Running parameter server...",
                 "Worker rank 1 initializing RPC", "Worker rank 2 initializing RPC", "Training complete!",
                 "Getting accuracy....", "RPC shutdown on parameter server."):
        assert line in proc.out.splitlines(), proc.out
    for rank in (1, 2):
        # A line every 5 batches, as the tutorial's.
        assert [int(batch) for batch, _ in loss_lines(proc.out, rank)] == list(range(0, BATCHES, 5)), proc.out
        figures = summary("\n".join(line for line in proc.out.splitlines() if f"rank={rank} " in line))
        assert figures["batches"] == str(BATCHES) and f"Accuracy {figures['accuracy']}" in proc.out, proc.out
        assert float(figures["accuracy"]) >= 0.5, f"it should learn: {proc.out}"
    # It prints the tutorial's lines and ours, nothing else.
    known = (r"Using 0 GPUs to train", r"Putting (first 2 convs|rest of layers) on cpu",
             r"PS master initializing RPC", r"RPC initialized! Running parameter server\.\.\.", r"Worker rank \d "
             r"initializing RPC", r"Worker \d done initializing RPC", r"Rank \d training batch \d+ loss \d+\.\d{4}",
             r"Training complete!", r"Getting accuracy\.\.\.\.", r"Accuracy \d\.\d{4}", r"RPC shutdown on parameter "
             r"server\.", r"Summary: rank=\d batches=\d+ seconds=[\d.]+ ms_per_batch=[\d.]+ accuracy=\d\.\d{4}")
    assert all(any(re.fullmatch(form, line) for form in known) for line in proc.out.splitlines()), proc.out
    # The shared model learns: a trainer's first loss came before any step, and one's last, after the steps of
    # both, is under half of it (each rank's lines come when it ends, so not in the order printed).
    first, last = zip(*((lines[0], lines[-1]) for rank in (1, 2) for lines in [loss_lines(proc.out, rank)]))
    assert min(float(loss) for _, loss in last) < max(float(loss) for _, loss in first) / 2, proc.out


def test_one_trainer_same_seed_same_numbers_with_dataloader_workers(shared_runs):
    # One trainer drives the parameter server alone, so one terminal per rank prints the numbers of the one
    # command whose trainer loads MNIST with two DataLoader workers, as a learner may change it (for the one
    # epoch that it trains): the workers start in a rank of the one-command run, and change nothing.
    (server, trainer), workers = shared_runs["ps ranks"], shared_runs["ps workers"]
    assert_succeeded(server, trainer, workers)
    assert "Summary:" not in server.out, server  # the trainer's terminal shows the training
    assert summary(workers.out)["batches"] == str(PS_EPOCHS * BATCHES), workers.out
    epoch = loss_lines(trainer.out, 1)
    assert epoch and epoch == loss_lines(workers.out, 1)[:len(epoch)], (trainer, workers)
