"""rpc_rl_cartpole.py: an agent and observers playing CartPole-v1 over RPC."""

from conftest import (assert_succeeded, changed_copy, episodes, free_port, listening, one_error_line,
                      summary, terminals)


def test_an_observer_call_that_times_out_stops_the_run(run, tmp_path):
    # A copy whose agent answers the fifth select_action 20 s late, on its one RPC thread, as a
    # slow agent on a busy machine: the observer, whose --timeout is 10 s, must not take the busy
    # agent for a lost one, and the call must not end the episode quietly (the agent would train on
    # log-probs and rewards that do not match). The agent names the observer and its call's error,
    # in torch's words; the observer, which lost the agent, ends too.
    slow = changed_copy(tmp_path, "rpc_rl_cartpole.py", "    def select_action(self, ob_id, state):\n",
                        "    def select_action(self, ob_id, state):\n"
                        "        self.calls = getattr(self, 'calls', 0) + 1\n"
                        "        time.sleep(20 if self.calls == 5 else 0)\n")
    port = ["--master_port", free_port(), "--max_episodes=3"]
    agent = run(slow, "--rank=0", *port)
    listening(agent)
    observer = run(slow, "--rank=1", *port, "--timeout=10")
    assert one_error_line(agent.wait()).startswith("Error on rank 0 (agent): rank 1 (obs1): "
                                                   "RuntimeError("), agent
    assert "Summary:" not in agent.out, agent
    assert one_error_line(observer.wait()) == "Error on rank 1 (obs1): cannot reach rank 0 (agent)"


def test_one_command_plays_and_reports_every_episode(run):
    # World size 2: the agent and one observer. Whether 10 episodes improve the policy depends on
    # the seed and the host (test_classes.py checks the REINFORCE loss itself).
    proc = run("rpc_rl_cartpole.py", "--world_size=2", "--max_episodes=10", "--log_interval=1")
    assert_succeeded(proc.wait())
    assert ("This will run until reward threshold of 475.0 is reached, or for 10 episodes.\n"
            in proc.out), proc
    played = episodes(proc.out)
    assert [int(n) for n, *_ in played] == list(range(1, 11)), proc
    figures = summary(proc.out)
    assert figures["episodes"] == "10" and figures["solved"] == "false", proc
    # One observer: an episode's reward is its length, and each step's reward reached the agent.
    assert int(figures["steps"]) == sum(float(last) for _, last, _ in played), proc


def test_same_seed_one_terminal_per_rank_plays_the_same_episodes(run):
    flags = ["--max_episodes=5", "--log_interval=1"]
    one_command = run("rpc_rl_cartpole.py", *flags)
    agent, observer = terminals(run, "rpc_rl_cartpole.py", 2, *flags)
    assert_succeeded(one_command.wait(), agent.wait(), observer.wait())
    assert observer.out == "", observer  # the agent's terminal shows the episodes
    assert len(episodes(agent.out)) == 5, agent
    assert episodes(agent.out) == episodes(one_command.out), (agent, one_command)
