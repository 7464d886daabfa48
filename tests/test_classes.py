"""The tutorial classes as a learner copies them into a program of their own: each script's part
above its "Launching ranks" banner, without the plumbing (what needs it fails with a NameError) or
the script's file, called as the tutorials call them. RPC starts once per process, so one run of
this file, `python tests/test_classes.py PORT`, makes an RPC group of one, named like
the parameter server so that the classes' RPCs land in it, runs every check and prints each result,
which a test reads. (The parameter server with two trainers: tests/learner.py.)"""
import functools
import json
import sys
import traceback
import types

import pytest

from conftest import ROOT, Run, free_port

pytestmark = pytest.mark.xdist_group("copied classes")  # one worker: one run for all


@functools.cache
def copied(script):
    """The script's tutorial part, in a module of its own that RPC finds by name."""
    module = sys.modules[f"copied_{script}"] = types.ModuleType(f"copied_{script}")
    code = (ROOT / f"{script}.py").read_text().split("# --------- Launching ranks")[0]
    exec(compile(code, module.__name__, "exec"), module.__dict__)
    return module


def check_get_accuracy_evaluates_the_remote_model_in_eval_mode():
    ps = copied("rpc_parameter_server")
    net, batch = ps.TrainerNet(), torch.randn(16, 1, 28, 28)
    assert not torch.equal(net(batch), net(batch)), "dropout should be on while training"
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(batch, torch.zeros(16)))
    ps.get_accuracy(loader, net)
    assert not ps.param_server.model.training, "get_accuracy ran the remote model in train mode"
    assert torch.equal(net(batch), net(batch)), "evaluation should give one output for one batch"


def check_finish_episode_returns_each_observers_discounted_rewards():
    agent = copied("rpc_rl_cartpole").Agent(1, gamma=0.5)  # two observers faked below
    rewards = {1: [1.0, 1.0, 1.0], 2: [1.0, 1.0]}
    log_probs = {ob: [torch.zeros(1, requires_grad=True) for _ in rewards[ob]] for ob in rewards}
    for ob in rewards:
        agent.rewards[ob], agent.saved_log_probs[ob] = [], list(log_probs[ob])
        for reward in rewards[ob]:
            agent.report_reward(ob, reward)
    assert agent.finish_episode() == 2.0  # the shorter episode's total reward
    returns = torch.tensor([1.75, 1.5, 1.0, 1.5, 1.0])  # discounted within each observer's episode
    # The loss, sum(-log_prob * R), has the normalised -R as its gradient by each log_prob.
    torch.testing.assert_close(torch.cat([p.grad for ob in rewards for p in log_probs[ob]]),
                               -(returns - returns.mean()) / (returns.std() + agent.eps))
    assert agent.running_reward == pytest.approx(0.05 * 2.0) and agent.total_steps == 5


def check_an_observer_asks_the_agent_for_each_action_then_reports_its_reward():
    rl = copied("rpc_rl_cartpole")

    class Recording(rl.Agent):
        def select_action(self, ob_id, state):
            self.calls.append("select_action")
            return super().select_action(ob_id, state)

        def report_reward(self, ob_id, reward):
            self.calls.append(reward)
            super().report_reward(ob_id, reward)

    agent, observer = Recording(1), rl.Observer()  # the tutorial's calls
    agent.calls, agent.rewards[observer.id], agent.saved_log_probs[observer.id] = [], [], []
    observer.run_episode(agent.agent_rref)  # over RPC, to this process
    steps = len(agent.saved_log_probs[observer.id])
    assert steps >= 8 and agent.calls == ["select_action", 1.0] * steps, agent.calls
    assert agent.finish_episode() == steps


def check_rnn_parts_take_the_tutorials_calls_and_train():
    rnn = copied("rpc_rnn_model_parallel")  # this process is the parameter server too
    ntoken, ninp, nhid, nlayers, batch, nindices = 10, 2, 3, 4, 5, 3  # the tutorial's sizes
    table = rpc.remote("parameter_server", rnn.EmbeddingTable, args=(ntoken, ninp, 0.5))
    tokens = torch.randint(0, ntoken, (batch, nindices))
    assert rnn._remote_method(rnn.EmbeddingTable.forward, table, tokens).shape == (5, 3, ninp)
    model = rnn.RNNModel("parameter_server", ntoken, ninp, nhid, nlayers)
    parts = [model.emb_table_rref.local_value(), model.rnn, model.decoder_rref.local_value()]
    params = [p for part in parts for p in part.parameters()]
    rrefs = model.parameter_rrefs()
    assert len(rrefs) == len(params) == 1 + 4 * 4 + 2  # the table, 4 LSTM layers, the decoder
    assert all(rref.local_value() is param for rref, param in zip(rrefs, params))
    opt = rnn.DistributedOptimizer(torch.optim.SGD, rrefs, lr=0.05)
    before = [p.detach().clone() for p in params]
    with dist_autograd.context() as context_id:
        output, _ = model(tokens, (torch.zeros(nlayers, nindices, nhid),) * 2)
        loss = output.sum()
        dist_autograd.backward(context_id, [loss])
        opt.step(context_id)
    assert all(not torch.equal(old, new) for old, new in zip(before, params)), "all should train"


