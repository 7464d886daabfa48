"""A learner's own program: the tutorial part of a script (all above its "Launching ranks" banner) copied in,
and driven as the upstream examples drive it: torch.multiprocessing.spawn, MASTER_ADDR and MASTER_PORT,
rpc.init_rpc with default options (but TCP only), the tutorials' own calls, rpc.shutdown(). None of the script's plumbing
is there, so a class that needs it fails with a NameError, and one that needs other arguments, a TypeError.

    python learner.py SCRIPT PORT PORT2 [MNIST_ROOT]   (two free ports: DDP's tutorial uses two)
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
import torch.optim as optim
from torch.distributed.optim import DistributedOptimizer

SCRIPT, PORT, PORT2 = sys.argv[1], sys.argv[2], sys.argv[3]
with open(SCRIPT) as source:
    exec(source.read().split("# --------- Launching ranks")[0])  # the copy


def options(**kwargs):
    # The default options but TCP only: shared memory busy-polls a core, and the suite runs many processes.
    return rpc.TensorPipeRpcBackendOptions(_transports=["uv"], **kwargs)


def parameter_server(rank, world_size):
    if rank == 0:
        rpc.init_rpc("parameter_server", rank=rank, world_size=world_size, rpc_backend_options=options())
    else:
        rpc.init_rpc(f"trainer_{rank}", rank=rank, world_size=world_size, rpc_backend_options=options())
        from torchvision import datasets, transforms

        transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])
        train = datasets.MNIST(sys.argv[4], train=True, transform=transform)
        test = datasets.MNIST(sys.argv[4], train=False, transform=transform)
        train_loader = torch.utils.data.DataLoader(train, batch_size=8, shuffle=True)
        test_loader = torch.utils.data.DataLoader(test, batch_size=8)
        run_training_loop(rank, 0, train_loader, test_loader)
        print(f"Copied: pattern=parameter_server state_dict={len(Net().state_dict())}")
    rpc.shutdown()


def rl_cartpole(rank, world_size):
    if rank == 0:
        rpc.init_rpc(AGENT_NAME, rank=rank, world_size=world_size, rpc_backend_options=options())
        agent = Agent(world_size)
        for _ in range(3):
            agent.run_episode()
            last_reward = agent.finish_episode()
        print(f"Copied: pattern=rl_cartpole last_reward={last_reward}")
    else:
        rpc.init_rpc(OBSERVER_NAME.format(rank), rank=rank, world_size=world_size, rpc_backend_options=options())
    rpc.shutdown()


def rnn_model_parallel(rank, world_size):
    ntoken, ninp, nhid, nlayers, batch, nindices = 10, 2, 3, 4, 5, 3  # the tutorial's sizes
    if rank == 0:
        rpc.init_rpc("ps", rank=rank, world_size=world_size, rpc_backend_options=options())
    else:
        rpc.init_rpc("trainer", rank=rank, world_size=world_size, rpc_backend_options=options())
        table = rpc.remote("ps", EmbeddingTable, args=(ntoken, ninp, 0.5))
        decoder = rpc.remote("ps", Decoder, args=(ntoken, nhid, 0.5))
        emb = _remote_method(EmbeddingTable.forward, table, torch.randint(0, ntoken, (batch, nindices)))
        out = _remote_method(Decoder.forward, decoder, torch.randn(batch, nindices, nhid))
        assert emb.shape == (batch, nindices, ninp) and out.shape == (batch, nindices, ntoken)
        model = RNNModel("ps", ntoken, ninp, nhid, nlayers)
        opt = DistributedOptimizer(optim.SGD, model.parameter_rrefs(), lr=0.05)
        hidden = (torch.zeros(nlayers, nindices, nhid), torch.zeros(nlayers, nindices, nhid))
        for _ in range(3):
            data, target = torch.randint(0, ntoken, (batch, nindices)), torch.randint(0, ntoken, (batch * nindices,))
            with dist_autograd.context() as context_id:
                output, hidden = model(data, (hidden[0].detach(), hidden[1].detach()))
                loss = torch.nn.CrossEntropyLoss()(output.view(-1, ntoken), target)
                dist_autograd.backward(context_id, [loss])
                opt.step(context_id)
        print(f"Copied: pattern=rnn_model_parallel parameters={len(_parameter_rrefs(model.rnn))}")
    rpc.shutdown()


def ddp_rpc_hybrid(rank, world_size):
    # The tutorial's ranks: trainers 0 and 1 (DDP over their own Gloo group), the master 2, the ps 3.
    rpc_options = options(init_method=f"tcp://localhost:{PORT2}")
    if rank == 2:
        rpc.init_rpc("master", rank=rank, world_size=world_size, rpc_backend_options=rpc_options)
        remote_emb_module = RemoteModule("ps", torch.nn.EmbeddingBag, args=(NUM_EMBEDDINGS, EMBEDDING_DIM),
                                         kwargs={"mode": "sum"})
        # The tutorial's call; a learner's keyword keeps 2 of its 100 epochs, for a short test.
        futs = [rpc.rpc_async(f"trainer{r}", _run_trainer, args=(remote_emb_module, r), kwargs={"epochs": 2})
                for r in (0, 1)]
        for fut in futs:
            fut.wait()
        print("Copied: pattern=ddp_rpc_hybrid")
    elif rank <= 1:
        dist.init_process_group(backend="gloo", rank=rank, world_size=2)
        rpc.init_rpc(f"trainer{rank}", rank=rank, world_size=world_size, rpc_backend_options=rpc_options)
    else:
        rpc.init_rpc("ps", rank=rank, world_size=world_size, rpc_backend_options=rpc_options)
    rpc.shutdown()


def run_worker(rank, world_size, pattern):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = PORT
    pattern(rank, world_size)


if __name__ == "__main__":
    name = os.path.basename(SCRIPT)[:-3].removeprefix("rpc_")
    world_size = 4 if name == "ddp_rpc_hybrid" else 2
    mp.spawn(run_worker, args=(world_size, globals()[name]), nprocs=world_size, join=True)
