import re

from conftest import (ROOT, assert_succeeded, changed_copy, ends_with, free_port, one_error_line,
                      summary, terminals)


def losses(out, rank):
    return [float(loss) for loss in re.findall(rf"^Rank {rank} training batch \d+ loss (\S+)$",
                                               out, re.M)]


def test_a_copied_parameter_server_serves_two_trainers(run, tiny_mnist):
    # The tutorial part in a learner's program with the upstream launcher, warnings and all.
    proc = run(ROOT / "tests" / "learner.py", free_port(), tiny_mnist).wait()
    assert proc.returncode == 0 and "Traceback" not in proc.err, proc
    assert sorted(re.findall("^Copied: .*$", proc.out, re.M)) == [
        "Copied: trainer 1 trained", "Copied: trainer 2 trained"], proc


def test_the_readmes_command_learns_with_two_trainers(run, tiny_mnist):
    proc = run("rpc_parameter_server.py", "--world_size=3", f"--data_dir={tiny_mnist}").wait()
    assert_succeeded(proc)
    tutorials = {"PS master initializing RPC", "RPC initialized! Running parameter server...",
                 "Training complete!", "Getting accuracy....", "RPC shutdown on parameter server."}
    assert tutorials <= set(proc.out.splitlines()), proc
    for rank in (1, 2):  # a loss every 5 batches, then the accuracy
        assert len(losses(proc.out, rank)) == 2, proc
        accuracy = summary(re.search(f"^Summary: rank={rank} .*$", proc.out, re.M)[0])["accuracy"]
        assert f"\nAccuracy {accuracy}\n" in proc.out and float(accuracy) >= 0.5, proc
    # The shared model learns.
    assert min(losses(proc.out, 1)[-1], losses(proc.out, 2)[-1]) < max(
        losses(proc.out, 1)[0], losses(proc.out, 2)[0]) / 2, proc


def test_same_seed_one_terminal_per_rank_with_dataloader_workers(run, tiny_mnist, tmp_path):
    # One trainer drives the server alone; the one command's forks DataLoader workers.
    workers = changed_copy(tmp_path, "rpc_parameter_server.py", "shuffle=True)\n    test_loader",
                           "shuffle=True, num_workers=2)\n    test_loader")
    one_command = run(workers, "--world_size=2", "--data_dir", tiny_mnist)
    server, trainer = terminals(run, "rpc_parameter_server.py", 2, "--data_dir", tiny_mnist)
    assert_succeeded(one_command.wait(), server.wait(), trainer.wait())
    assert "Summary:" not in server.out, server  # the trainer's terminal shows the training
    assert losses(trainer.out, 1) == losses(one_command.out, 1) != [], (trainer, one_command)
    assert summary(trainer.out)["accuracy"] == summary(one_command.out)["accuracy"], trainer


def test_mnist_that_cannot_be_downloaded_is_named_with_what_to_do(run, tmp_path):
    # No network: the trainer removes the folders it made in the user's --data_dir, not that one.
    (tmp_path / "mine").mkdir()
    refused = f"http://127.0.0.1:{free_port()}"
    proxies = dict.fromkeys(["http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"], refused)
    server, trainer = terminals(run, "rpc_parameter_server.py", 2, "--data_dir", "mine",
                                env={**proxies, "no_proxy": "", "NO_PROXY": ""})
    # The cause in brackets is torchvision's and the system's, which vary.
    assert re.fullmatch(r"Error on rank 1 \(trainer_1\): RuntimeError: cannot download MNIST into "
                        r"mine \(.+\); give --data_dir a folder that holds MNIST/raw/",
                        one_error_line(trainer.wait())), trainer
    ends_with(server, "Error on rank 0 (parameter_server): cannot reach rank 1 (trainer_1)")
    assert [path.name for path in tmp_path.rglob("*")] == ["mine"], "its folders should be gone"
