"""The batch tutorial's two scripts: rpc_batch_parameter_server.py and rpc_batch_cartpole.py, in one command at
world size 2 and 3, and one terminal per rank until a peer is killed (the copied classes: test_classes.py)."""
import re

from conftest import BATCH_RL, assert_succeeded, one_error_line, summary

EPISODES, STEPS = (int(flag.split("=")[1]) for flag in BATCH_RL)
AT_ONCE = 60  # a survivor of a killed peer ends within this (as in test_failures.py: only "bounded")


def trainer_lines(out):
    return re.findall(r"^trainer\d batch \d+ loss \d\.\d{4}$", out, re.M)


def test_batch_parameter_server_learns_in_one_command(shared_runs):
    # One and two trainers: the server steps once every trainer has sent its gradients. Each trainer prints
    # its loss every 10 batches, rank 0 the mean over trainers of the first and the last.
    for trainers, proc in ((1, shared_runs["bps 2"]), (2, shared_runs["bps 3"])):
        assert_succeeded(proc)
        figures = summary(proc.out, timings=False)
        assert figures["trainers"] == str(trainers) and figures["batches"] == "20", proc
        printed = sorted(line.split(" loss")[0] for line in trainer_lines(proc.out))
        assert printed == [f"trainer{t} batch {b}" for t in range(1, trainers + 1) for b in (0, 10)], proc
        assert float(figures["final_loss"]) < float(figures["first_loss"]) / 2, f"it should learn: {proc}"


def test_batch_parameter_server_one_terminal_per_rank(shared_runs):
    # One trainer drives the server alone: one terminal per rank prints the one command's losses, for as long
    # as it runs; its trainer killed, the server names it at once.
    (server, trainer), one_command = shared_runs["bps ranks"], shared_runs["bps 2"]
    assert trainer_lines(trainer.out)[:2] == trainer_lines(one_command.out), (trainer, one_command)
    assert one_error_line(server) == "Error on rank 0 (ps): cannot reach rank 1 (trainer1)", server
    assert server.ended - trainer.killed < AT_ONCE, server


def episodes(out):
    return re.findall(r"^Episode (\d+)\tLast reward: (\d+\.\d\d)\tAverage reward: (\d+\.\d\d)$", out, re.M)


def test_batch_cartpole_in_one_command(shared_runs):
    # One observer batching (a batch of one), and two observers without batching; every observer plays
    # n_steps in every episode, as in the tutorial.
    for observers, batch, proc in ((1, "true", shared_runs["brl 2"]), (2, "false", shared_runs["brl 3"])):
        assert_succeeded(proc)
        assert [int(n) for n, *_ in episodes(proc.out)] == list(range(EPISODES)), proc
        figures = summary(proc.out, timings=False)
        assert figures == {"episodes": str(EPISODES), "steps": str(EPISODES * STEPS * observers), "batch": batch}


def test_batch_cartpole_one_terminal_per_rank(shared_runs):
    # One observer: the agent alone decides, so one terminal per rank plays the one command's episodes; its
    # observer killed, the agent names it at once.
    (agent, observer), one_command = shared_runs["brl ranks"], shared_runs["brl 2"]
    assert episodes(agent.out)[:EPISODES] == episodes(one_command.out), (agent, one_command)
    assert one_error_line(agent) == "Error on rank 0 (agent): cannot reach rank 1 (observer1)", agent
    assert agent.ended - observer.killed < AT_ONCE, agent
