"""The tutorial classes and helpers as a learner copies them into a program of their own: the part of each script
above its "Launching ranks" banner, without the plumbing, so that a class that needs it fails with a NameError,
and without the script's file (a module of its own, as a notebook cell has none), with the tutorials' own calls. Each check runs in an RPC group of one: a freshly spawned process named like
the parameter server, so that the classes' RPCs to that worker land in it. RPC starts once per process, so one
such process runs every check of this module, and each test reads its result. (The parameter server with two
trainers, in processes of their own: tests/learner.py.)"""
import argparse
import functools
import multiprocessing
import sys
import traceback
import types

import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch.distributed.rpc import PyRRef  # RRefs that come back over RPC are PyRRef, the base of RRef

from conftest import MNIST_TEST, MNIST_TRAIN, ROOT, free_port

MNIST_ROOT = None  # the spawned process's tiny MNIST (run_checks)


@functools.cache
def copied(script):
    """The script's tutorial part, copied into a module of its own."""
    module = types.ModuleType(f"copied_{script}")
    sys.modules[module.__name__] = module  # so that RPC finds the copy's functions by name
    code = (ROOT / f"{script}.py").read_text().split("# --------- Launching ranks")[0]
    exec(compile(code, module.__name__, "exec"), module.__dict__)
    return module


def check_get_accuracy_evaluates_the_remote_model_in_eval_mode():
    torch.manual_seed(0)
    ps = copied("rpc_parameter_server")
    net = ps.TrainerNet()
    batch = torch.randn(16, 1, 28, 28)
    net.train()
    assert not torch.equal(net(batch), net(batch)), "dropout should be on while training"
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(batch, torch.zeros(16, dtype=torch.long)), batch_size=8)
    ps.get_accuracy(loader, net)
    assert ps.param_server.model.training is False, "get_accuracy's forward passes ran the remote model in train mode"
    assert torch.equal(net(batch), net(batch)), "the same batch must give the same output in evaluation"


def check_load_mnist_needs_no_script_file():
    loaders = copied("rpc_parameter_server").load_mnist(argparse.Namespace(data_dir=MNIST_ROOT))
    assert [len(loader.dataset) for loader in loaders] == [MNIST_TRAIN, MNIST_TEST]


def check_finish_episode_returns_and_loss():
    agent = copied("rpc_rl_cartpole").Agent(1, gamma=0.5)  # no remote observers: two are faked by hand below
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


def check_observer_calls_the_agent_twice_per_step():
    # This process is both the agent and the observer: the observer's calls go through the agent's RRef as RPCs.
    rl = copied("rpc_rl_cartpole")

    class RecordingAgent(rl.Agent):
        """The copied Agent, noting each call an observer makes to it, in order."""

        def select_action(self, ob_id, state):
            self.calls.append("select_action")
            return super().select_action(ob_id, state)

        def report_reward(self, ob_id, reward):
            self.calls.append(("report_reward", reward))
            super().report_reward(ob_id, reward)

    agent, observer = RecordingAgent(1), rl.Observer()  # the tutorial's calls
    agent.calls, agent.rewards[observer.id], agent.saved_log_probs[observer.id] = [], [], []
    observer.run_episode(agent.agent_rref)
    steps = len(agent.saved_log_probs[observer.id])
    assert steps >= 8, agent.calls  # no CartPole episode is shorter
    # The tutorial's pattern: every step, select_action, then report_reward with that step's reward.
    assert agent.calls == ["select_action", ("report_reward", 1.0)] * steps, agent.calls
    assert agent.rewards[observer.id] == [1.0] * steps
    assert agent.finish_episode() == steps


def check_rnn_parts_take_the_tutorials_calls_and_train():
    # This process plays the parameter server: the embedding table and decoder are created here.
    rnn = copied("rpc_rnn_model_parallel")
    ntoken, ninp, nhid, nlayers, batch, nindices = 10, 2, 3, 4, 5, 3  # the tutorial's sizes
    table = rpc.remote("parameter_server", rnn.EmbeddingTable, args=(ntoken, ninp, 0.5))
    emb = rnn._remote_method(rnn.EmbeddingTable.forward, table, torch.randint(0, ntoken, (batch, nindices)))
    assert emb.shape == (batch, nindices, ninp)
    model = rnn.RNNModel("parameter_server", ntoken, ninp, nhid, nlayers)
    rrefs = model.parameter_rrefs()
    parts = [model.emb_table_rref.local_value(), model.rnn, model.decoder_rref.local_value()]
    expected = [p for part in parts for p in part.parameters()]
    assert len(rrefs) == len(expected) == 1 + 4 * 4 + 2  # embedding; 4 LSTM layers x 4; decoder weight and bias
    assert all(isinstance(r, PyRRef) for r in rrefs)
    assert all(r.local_value() is p for r, p in zip(rrefs, expected))
    opt = rnn.DistributedOptimizer(torch.optim.SGD, rrefs, lr=0.05)
    hidden = (torch.zeros(nlayers, nindices, nhid), torch.zeros(nlayers, nindices, nhid))
    before = [p.detach().clone() for p in expected]
    with dist_autograd.context() as context_id:
        output, hidden = model(torch.randint(0, ntoken, (batch, nindices)), hidden)
        loss = torch.nn.CrossEntropyLoss()(output.view(-1, ntoken), torch.randint(0, ntoken, (batch * nindices,)))
        dist_autograd.backward(context_id, [loss])
        opt.step(context_id)
    # One step of training moved every part: the remote table and decoder, and the local LSTM.
    assert all(not torch.equal(old, new) for old, new in zip(before, expected))


