"""Typical mistakes of lab 2 (see tests/mistakes.py).

Each source replaces a whole solution cell (``%%writefile`` line included), so it is also a
complete wrong answer that ``tests/test_lab02.py`` runs through the checks.
"""

LAB = "lab02_collectives"

_RING_HEAD = """%%writefile ring.py
import torch
import torch.distributed as dist


def ring_all_reduce(tensor):
    rank, n = dist.get_rank(), dist.get_world_size()
    flat = tensor.view(-1)
    chunks = list(torch.tensor_split(flat, n))
    right, left = (rank + 1) % n, (rank - 1) % n
"""

_ALL_GATHER = """    for step in range(n - 1):
        send, recv = chunks[(rank + 1 - step) % n], chunks[(rank - step) % n]
        request = dist.isend(send, dst=right)
        dist.recv(recv, src=left)
        request.wait()
    return tensor
"""

#: A ring whose reduce-scatter stops one step early: chunks keep partial sums.
RING_SKIPS_A_STEP = (
    _RING_HEAD
    + """    for step in range(n - 2):  # BUG: n - 1 steps are needed
        send, recv = chunks[(rank - step) % n], chunks[(rank - step - 1) % n]
        request = dist.isend(send, dst=right)
        received = torch.empty_like(recv)
        dist.recv(received, src=left)
        request.wait()
        recv += received
"""
    + _ALL_GATHER
)

#: A ring in which every rank blocks in recv before sending: the torchrun job deadlocks.
RING_RECV_FIRST = (
    _RING_HEAD
    + """    for step in range(n - 1):
        send, recv = chunks[(rank - step) % n], chunks[(rank - step - 1) % n]
        received = torch.empty_like(recv)
        dist.recv(received, src=left)  # BUG: every rank waits here, nobody has sent
        dist.send(send, dst=right)
        recv += received
"""
    + _ALL_GATHER
)

#: The built-in collective instead of the ring: refused while the exercise runs.
RING_CALLS_ALL_REDUCE = (
    _RING_HEAD
    + """    dist.all_reduce(tensor)
    return tensor
"""
)

#: A "solution" that hands the work to the grader's own reference.
RING_IMPORTS_REFERENCE = """%%writefile ring.py
from ddp_lab.collectives import ring_all_reduce as reference


def ring_all_reduce(tensor):
    return reference(tensor)
"""

#: The server adds everything up but forgets to divide by the number of ranks.
PS_FORGETS_TO_DIVIDE = """%%writefile ps.py
import torch
import torch.distributed as dist


def parameter_server_average(tensor):
    rank, n = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        incoming = torch.empty_like(tensor)
        for worker in range(1, n):
            dist.recv(incoming, src=worker)
            tensor += incoming
        for worker in range(1, n):  # BUG: the sum, not the average
            dist.send(tensor, dst=worker)
    else:
        dist.send(tensor, dst=0)
        dist.recv(tensor, src=0)
    return tensor
"""

#: The bandwidth term without its factor 2(n - 1)/n.
RING_TIME_NO_FACTOR = """import numpy as np


def ring_time(size_bytes, world_size, alpha, bandwidth):
    n = world_size
    return 2 * (n - 1) * alpha + size_bytes / bandwidth
"""

#: The fit's bandwidth column without the factor 2(n - 1)/n: B comes out n / (2(n - 1)) too small.
FIT_NO_FACTOR = """import numpy as np


def fit_alpha_beta(sizes, seconds, world_size):
    s, t, n = np.asarray(sizes, dtype=float), np.asarray(seconds, dtype=float), world_size
    rows = np.stack([np.full_like(s, 2 * (n - 1)), s], axis=1)
    (alpha, inverse_bandwidth), *_ = np.linalg.lstsq(rows / t[:, None], np.ones_like(t))
    return float(alpha), float(1 / inverse_bandwidth)
"""

#: A least-squares fit on absolute errors: the largest messages decide, alpha is lost.
FIT_ABSOLUTE = """import numpy as np


def fit_alpha_beta(sizes, seconds, world_size):
    s, t, n = np.asarray(sizes, dtype=float), np.asarray(seconds, dtype=float), world_size
    rows = np.stack([np.full_like(s, 2 * (n - 1)), 2 * (n - 1) / n * s], axis=1)
    (alpha, inverse_bandwidth), *_ = np.linalg.lstsq(rows, t)
    return float(alpha), float(1 / inverse_bandwidth)
"""

MISTAKES = {
    "ex1_ring_all_reduce": RING_SKIPS_A_STEP,
    "ex2_parameter_server": PS_FORGETS_TO_DIVIDE,
    "ex3_ring_time": RING_TIME_NO_FACTOR,
    "ex4_fit_alpha_beta": FIT_NO_FACTOR,
}

HANGS = {"ex1_ring_all_reduce": RING_RECV_FIRST}
HANG_LOSES = ["test_ex1_ring_all_reduce"]

#: What a cheater writes by hand: the result files the lab's cells read, and a ring.py that
#: sits next to a notebook whose own cell still raises NotImplementedError.
FORGED_FILES = {
    "result.json": '{"world_size": 3, "ranks": []}',
    "ring.py": (
        "import torch.distributed as dist\n\n\n"
        "def ring_all_reduce(tensor):\n    dist.all_reduce(tensor)\n    return tensor\n"
    ),
    "ps.py": (
        "import torch.distributed as dist\n\n\n"
        "def parameter_server_average(tensor):\n"
        "    dist.all_reduce(tensor)\n    tensor /= dist.get_world_size()\n    return tensor\n"
    ),
}
