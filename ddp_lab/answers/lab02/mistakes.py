"""Typical mistakes of lab 2 (instructor only), for the tests and the sample class.

Each source replaces a whole solution cell (``%%writefile`` line included), as a student
would write it. ``MISTAKES`` lists, per exercise, the sample class's typical mistake first;
``reason`` is a fragment of the grader's message that proves the diagnosis.
"""

from __future__ import annotations

from ddp_lab.answers import Mistake

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

#: A ring written in one loop over both phases that adds in both: the all-gather must
#: overwrite, so chunks come out with some ranks' values counted twice.
RING_ADDS_IN_BOTH_PHASES = """%%writefile ring.py
import torch
import torch.distributed as dist


def ring_all_reduce(tensor):
    me, size = dist.get_rank(), dist.get_world_size()
    pieces = torch.tensor_split(tensor.view(-1), size)
    for k in range(2 * (size - 1)):
        outgoing = pieces[(me - k) % size]
        incoming = torch.zeros_like(pieces[(me - k - 1) % size])
        req = dist.isend(outgoing.clone(), (me + 1) % size)
        dist.recv(incoming, (me - 1) % size)
        req.wait()
        pieces[(me - k - 1) % size].add_(incoming)  # BUG: the second phase must copy
    return tensor
"""

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

#: A "solution" that hands the work to the course's own answer.
RING_IMPORTS_THE_ANSWER = """%%writefile ring.py
from ddp_lab.answers.lab02.references import ring_all_reduce as reference


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

#: The server computes the average and keeps it: the workers never get it back.
PS_NEVER_SENDS_BACK = """%%writefile ps.py
import torch
import torch.distributed as dist


def parameter_server_average(tensor):
    rank, n = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        incoming = torch.empty_like(tensor)
        for worker in range(1, n):
            dist.recv(incoming, src=worker)
            tensor += incoming
        tensor /= n
    else:
        dist.send(tensor, dst=0)  # BUG: and then? the average never comes back
    return tensor
"""

#: The bandwidth term without its factor 2(n - 1)/n.
RING_TIME_NO_FACTOR = """import numpy as np


def ring_time(size_bytes, world_size, alpha, bandwidth):
    n = world_size
    return 2 * (n - 1) * alpha + size_bytes / bandwidth
"""

#: The latency paid once instead of in each of the 2(n - 1) steps.
RING_TIME_ALPHA_ONCE = """import numpy as np


def ring_time(size_bytes, world_size, alpha, bandwidth):
    n = world_size
    if n == 1:
        return 0 * np.asarray(size_bytes, dtype=float)
    return alpha + 2 * (n - 1) / n * size_bytes / bandwidth
"""

#: The course's answer imported instead of written.
RING_TIME_IMPORTS_THE_ANSWER = """import ddp_lab.answers.lab02.references as c


def ring_time(size_bytes, world_size, alpha, bandwidth):
    return c.ring_allreduce_time(size_bytes, world_size, alpha, bandwidth)
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

MISTAKES = [
    Mistake("ex1_ring_all_reduce", "typical", RING_ADDS_IN_BOTH_PHASES, "is wrong in chunk(s)"),
    Mistake("ex1_ring_all_reduce", "skips a step", RING_SKIPS_A_STEP, "skips a step"),
    Mistake(
        "ex1_ring_all_reduce",
        "calls all_reduce",
        RING_CALLS_ALL_REDUCE,
        "torch.distributed.all_reduce is not allowed",
    ),
    Mistake(
        "ex1_ring_all_reduce", "imports the answer", RING_IMPORTS_THE_ANSWER, "uses ddp_lab.answers"
    ),
    Mistake(
        "ex2_parameter_server",
        "typical",
        PS_FORGETS_TO_DIVIDE,
        "divide by the world size",
    ),
    Mistake(
        "ex2_parameter_server",
        "never sends back",
        PS_NEVER_SENDS_BACK,
        "the server must send the average back",
    ),
    Mistake("ex3_ring_time", "typical", RING_TIME_NO_FACTOR, "factor 2(n - 1)/n"),
    Mistake(
        "ex3_ring_time",
        "alpha once",
        RING_TIME_ALPHA_ONCE,
        "every one of the 2(n - 1) steps pays alpha",
    ),
    Mistake(
        "ex3_ring_time",
        "imports the answer",
        RING_TIME_IMPORTS_THE_ANSWER,
        "uses ddp_lab.answers",
    ),
    Mistake("ex4_fit_alpha_beta", "typical", FIT_NO_FACTOR, "factor 2(n - 1)/n"),
    Mistake("ex4_fit_alpha_beta", "absolute errors", FIT_ABSOLUTE, "absolute errors"),
]

#: A deadlocking solution (the sample class's ``hang`` student) and the test cells it costs.
HANGS = {"ex1_ring_all_reduce": RING_RECV_FIRST}
HANG_LOSES = ["test_ex1_ring_all_reduce"]

#: What a cheater writes by hand: a result file, and a ring.py / ps.py that sit next to a
#: notebook whose own cells still hold the stubs (the grader writes the cells' files itself).
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
