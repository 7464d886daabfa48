"""rpc_parameter_server.py on tiny MNIST: the README's command, one terminal per rank, a failed
download, and a learner's copy of the tutorial part."""
import re

from conftest import (ROOT, TINY_MNIST, assert_succeeded, changed_copy, free_port,
                      one_error_line, summary, terminals)

BATCHES = TINY_MNIST[0] // 32  # a trainer's batches in one epoch


def loss_lines(out, rank):
    return re.findall(rf"^Rank {rank} training batch (\d+) loss (\d+\.\d{{4}})$", out, re.M)


def test_a_copied_parameter_server_serves_two_trainers(run, tiny_mnist):
    # tests/learner.py copies the tutorial part into a learner's own program, with the upstream
    # example's launcher and none of the plumbing: the tutorial's ParameterServer serves both.
    proc = run(ROOT / "tests" / "learner.py", free_port(), tiny_mnist).wait()
    assert_succeeded(proc)
    assert sorted(re.findall("^Copied: .*$", proc.out, re.M)) == [
        "Copied: trainer 1 trained", "Copied: trainer 2 trained"], proc


def test_the_readmes_command_learns_with_two_trainers(run, tiny_mnist):
    proc = run("rpc_parameter_server.py", "--world_size=3", f"--data_dir={tiny_mnist}").wait()
    assert_succeeded(proc)
    # The tutorial's lines and ours, nothing else.
    known = (r"Using 0 GPUs to train", r"Putting (first 2 convs|rest of layers) on cpu",
             r"PS master initializing RPC", r"RPC initialized! Running parameter server\.\.\.",
             r"Worker rank [12] initializing RPC", r"Worker [12] done initializing RPC",
             r"Rank [12] training batch \d+ loss \d\.\d{4}", r"Training complete!",
             r"Getting accuracy\.\.\.\.", r"Accuracy \d\.\d{4}", r"RPC shutdown on parameter server\.",
             r"Summary: rank=[12] batches=6 seconds=[\d.]+ ms_per_batch=[\d.]+ accuracy=\d\.\d{4}")
    for line in proc.out.splitlines():
        assert any(re.fullmatch(form, line) for form in known), (line, proc)
    assert proc.out.count("RPC shutdown on parameter server.") == 1, proc
    for rank in (1, 2):  # a loss line every 5 batches, as the tutorial's, and an accuracy
        assert [int(batch) for batch, _ in loss_lines(proc.out, rank)] == [0, 5], proc
        accuracy = re.search(rf"^Summary: rank={rank} .* accuracy=(\S+)$", proc.out, re.M)[1]
        assert f"Accuracy {accuracy}\n" in proc.out and float(accuracy) >= 0.5, proc
    # The shared model learns: after both trainers' steps a last loss is under half a first.
    first, last = zip(*((lines[0], lines[-1]) for rank in (1, 2)
                        for lines in [[float(loss) for _, loss in loss_lines(proc.out, rank)]]))
    assert min(last) < max(first) / 2, proc


def test_same_seed_one_terminal_per_rank_with_dataloader_workers(run, tiny_mnist, tmp_path):
    # One trainer drives the server alone, so one terminal per rank prints the numbers of the one
    # command whose trainer loads MNIST with two DataLoader workers, as a learner may change it:
    # the workers start in a forked rank and change nothing.
    workers = changed_copy(tmp_path, "rpc_parameter_server.py", "shuffle=True)\n    test_loader",
                           "shuffle=True, num_workers=2)\n    test_loader")
    one_command = run(workers, "--world_size=2", "--data_dir", tiny_mnist)
    server, trainer = terminals(run, "rpc_parameter_server.py", 2, "--data_dir", tiny_mnist)
    assert_succeeded(one_command.wait(), server.wait(), trainer.wait())
    assert "Summary:" not in server.out, server  # the trainer's terminal shows the training
    assert summary(trainer.out)["batches"] == str(BATCHES), trainer
    assert len(loss_lines(trainer.out, 1)) == 2, trainer
    assert loss_lines(trainer.out, 1) == loss_lines(one_command.out, 1), (trainer, one_command)
    assert summary(trainer.out)["accuracy"] == summary(one_command.out)["accuracy"]


def test_mnist_that_cannot_be_downloaded_is_named_with_what_to_do(run, tmp_path):
    # No network (proxies that refuse, for every host): the trainer says why and what to do, and
    # removes the folders it made in the user's --data_dir, never that folder; the server, in a
    # terminal of its own, loses its trainer.
    (tmp_path / "mine").mkdir()
    refused = f"http://127.0.0.1:{free_port()}"
    no_network = {"http_proxy": refused, "https_proxy": refused, "HTTP_PROXY": refused,
                  "HTTPS_PROXY": refused, "no_proxy": "", "NO_PROXY": ""}
    server, trainer = terminals(run, "rpc_parameter_server.py", 2, "--data_dir", "mine",
                                env=no_network)
    # The cause in brackets is torchvision's and the system's, which vary by release and host.
    assert re.fullmatch(r"Error on rank 1 \(trainer_1\): RuntimeError: cannot download MNIST into "
                        r"mine \(.+\); give --data_dir a folder that holds MNIST/raw/",
                        one_error_line(trainer.wait())), trainer
    assert one_error_line(server.wait()) == ("Error on rank 0 (parameter_server): cannot reach rank"
                                             " 1 (trainer_1)"), server
    assert list(tmp_path.iterdir()) == [tmp_path / "mine"] and not any((tmp_path / "mine").iterdir())
