"""A Python that has loaded torch once, and forks a process for each script run the tests ask for.

Loading torch costs about 2.5 s of CPU per process, most of what the failure tests spend on two
cores. Each run forked here is still a process of its own running the script as `__main__` with
its own command line, environment, session and pipes (conftest.Run); only the imports are done.
Runs that must start a fresh interpreter (torchrun, --debug) do not come here. Never touches CUDA, so forking stays safe on GPU machines.

Protocol, over the SOCK_SEQPACKET socket whose fd is the one argument: a request is JSON [script, args, env, cwd,
network namespace or null] with stdout and stderr as two fds; the answer is ["started", pid]; when a run ends, ["ended", pid,
wait status]. The server exits when the socket closes (pytest has ended).
"""
import ctypes
import gc
import json
import os
import select
import signal
import socket
import sys
import tempfile

os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"  # what each script sets before torch loads (runs with --debug start fresh)
import gymnasium  # noqa: E402,F401  what the four scripts import, so that their own imports find it loaded
import torch  # noqa: E402
import torch.distributed.optim  # noqa: E402,F401
import torch.distributed.rpc  # noqa: E402,F401
import torch.nn.parallel  # noqa: E402,F401
import torchvision.datasets  # noqa: E402,F401


def serve(sock):
    """Answer requests until the socket closes; in a forked child, return its request."""
    children = set()
    while True:
        ready, _, _ = select.select([sock], [], [], 0.02)
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                sock.send(json.dumps(["ended", pid, status]).encode())
        if not ready:
            continue
        data, fds, _, _ = socket.recv_fds(sock, 1 << 20, 2)
        if not data:
            sys.exit(0)
        pid = os.fork()
        if pid == 0:
            sock.close()
            return json.loads(data), fds
        children.add(pid)
        for fd in fds:
            os.close(fd)
        sock.send(json.dumps(["started", pid]).encode())


def run(request, fds):
    """This child becomes `python script args...` as far as the script can tell, and exits as it would."""
    (script, args, env, cwd, netns), (out, err) = request, fds
    os.setsid()  # as Popen(start_new_session=True)
    if netns:  # as `ip netns exec NETNS`, which the test's second host needs
        with open(f"/var/run/netns/{netns}") as namespace:
            if ctypes.CDLL(None, use_errno=True).setns(namespace.fileno(), 0x40000000):  # CLONE_NEWNET
                raise OSError(ctypes.get_errno(), f"setns {netns}")
    for signum, handler in ((signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, signal.SIG_DFL),
                            (signal.SIGCHLD, signal.SIG_DFL)):
        signal.signal(signum, handler)
    null = os.open(os.devnull, os.O_RDONLY)
    for fd, target in ((null, 0), (out, 1), (err, 2)):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None  # read TMPDIR again, as a fresh start would
    if "OMP_NUM_THREADS" in env:  # OpenMP read it when torch loaded here: apply it as a fresh start would
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    sys.argv, sys.path[0] = [script, *args], os.path.dirname(script)
    import runpy
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    # What torch's import made is never garbage: frozen, a forked run's collections (the last, at its exit,
    # visits every object) skip it, and copy none of its pages. Half the CPU of a run of one rank per process.
    gc.freeze()
    run(*serve(socket.socket(fileno=int(sys.argv[1]))))