def check_hybrid_model_takes_a_rank_a_string_or_a_device():
    # The tutorial passes a rank, cuda:rank where this host has it; a learner may pass "cpu".
    hybrid = copied("ddp_rpc_hybrid")
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0,
                                         world_size=1)
    table = hybrid.RemoteModule("parameter_server", torch.nn.EmbeddingBag, args=(100, 16),
                                kwargs={"mode": "sum"})
    rank_0 = "cuda:0" if torch.cuda.is_available() else "cpu"
    for device, expected in ((0, rank_0), ("cpu", "cpu"), (torch.device("cpu"), "cpu")):
        model = hybrid.HybridModel(table, device)
        assert model.device == torch.device(expected)
        assert model(torch.tensor([1, 2, 3, 4]), torch.tensor([0, 2])).shape == (2, 8)
    losses, fc_weights = hybrid._run_trainer(table, 0, epochs=2)  # the tutorial's call, 2 epochs
    assert len(losses) == 2 and set(fc_weights) == {"weight", "bias"}


def check_batch_parameter_server_answers_each_trainer_once_all_have_reported():
    bps = copied("rpc_batch_parameter_server")
    rref = rpc.RRef(bps.BatchUpdateParameterServer(batch_update_size=2))
    before = [p.detach().clone() for p in rref.local_value().model.parameters()]
    call = functools.partial(rpc.rpc_async, "parameter_server",
                             bps.BatchUpdateParameterServer.update_and_fetch_model)
    first = call(args=(rref, [torch.full_like(p, 1.0) for p in before]))
    assert not first.done(), "answered before the batch was full"
    second = call(args=(rref, [torch.full_like(p, 3.0) for p in before]))
    for model in (first.wait(), second.wait()):  # both get one step, by lr 2 * the mean gradient
        for old, new in zip(before, model.parameters()):
            torch.testing.assert_close(new, old - 2 * 2.0)
    assert len(bps.run_trainer(rpc.RRef(bps.BatchUpdateParameterServer(batch_update_size=1)))) == 6


def check_batch_agent_answers_both_observers_from_one_policy_run():
    brl = copied("rpc_batch_cartpole")
    agent = brl.Agent(1)  # the tutorial's call; two observers faked below
    agent.states, agent.pending_states = torch.zeros(2, 1, 4), 2
    with torch.no_grad():  # a policy that answers a state of ones with 1, of zeros with 0
        agent.policy.affine1.weight.fill_(10)
        agent.policy.affine1.bias.zero_()
        agent.policy.affine2.weight.copy_(torch.tensor([[-1.0], [1.0]]).expand(2, 128))
        agent.policy.affine2.bias.copy_(torch.tensor([5.0, -5.0]))
    call = functools.partial(rpc.rpc_async, "parameter_server", brl.Agent.select_action_batch)
    first = call(args=(agent.agent_rref, 0, torch.ones(1, 4)))
    assert not first.done(), "answered before every observer's state came"
    second = call(args=(agent.agent_rref, 1, torch.zeros(1, 4)))
    assert (first.wait(), second.wait()) == (1, 0), "each observer should get its state's action"
    assert len(agent.saved_log_probs) == 1 and agent.saved_log_probs[0].shape == (2,)


CHECKS = [value for name, value in list(globals().items()) if name.startswith("check_")]


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    """{check: None, or why it failed}, from one run of this file."""
    proc = Run("tests/test_classes.py", free_port(), cwd=tmp_path_factory.mktemp("classes")).wait()
    return dict(json.loads(line) for line in proc.out.splitlines() if line.startswith("["))


@pytest.mark.parametrize("check", CHECKS, ids=[check.__name__[6:] for check in CHECKS])
def test_in_an_rpc_group_of_one(check, checks):
    assert check.__name__ in checks, f"{check.__name__} never finished: the run died or hung"
    assert checks[check.__name__] is None, checks[check.__name__]


if __name__ == "__main__":  # in this run alone, the checks import torch
    import torch
    import torch.distributed.autograd as dist_autograd
    import torch.distributed.rpc as rpc

    rpc.init_rpc("parameter_server", rank=0, world_size=1,
                 rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
                     init_method=f"tcp://127.0.0.1:{sys.argv[1]}", _transports=["uv"]))
    for check in CHECKS:
        try:
            check()
            print(json.dumps([check.__name__, None]), flush=True)
        except BaseException:
            print(json.dumps([check.__name__, traceback.format_exc()]), flush=True)
    rpc.shutdown()
