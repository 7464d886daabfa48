"""The tutorial classes as a learner copies them, called as the tutorials call them, in an RPC
group of one."""
import functools
import sys
import types
from unittest import mock

import pytest

from conftest import BANNER, IN_PROCESS, ROOT, free_port

pytestmark = IN_PROCESS


@pytest.fixture(scope="module", autouse=True)
def rpc_group():
    import torch.distributed.rpc as rpc

    rpc.init_rpc("parameter_server", rank=0, world_size=1,
                 rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
                     init_method=f"tcp://127.0.0.1:{free_port()}", _transports=["uv"]))
    yield
    rpc.shutdown()


@functools.cache
def copied(script):
    """The script's tutorial part, in a module that RPC finds by name."""
    module = sys.modules[f"copied_{script}"] = types.ModuleType(f"copied_{script}")
    code = (ROOT / f"{script}.py").read_text().split(BANNER)[0]
    exec(code, module.__dict__)
    return module


def test_get_accuracy_evaluates_the_remote_model_in_eval_mode():
    import torch

    ps = copied("rpc_parameter_server")
    net, batch = ps.TrainerNet(), torch.randn(16, 1, 28, 28)
    assert not torch.equal(net(batch), net(batch)), "dropout should be on while training"
    ps.get_accuracy(torch.utils.data.DataLoader([(image, 0) for image in batch]), net)
    assert not ps.param_server.model.training and torch.equal(net(batch), net(batch))


def test_parameter_server_runs_one_pass_at_a_time():
    # Each pass sets the shared model's mode: evaluation beside training, without dropout.
    import threading

    import torch

    server = copied("rpc_parameter_server").ParameterServer()
    batch, outputs = torch.randn(4, 1, 28, 28), []
    training = threading.Thread(target=lambda: [server.forward(batch) for _ in range(300)])
    training.start()
    while training.is_alive():
        outputs.append(server.forward(batch, training=False))
    assert len(outputs) > 1 and all(torch.equal(out, outputs[0]) for out in outputs)


def test_finish_episode_discounts_each_observers_rewards_alone():
    import torch

    agent = copied("rpc_rl_cartpole").Agent(1, gamma=0.5)  # two observers faked here
    log_probs = {1: torch.zeros(3, requires_grad=True), 2: torch.zeros(2, requires_grad=True)}
    for ob, probs in log_probs.items():
        agent.rewards[ob], agent.saved_log_probs[ob] = [1.0] * len(probs), list(probs.split(1))
    assert agent.finish_episode() == 2.0  # the shorter episode's total reward
    returns = torch.tensor([1.75, 1.5, 1.0, 1.5, 1.0])  # 1 + 0.5 + 0.25, ...; then 1 + 0.5, 1
    # The gradient of sum(-log_prob * R) by each log_prob: the normalised -R.
    torch.testing.assert_close(torch.cat([log_probs[1].grad, log_probs[2].grad]),
                               -(returns - returns.mean()) / (returns.std() + agent.eps))


def test_each_observer_plays_its_own_episodes(monkeypatch):
    # Seeded by rank, where the tutorial's start alike.
    rl = copied("rpc_rl_cartpole")
    starts = []
    for rank in (1, 2):
        monkeypatch.setattr(rl.rpc, "get_worker_info", lambda: types.SimpleNamespace(id=rank))
        starts.append(rl.Observer().env.reset()[0].tolist())
    assert starts[0] != starts[1], starts


def test_rnn_parts_take_the_tutorials_calls_and_sizes():
    import torch

    rnn = copied("rpc_rnn_model_parallel")
    model = rnn.RNNModel("parameter_server", 10, 2, 3, 4)  # the tutorial's sizes
    parts = [model.emb_table_rref.local_value(), model.rnn, model.decoder_rref.local_value()]
    params = [param for part in parts for param in part.parameters()]
    rrefs = model.parameter_rrefs()
    assert len(rrefs) == len(params) == 1 + 4 * 4 + 2  # the table, 4 LSTM layers, the decoder
    assert all(rref.local_value() is param for rref, param in zip(rrefs, params))
    output, _ = model(torch.randint(0, 10, (5, 3)), (torch.zeros(4, 3, 3),) * 2)
    assert output.shape == (5, 3, 10)


def test_hybrid_model_takes_a_rank_or_a_device():
    import torch

    # The tutorial's rank, cuda:rank where there is one; a learner's "cpu".
    hybrid, rank_0 = copied("ddp_rpc_hybrid"), "cuda" if torch.cuda.is_available() else "cpu"
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0,
                                         world_size=1)
    table = hybrid.RemoteModule("parameter_server", torch.nn.EmbeddingBag, args=(100, 16),
                                kwargs={"mode": "sum"})
    assert hybrid.HybridModel(table, 0).device.type == rank_0
    assert hybrid.HybridModel(table, "cpu").device.type == "cpu"
    losses, fc_weights = hybrid._run_trainer(table, 0, epochs=2)  # the tutorial's call
    assert len(losses) == 2 and set(fc_weights) == {"weight", "bias"}


def test_batch_parameter_server_answers_every_trainer_once_all_have_sent():
    import torch
    import torch.distributed.rpc as rpc

    bps = copied("rpc_batch_parameter_server")
    rref = rpc.RRef(bps.BatchUpdateParameterServer(batch_update_size=2))
    before = [param.detach().clone() for param in rref.local_value().model.parameters()]
    call = functools.partial(rpc.rpc_async, "parameter_server",
                             bps.BatchUpdateParameterServer.update_and_fetch_model)
    first = call(args=(rref, [torch.full_like(param, 1.0) for param in before]))
    assert not first.done(), "answered before the batch was full"
    second = call(args=(rref, [torch.full_like(param, 3.0) for param in before]))
    for model in (first.wait(), second.wait()):  # one step, of lr 2 * the mean gradient
        torch.testing.assert_close(list(model.parameters()), [old - 2 * 2.0 for old in before])


def test_batch_agent_answers_each_observer_from_one_policy_run():
    import torch
    import torch.distributed.rpc as rpc

    brl = copied("rpc_batch_cartpole")
    agent = brl.Agent(1)  # the tutorial's call; two observers faked here
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


def test_agent_without_batching_weighs_each_action_by_its_observers_returns():
    import torch

    agent = copied("rpc_batch_cartpole").Agent(1, batch=False)  # two observers faked here
    returns = torch.tensor([[1.0, 3.0], [2.0, 4.0]])  # steps by observers
    log_probs = torch.zeros(2, 2, requires_grad=True)
    agent.saved_log_probs = {ob: list(log_probs[:, ob:ob + 1]) for ob in (0, 1)}
    agent.ob_rrefs = [mock.Mock(), mock.Mock()]
    for ob, rref in enumerate(agent.ob_rrefs):  # its episode has ended with these returns
        rref.rpc_async().run_episode.return_value = episode = torch.futures.Future()
        episode.set_result([returns[:, ob], 2])
    agent.run_episode(n_steps=2)
    torch.testing.assert_close(log_probs.grad, -returns / 2)  # the mean over observers
