"""rpc_rl_cartpole.py: an agent and observers playing CartPole-v1 over RPC."""
import re

import pytest
import torch

import rpc_rl_cartpole as rl

SCRIPT = "rpc_rl_cartpole.py"


def assert_played(out, episodes):
    assert "This will run until reward threshold of 475.0 is reached" in out
    lines = re.findall(r"^Episode (\d+)\tLast reward: \d+\.\d\d\tAverage reward: \d+\.\d\d$", out, re.M)
    assert [int(n) for n in lines] == list(range(1, episodes + 1)), out
    summary = re.search(r"^Summary: episodes=(\d+) steps=(\d+) seconds=[\d.]+ us_per_step=\d+ solved=false$", out, re.M)
    assert summary and int(summary.group(1)) == episodes, out
    assert int(summary.group(2)) >= 8 * episodes  # CartPole cannot fall in fewer than 8 steps


def test_one_command_two_observers(smoke_runs):
    proc = smoke_runs[SCRIPT].wait()
    assert proc.returncode == 0, proc
    assert_played(proc.out, episodes=3)


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


def test_finish_episode_returns_and_loss(alone_in_rpc):
    alone_in_rpc(check_finish_episode_returns_and_loss)