def check_hybrid_model_takes_a_rank_a_string_or_a_device():
    # The tutorial passes a rank (cuda:rank); a learner may pass "cpu" or a torch.device. With a GPU for each
    # trainer (here, one), a rank is its GPU; else the CPU.
    hybrid = copied("ddp_rpc_hybrid")
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    table = hybrid.RemoteModule("parameter_server", torch.nn.EmbeddingBag, args=(hybrid.NUM_EMBEDDINGS,
                                hybrid.EMBEDDING_DIM), kwargs={"mode": "sum"})
    rank_device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    for device, expected in ((0, rank_device), ("cpu", "cpu"), (torch.device("cpu"), "cpu")):
        model = hybrid.HybridModel(table, device)
        assert model.device == torch.device(expected)
        assert model(torch.tensor([1, 2, 3, 4]), torch.tensor([0, 2])).shape == (2, 8)
    # The tutorial's trainer, a learner's two of its epochs: the losses and the replica's weights come back.
    losses, fc_weights = hybrid._run_trainer(table, 0, epochs=2)
    assert len(losses) == 2 and set(fc_weights) == {"weight", "bias"}


def check_batch_parameter_server_answers_each_trainer_once_all_have_reported():
    # The tutorial's async_execution: a trainer's call returns only when the batch is full, with the model
    # updated from the mean of the gradients.
    bps = copied("rpc_batch_parameter_server")
    server = bps.BatchUpdateParameterServer(batch_update_size=2)
    rref, before = rpc.RRef(server), [p.detach().clone() for p in server.model.parameters()]
    grads = [[torch.full_like(p, value) for p in before] for value in (1.0, 3.0)]
    first = rpc.rpc_async("parameter_server", bps.BatchUpdateParameterServer.update_and_fetch_model,
                          args=(rref, grads[0]))
    assert not first.done(), "answered before the batch was full"
    second = rpc.rpc_sync("parameter_server", bps.BatchUpdateParameterServer.update_and_fetch_model,
                          args=(rref, grads[1]))
    for model in (first.wait(), second):  # both got the stepped model: SGD's first step is lr * mean grad
        for old, new in zip(before, model.parameters()):
            torch.testing.assert_close(new, old - 2 * 2.0)
    # The tutorial's Trainer and run_trainer, with its own call, against that server.
    trainer_losses = bps.run_trainer(rpc.RRef(bps.BatchUpdateParameterServer(batch_update_size=1)))
    assert len(trainer_losses) == 6


def check_batch_agent_answers_observers_once_all_states_are_in():
    # The batch CartPole's select_action_batch, as two observers call it: the first waits for the second,
    # then both get actions from one policy run, saved as one row of log-probs.
    brl = copied("rpc_batch_cartpole")
    agent = brl.Agent(1)  # the tutorial's call; two observers are faked by hand below
    agent.states, agent.pending_states = torch.zeros(2, 1, 4), 2
    call = functools.partial(rpc.rpc_async, "parameter_server", brl.Agent.select_action_batch)
    first = call(args=(agent.agent_rref, 0, torch.ones(1, 4)))
    assert not first.done(), "answered before every observer's state came"
    second = call(args=(agent.agent_rref, 1, torch.zeros(1, 4)))
    assert {first.wait(), second.wait()} <= {0, 1} and len(agent.saved_log_probs) == 1
    assert agent.saved_log_probs[0].shape == (2,)


CHECKS = [check_get_accuracy_evaluates_the_remote_model_in_eval_mode, check_load_mnist_needs_no_script_file,
          check_finish_episode_returns_and_loss,
          check_observer_calls_the_agent_twice_per_step, check_rnn_parts_take_the_tutorials_calls_and_train,
          check_hybrid_model_takes_a_rank_a_string_or_a_device,
          check_batch_parameter_server_answers_each_trainer_once_all_have_reported,
          check_batch_agent_answers_observers_once_all_states_are_in]


def run_checks(port, mnist_root, results):
    """In the spawned process: the RPC group of one, then each check, its traceback sent back if it failed."""
    global MNIST_ROOT
    MNIST_ROOT = mnist_root
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", _transports=["uv"])
    rpc.init_rpc("parameter_server", rank=0, world_size=1, rpc_backend_options=options)
    for check in CHECKS:
        try:
            check()
            results.send((check.__name__, None))
        except BaseException:
            results.send((check.__name__, traceback.format_exc()))
    rpc.shutdown()
    results.close()


@pytest.fixture(scope="module")
def checks(tiny_mnist):
    """{check name: None, or why it failed}. Spawned, not forked: a process that may use CUDA."""
    context = multiprocessing.get_context("spawn")
    answers, results = context.Pipe(duplex=False)
    helper = context.Process(target=run_checks, args=(free_port(), str(tiny_mnist), results), daemon=True)
    helper.start()
    results.close()
    done = {}
    try:
        while len(done) < len(CHECKS) and answers.poll(120):
            name, failure = answers.recv()
            done[name] = failure
    except EOFError:  # the process died
        pass
    finally:
        helper.kill()
        helper.join()
    return done


@pytest.mark.parametrize("check", CHECKS, ids=[check.__name__[len("check_"):] for check in CHECKS])
def test_in_an_rpc_group_of_one(check, checks):
    assert check.__name__ in checks, f"{check.__name__} never finished (the process died or hung)"
    assert checks[check.__name__] is None, checks[check.__name__]
