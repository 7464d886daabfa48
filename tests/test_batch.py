"""The batch tutorial's two scripts."""
import re

from conftest import LIVE, assert_succeeded, ends_with, episodes, summary, terminals


def losses(out):
    return re.findall(r"^trainer\d batch \d+ loss \d\.\d{4}$", out, re.M)


def test_batch_parameter_server_same_seed_one_terminal_per_rank_until_its_trainer_dies(run):
    # One trainer drives the server alone.
    one_command = run("rpc_batch_parameter_server.py", "--world_size=2", "--batches=20")
    server, trainer = terminals(run, "rpc_batch_parameter_server.py", 2, "--batches", 10 ** 7,
                                env=LIVE)
    trainer.wait_for("trainer1 batch 20 ")
    trainer.kill()
    assert_succeeded(one_command.wait())
    figures = summary(one_command.out)  # it learns
    assert float(figures["final_loss"]) < float(figures["first_loss"]) / 2, one_command
    assert len(losses(one_command.out)) == 2, one_command
    assert losses(trainer.wait().out)[:2] == losses(one_command.out), (trainer, one_command)
    ends_with(server, "Error on rank 0 (ps): cannot reach rank 1 (trainer1)")


def test_batch_cartpole_two_observers_without_batching(run):
    proc = run("rpc_batch_cartpole.py", "--world_size=3", "--no-batch", "--num_episode=3",
               "--n_steps=50").wait()
    assert_succeeded(proc)
    assert summary(proc.out)["steps"] == str(3 * 50 * 2), proc  # n_steps each, as the tutorial's


def test_batch_cartpole_same_seed_one_terminal_per_rank_until_its_observer_dies(run):
    # One observer, batching (a batch of one): the agent alone decides.
    one_command = run("rpc_batch_cartpole.py", "--num_episode=3", "--n_steps=50")
    agent, observer = terminals(run, "rpc_batch_cartpole.py", 2, "--num_episode", 10 ** 7,
                                "--n_steps=50", env=LIVE)
    agent.wait_for("Episode 2\t")
    observer.kill()
    assert_succeeded(one_command.wait())
    assert summary(one_command.out)["batch"] == "true" and len(episodes(one_command.out)) == 3
    assert episodes(agent.out)[:3] == episodes(one_command.out), (agent, one_command)
    ends_with(agent, "Error on rank 0 (agent): cannot reach rank 1 (observer1)")
