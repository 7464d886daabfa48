"""rpc_rl_cartpole.py: an agent and observers playing CartPole-v1 over RPC."""
import re

import pytest
import torch

import rpc_rl_cartpole as rl
from conftest import RL_EPISODES, assert_no_traceback, assert_succeeded, in_rpc_group, summary


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
    agent = rl.Agent(1, gamma=0.5)  # no remote observers: two are faked by hand below
    trajectories = {1: [1.0, 1.0, 1.0], 2: [1.0, 1.0]}
    log_probs = {ob: [torch.zeros(1, requires_grad=True) for _ in rewards] for ob, rewards in trajectories.items()}
    for ob, rewards in trajectories.items():
        agent.rewards[ob], agent.saved_log_probs[ob] = [], list(log_probs[ob])  # as Agent() registers observers
        for reward in rewards:
            agent.report_reward(ob, reward)
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


class RecordingAgent(rl.Agent):
    """The script's Agent, noting each call an observer makes to it, in order."""

    def select_action(self, ob_id, state):
        self.calls.append("select_action")
        return super().select_action(ob_id, state)

    def report_reward(self, ob_id, reward):
        self.calls.append(("report_reward", reward))
        super().report_reward(ob_id, reward)


def check_observer_calls_the_agent_twice_per_step():
    # This process is both the agent and the observer: the observer's calls go through the agent's RRef as RPCs.
    agent, observer = RecordingAgent(1), rl.Observer()
    agent.calls, agent.rewards[observer.id], agent.saved_log_probs[observer.id] = [], [], []
    observer.run_episode(agent.agent_rref)
    steps = len(agent.saved_log_probs[observer.id])
    assert steps >= 8, agent.calls  # no CartPole episode is shorter
    # The tutorial's pattern: every step, select_action, then report_reward with that step's reward.
    assert agent.calls == ["select_action", ("report_reward", 1.0)] * steps, agent.calls
    assert agent.rewards[observer.id] == [1.0] * steps


def test_observer_calls_the_agent_twice_per_step():
    in_rpc_group(check_observer_calls_the_agent_twice_per_step)


def test_an_observer_call_that_times_out_stops_the_run(shared_runs):
    # The agent answers the fifth select_action later than the observer's --timeout (conftest.slow_agent). The
    # call must not end the episode quietly (the agent would then train on log-probs and rewards that do not
    # match): the episode fails, the agent's line says where and why, and the observer, which lost it, ends too.
    agent, observer = shared_runs["rl slow"]
    assert observer.returncode == 1 and agent.returncode == 1, (agent, observer)
    assert_no_traceback(agent.err)
    assert re.search(r"^Error on rank 0 \(agent\): RuntimeError: On WorkerInfo\(id=1, name=obs1\): "
                     r"RuntimeError\(.*timeout", agent.err, re.M) and "Summary:" not in agent.out, agent
    assert re.search(r"^Error on rank 1 \(obs1\): lost contact with rank 0$", observer.err, re.M), observer
