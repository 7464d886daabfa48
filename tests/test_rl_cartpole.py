from conftest import (assert_succeeded, changed_copy, ends_with, episodes, free_port, listening,
                      one_error_line, summary, terminals)


def test_an_observer_call_that_times_out_stops_the_run(run, tmp_path):
    # The agent answers late: the observer must not take it for lost, nor end the episode quietly,
    # which would train on log-probs and rewards that do not match.
    line = "    def select_action(self, ob_id, state):\n"
    slow = changed_copy(tmp_path, "rpc_rl_cartpole.py", line, line + "        self.calls = getattr("
                        "self, 'calls', 0) + 1\n        time.sleep(20 if self.calls == 5 else 0)\n")
    port = ["--master_port", free_port(), "--max_episodes=3"]
    agent = run(slow, "--rank=0", *port)
    listening(agent)
    observer = run(slow, "--rank=1", *port, "--timeout=10")
    line = one_error_line(agent.wait())  # the call's error, in torch's words
    assert line.startswith("Error on rank 0 (agent): rank 1 (obs1): RuntimeError("), agent
    assert "Summary:" not in agent.out, agent
    ends_with(observer, "Error on rank 1 (obs1): cannot reach rank 0 (agent)")


def test_one_command_plays_every_episode_and_one_terminal_per_rank_repeats_them(run):
    # One observer: the agent alone decides.
    flags = ["--max_episodes=10", "--log_interval=1"]
    proc = run("rpc_rl_cartpole.py", "--world_size=2", *flags)
    agent, observer = terminals(run, "rpc_rl_cartpole.py", 2, *flags)
    assert_succeeded(proc.wait(), agent.wait(), observer.wait())
    assert ("This will run until reward threshold of 475.0 is reached, or for 10 episodes.\n"
            in proc.out), proc
    played, figures = episodes(proc.out), summary(proc.out)
    assert [int(n) for n, *_ in played] == list(range(1, 11)), proc
    assert (figures["episodes"], figures["solved"]) == ("10", "false"), proc
    # Each step's reward reached the agent.
    assert int(figures["steps"]) == sum(float(last) for _, last, _ in played), proc
    assert observer.out == "" and episodes(agent.out) == played, (agent, observer)
