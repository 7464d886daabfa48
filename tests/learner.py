"""A learner's own program: the parameter server's tutorial part (all above its "Launching ranks" banner) copied
in, and driven as the upstream example drives it: torch.multiprocessing.spawn, MASTER_ADDR and MASTER_PORT,
rpc.init_rpc with default options (but TCP only), the tutorial's own calls, rpc.shutdown(). None of the script's
plumbing is there. Two trainers share the parameter server, each in a process of its own, as the tutorial's
several trainers do (the other classes, in one process: tests/test_classes.py).

    python learner.py PORT MNIST_ROOT
"""
import argparse
import os
import sys

import torch.distributed.rpc as rpc
import torch.multiprocessing as mp

PORT, MNIST_ROOT = sys.argv[1], sys.argv[2]
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "rpc_parameter_server.py")) as source:
    COPY = source.read().split("# --------- Launching ranks")[0]
CELL = {"__name__": __name__}  # the copy's globals, as a notebook cell's: no __file__
exec(COPY, CELL)
globals().update(CELL)  # where pickles of its functions find them, for RPC and mp.spawn


def run_worker(rank, world_size):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = PORT
    # The default options but TCP only: shared memory busy-polls a core, and the suite runs many processes.
    options = rpc.TensorPipeRpcBackendOptions(_transports=["uv"])
    if rank == 0:
        rpc.init_rpc("parameter_server", rank=rank, world_size=world_size, rpc_backend_options=options)
    else:
        rpc.init_rpc(f"trainer_{rank}", rank=rank, world_size=world_size, rpc_backend_options=options)
        train_loader, test_loader = load_mnist(argparse.Namespace(data_dir=MNIST_ROOT))  # noqa: F821 (the copy's)
        run_training_loop(rank, 0, train_loader, test_loader)  # noqa: F821
        print(f"Copied: trainer {rank} trained")
    rpc.shutdown()


if __name__ == "__main__":
    mp.spawn(run_worker, args=(3,), nprocs=3, join=True)
