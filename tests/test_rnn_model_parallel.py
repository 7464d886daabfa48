"""rpc_rnn_model_parallel.py: an RNN split between a parameter server and a trainer."""
import ipaddress
import re
import socket

import psutil

from conftest import ROOT, assert_succeeded, summary, terminals


def epoch_losses(out):
    return re.findall(r"^Training epoch \d+ loss (\d+\.\d{4})$", out, re.M)


def shape_and_numbers(line):
    """The line with its numbers as #, and the numbers, but for the seconds it took."""
    line = re.sub(r"seconds=\S+", "", line)
    return re.sub(r"\d+\.\d+|\d+", "#", line), [float(n) for n in re.findall(r"\d+\.\d+|\d+", line)]


def test_the_readmes_command_learns_and_prints_its_sample(run):
    proc = run("rpc_rnn_model_parallel.py").wait()
    assert_succeeded(proc)
    losses = [float(loss) for loss in epoch_losses(proc.out)]
    assert len(losses) == 10 and losses[-1] < losses[0] - 0.5, f"the loss should fall: {proc}"
    assert summary(proc.out)["final_loss"] == f"{losses[-1]:.4f}", proc
    # The README's sample lines, each with the numbers of a line printed here, to the 0.01 that
    # the README allows another CPU or torch release.
    readme = (ROOT / "README.md").read_text().split("python rpc_rnn_model_parallel.py\n```")[1]
    sample = [line for line in readme.split("```")[1].splitlines() if line not in ("", "...")]
    printed = [shape_and_numbers(line) for line in proc.out.splitlines()]
    assert len(sample) > 2, readme
    for shape, numbers in map(shape_and_numbers, sample):
        assert any(shape == twin and all(abs(a - b) <= 0.01 for a, b in zip(numbers, its))
                   for twin, its in printed), (shape, numbers, proc)


def own_address():
    """(interface, address) of this host's first IPv4 address that is not loopback, else lo's."""
    for name, addrs in psutil.net_if_addrs().items():
        for addr in addrs:
            if addr.family == socket.AF_INET and not ipaddress.ip_address(addr.address).is_loopback:
                return name, addr.address
    return "lo", "localhost"


def test_same_seed_one_terminal_per_rank_prints_the_same_losses(run):
    # The trainer drives training alone, so the ranks of one terminal each, started as a person
    # starts them (rank 1 two seconds after rank 0 listens), at this host's own address with its
    # --ifname, as the README says for several machines, print the one command's losses exactly.
    ifname, addr = own_address()
    one_command = run("rpc_rnn_model_parallel.py")
    ranks = terminals(run, "rpc_rnn_model_parallel.py", 2, "--master_addr", addr, "--ifname",
                      ifname, late=2)
    assert_succeeded(one_command.wait(), *[rank.wait() for rank in ranks])
    assert "Summary:" not in ranks[0].out, ranks[0]  # the trainer's terminal shows the training
    assert len(epoch_losses(ranks[1].out)) == 10, ranks[1]
    assert epoch_losses(ranks[1].out) == epoch_losses(one_command.out), (ranks[1], one_command)
