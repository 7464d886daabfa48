"""`python learner.py PORT MNIST_ROOT`: the parameter server's tutorial part, copied as into a
notebook cell, run as the upstream example runs it."""
import argparse
import os
import sys

import torch.distributed.rpc as rpc
import torch.multiprocessing as mp

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "rpc_parameter_server.py")
CELL = {"__name__": __name__}
with open(SCRIPT) as script:
    exec(script.read().split("# --------- Launching ranks")[0], CELL)
globals().update(CELL)  # where pickles of the copy's functions find them


def run_worker(rank, world_size):
    os.environ.update(MASTER_ADDR="localhost", MASTER_PORT=sys.argv[1])
    options = rpc.TensorPipeRpcBackendOptions(_transports=["uv"])  # shared memory busy-polls
    name = f"trainer_{rank}" if rank else "parameter_server"
    rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=options)
    if rank:
        loaders = CELL["load_mnist"](argparse.Namespace(data_dir=sys.argv[2]))
        CELL["run_training_loop"](rank, 0, *loaders)
        print(f"Copied: trainer {rank} trained")
    rpc.shutdown()


if __name__ == "__main__":
    mp.spawn(run_worker, args=(3,), nprocs=3, join=True)
