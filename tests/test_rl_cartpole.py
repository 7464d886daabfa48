"""rpc_rl_cartpole.py: an agent and observers playing CartPole-v1 over RPC."""
import re

import pytest
import torch

import rpc_rl_cartpole as rl
from conftest import RL_EPISODES, assert_succeeded, in_rpc_group, summary


def episodes(out):
    """The (episode, last reward, average reward) of each status line."""
    return re.findall(r"^Episode (\d+)\tLast reward: (\d+\.\d\d)\tAverage reward: (\d+\.\d\d)$", out, re.M)


def test_one_command_learns(shared_runs):
    # World size 2: the agent and one observer, both started by torch.multiprocessing.
    proc = shared_runs["rl"]
    assert_succeeded(proc)
    assert re.search(rf"^This will run until reward threshold of 475\.0 is reached \(or for at most {RL_EPISODES} "
                     rf"episodes\)\.$", proc.out, re.M), proc.out
    played = episodes(proc.out)
    assert [int(n) for n, *_ in played] == list(range(1, RL_EPISODES + 1)), proc.out
    figures = summary(proc.out)
    assert figures["episodes"] == str(RL_EPISODES) and figures["solved"] == "false", proc.out
    rewards = [float(last) for _, last, _ in played]  # one observer: its episode's length
    assert int(figures["steps"]) == sum(rewards), proc.out  # each step's reward reached the agent
    first, last = rewards[:10], rewards[-10:]
    assert sum(last) > 1.5 * sum(first), f"the policy should improve: {rewards}"


def test_one_observer_same_seed_same_episodes(shared_runs):
    # One observer: the agent alone decides, so one terminal per rank plays the one-command run's episodes.
    (agent, observer), one_command = shared_runs["rl ranks"], shared_runs["rl"]
    assert_succeeded(agent, observer)
    assert observer.out == "", observer  # the agent's terminal shows the episodes
    assert episodes(agent.out) and episodes(agent.out) == episodes(one_command.out), (agent, one_command)
    assert summary(agent.out, timings=False) == summary(one_command.out, timings=False)


def check_finish_episode_returns_and_loss():
    agent = rl.Agent(world_size=1, gamma=0.5)  # no remote observers: two are faked by hand below
    trajectories = {1: [1.0, 1.0, 1.0], 2: [1.0, 1.0]}
    log_probs = {ob: [torch.zeros(1, requires_grad=True) for _ in rewards] for ob, rewards in trajectories.items()}
    for ob, rewards in trajectories.items():
        agent.rewards[ob], agent.saved_log_probs[ob] = [], list(log_probs[ob])  # as Agent() registers observers
        agent.report_reward(ob, rewards)
    assert agent.finish_episode() == 2.0  # the shorter episode's total reward

    # Discounted per trajectory: 1 + 0.5 + 0.25, 1 + 0.5, 1; then 1 + 0.5, 1.
    returns = torch.tensor([1.75, 1.5, 1.0, 1.5, 1.0])
    normalised = (returns - returns.mean()) / (returns.std() + agent.eps)
    # The loss is sum(-log_prob * R): its gradient by each log_prob is -R.
    grads = torch.cat([p.grad for ob in trajectories for p in log_probs[ob]])
    torch.testing.assert_close(grads, -normalised)
    assert agent.running_reward == pytest.approx(0.05 * 2.0)
    assert agent.total_steps == 5
    assert all(agent.rewards[ob] == [] and agent.saved_log_probs[ob] == [] for ob in trajectories)


def test_finish_episode_returns_and_loss():
    in_rpc_group(check_finish_episode_returns_and_loss)
