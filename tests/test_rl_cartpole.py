"""rpc_rl_cartpole.py: an agent and observers playing CartPole-v1 over RPC."""
import re

from conftest import RL_EPISODES, assert_succeeded, one_error_line, summary


def episodes(out):
    """The (episode, last reward, average reward) of each status line."""
    return re.findall(r"^Episode (\d+)\tLast reward: (\d+\.\d\d)\tAverage reward: (\d+\.\d\d)$", out, re.M)


def test_one_command_plays_and_reports_every_episode(shared_runs):
    # World size 2: the agent and one observer, both started by torch.multiprocessing. Whether a few episodes
    # improve the policy depends on the seed: 15% of seeds play worse in episodes 31-40 than in 1-10, and each
    # release or CPU is another draw (test_classes.py checks the REINFORCE loss itself).
    proc = shared_runs["rl"]
    assert_succeeded(proc)
    # The tutorial's line, saying that --max_episodes ends it sooner.
    assert f"This will run until reward threshold of 475.0 is reached, or for {RL_EPISODES} episodes.\n" \
        in proc.out, proc.out
    played = episodes(proc.out)
    assert [int(n) for n, *_ in played] == list(range(1, RL_EPISODES + 1)), proc.out
    figures = summary(proc.out)
    assert figures["episodes"] == str(RL_EPISODES) and figures["solved"] == "false", proc.out
    rewards = [float(last) for _, last, _ in played]  # one observer: its episode's length
    assert int(figures["steps"]) == sum(rewards), proc.out  # each step's reward reached the agent


def test_one_observer_same_seed_same_episodes(shared_runs):
    # One observer: the agent alone decides, so one terminal per rank plays the one-command run's episodes.
    (agent, observer), one_command = shared_runs["rl ranks"], shared_runs["rl"]
    assert_succeeded(agent, observer)
    assert observer.out == "", observer  # the agent's terminal shows the episodes
    played = episodes(agent.out)  # 5 of them
    assert played and played == episodes(one_command.out)[:len(played)], (agent, one_command)


def test_an_observer_call_that_times_out_stops_the_run(shared_runs):
    # The agent, on its one RPC thread, answers the fifth select_action later than the observer's --timeout
    # (conftest.slow_agent): the observer, which only waits, must not take the busy agent for a lost one, and the
    # call must not end the episode quietly (the agent would then train on log-probs and rewards that do not
    # match). The episode fails, the agent's line names the observer and the error of its call, in torch's words,
    # and the observer, which lost the agent, ends too.
    agent, observer = shared_runs["rl slow"]
    assert observer.returncode == 1 and agent.returncode == 1, (agent, observer)
    assert one_error_line(agent).startswith("Error on rank 0 (agent): rank 1 (obs1): RuntimeError("), agent
    assert "Summary:" not in agent.out, agent
    assert one_error_line(observer).startswith("Error on rank 1 (obs1): cannot reach rank 0 (agent) at "), observer
