"""Typical mistakes of lab 2 (instructor only), for the tests and the sample class.

Each source replaces a whole solution cell (``%%writefile`` line included), as a student
would write it. ``MISTAKES`` lists, per exercise, the sample class's typical mistake first
(written independently of the solution, so that the mistake student is not a near-copy);
``reason`` is a fragment of the grader's message that proves the diagnosis.
"""

from __future__ import annotations

from ddp_lab.answers import Mistake

# --------------------------------------------------------------------------- exercise 1: the ring

#: A ring that runs the other way round: every rank sends to its left neighbour. The sums are
#: right; the traffic is not a ring's (rank r must send only to r + 1).
RING_WRONG_NEIGHBOUR = """%%writefile ring.py
import torch
import torch.distributed as dist


def ring_all_reduce(tensor):
    me = dist.get_rank()
    world = dist.get_world_size()
    parts = torch.tensor_split(tensor.view(-1), world)
    to_rank, from_rank = (me - 1) % world, (me + 1) % world  # BUG: the ring runs left
    # phase 1: every part collects one contribution per step
    for i in range(world - 1):
        out_idx, in_idx = (me + i) % world, (me + i + 1) % world
        buf = torch.zeros_like(parts[in_idx])
        req = dist.isend(parts[out_idx].clone(), to_rank)
        dist.recv(buf, from_rank)
        req.wait()
        parts[in_idx].add_(buf)
    # phase 2: hand the finished parts on
    for i in range(world - 1):
        out_idx, in_idx = (me - 1 + i) % world, (me + i) % world
        buf = torch.zeros_like(parts[in_idx])
        req = dist.isend(parts[out_idx].clone(), to_rank)
        dist.recv(buf, from_rank)
        req.wait()
        parts[in_idx].copy_(buf)
    return tensor
"""

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

#: A right ring that forgets to return: every tensor holds the sum, but the docstring
#: promises `tensor` itself back (a caller writing `x = ring_all_reduce(x)` gets None).
RING_RETURNS_NOTHING = (
    _RING_HEAD
    + """    for step in range(n - 1):
        send, recv = chunks[(rank - step) % n], chunks[(rank - step - 1) % n]
        request = dist.isend(send, dst=right)
        received = torch.empty_like(recv)
        dist.recv(received, src=left)
        request.wait()
        recv += received
"""
    + _ALL_GATHER.replace("    return tensor\n", "")
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

#: Whole tensors passed around the ring: the right sum, only to the right neighbour, but
#: n - 1 whole tensors per rank instead of 2(n - 1)/n of one.
RING_WHOLE_TENSORS = """%%writefile ring.py
import torch
import torch.distributed as dist


def ring_all_reduce(tensor):
    rank, n = dist.get_rank(), dist.get_world_size()
    passing, total = tensor.clone(), tensor.clone()
    for _ in range(n - 1):  # BUG: every step moves the whole tensor
        incoming = torch.empty_like(passing)
        request = dist.isend(passing, dst=(rank + 1) % n)
        dist.recv(incoming, src=(rank - 1) % n)
        request.wait()
        total += incoming
        passing = incoming
    tensor.copy_(total)
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

# --------------------------------------------------------------------------- exercise 2: the server

#: Workers push their gradients and never pull: every gradient is the initial parameters'.
PS_NEVER_PULLS = """%%writefile ps.py
import torch
import torch.distributed as dist


def parameter_server(params, optimizer, grad_fn, steps):
    me, world = dist.get_rank(), dist.get_world_size()
    if me != 0:
        for step in range(steps):
            g = grad_fn(params)
            dist.send(g.contiguous(), 0)  # BUG: push, and never pull the new parameters
        return params
    buffers = [torch.zeros_like(params) for _ in range(world - 1)]
    for step in range(steps):
        for i, buf in enumerate(buffers):
            dist.recv(buf, i + 1)
        params.grad = torch.stack(buffers).mean(dim=0)
        optimizer.step()
    return params
"""

_SERVER_HEAD = """%%writefile ps.py
import torch
import torch.distributed as dist


def parameter_server(params, optimizer, grad_fn, steps):
    rank, n = dist.get_rank(), dist.get_world_size()
    if rank > 0:
        for _ in range(steps):
            dist.send(grad_fn(params), dst=0)
            dist.recv(params, src=0)
        return params
    for _ in range(steps):
        grads = []
        for worker in range(1, n):
            g = torch.empty_like(params)
            dist.recv(g, src=worker)
            grads.append(g)
"""

_SERVER_TAIL = """        optimizer.step()
        for worker in range(1, n):
            dist.send(params, dst=worker)
    return params
"""

#: The server applies the sum of the workers' gradients.
PS_SUMS = _SERVER_HEAD + "        params.grad = sum(grads)  # BUG: the mean\n" + _SERVER_TAIL

#: The server divides by every rank, itself included.
PS_DIVIDES_BY_N = (
    _SERVER_HEAD + "        params.grad = sum(grads) / n  # BUG: n - 1\n" + _SERVER_TAIL
)

# --------------------------------------------------------------------------- exercise 3: staleness

#: The worker pulls one step too late: it runs staleness + 1 steps ahead.
STALE_OFF_BY_ONE = """%%writefile ps_stale.py
import torch
import torch.distributed as dist


def stale_parameter_server(params, optimizer, grad_fn, steps, staleness):
    rank, n = dist.get_rank(), dist.get_world_size()
    if rank > 0:
        received = 0
        for t in range(steps):
            dist.send(grad_fn(params), dst=0)
            if t > staleness:  # BUG: off by one, the worker falls one step too far behind
                dist.recv(params, src=0)
                received += 1
        for _ in range(steps - received):
            dist.recv(params, src=0)
        return params
    sends = []
    for t in range(steps):
        grads = []
        for w in range(1, n):
            g = torch.empty_like(params)
            dist.recv(g, src=w)
            grads.append(g)
        params.grad = sum(grads) / len(grads)
        optimizer.step()
        snap = params.clone()
        for w in range(1, n):
            sends.append(dist.isend(snap, dst=w))
    for s in sends:
        s.wait()
    return params
"""

#: Staleness ignored: the synchronous server of exercise 2, pulling after every push.
STALE_IGNORED = (
    (_SERVER_HEAD + "        params.grad = sum(grads) / len(grads)\n" + _SERVER_TAIL)
    .replace("%%writefile ps.py", "%%writefile ps_stale.py")
    .replace("def parameter_server(", "def stale_parameter_server(")
    .replace("grad_fn, steps):", "grad_fn, steps, staleness):  # BUG: never used")
)

# --------------------------------------------------------------------------- exercise 4: the model

_SERVER_TIME = """

def server_time(size_bytes, world_size, alpha, bandwidth):
    messages = 2 * (world_size - 1)
    return messages * alpha + messages * np.asarray(size_bytes, dtype=float) / bandwidth
"""

_FIT = """

def fit_alpha_beta(sizes, seconds, world_size):
    sizes, seconds = np.asarray(sizes, dtype=float), np.asarray(seconds, dtype=float)
    hops = 2 * (world_size - 1)
    a = np.column_stack([hops * np.ones_like(sizes), hops / world_size * sizes])
    a = a / seconds[:, None]
    solution = np.linalg.lstsq(a, np.ones(len(seconds)), rcond=None)[0]
    return float(solution[0]), float(1.0 / solution[1])
"""


def _model(ring: str, server: str = _SERVER_TIME, fit: str = _FIT) -> str:
    return "import numpy as np\n\n\n" + ring.strip("\n") + "\n" + server + fit


#: The bandwidth term without its factor 2(n - 1)/n.
RING_TIME_NO_FACTOR = _model(
    """def ring_time(size_bytes, world_size, alpha, bandwidth):
    hops = 2 * (world_size - 1)
    return hops * alpha + np.asarray(size_bytes, dtype=float) / bandwidth  # BUG: 2(n-1)/n S"""
)

#: The latency paid once instead of in each of the 2(n - 1) steps.
RING_TIME_ALPHA_ONCE = _model(
    """def ring_time(size_bytes, world_size, alpha, bandwidth):
    n = world_size
    if n == 1:
        return 0 * np.asarray(size_bytes, dtype=float)
    return alpha + 2 * (n - 1) / n * size_bytes / bandwidth"""
)

_RING_TIME = """def ring_time(size_bytes, world_size, alpha, bandwidth):
    n = world_size
    return 2 * (n - 1) * alpha + 2 * (n - 1) / n * size_bytes / bandwidth"""

#: The server's step without the way back: only the n - 1 pushes.
SERVER_TIME_ONE_WAY = _model(
    _RING_TIME,
    server="""

def server_time(size_bytes, world_size, alpha, bandwidth):
    return (world_size - 1) * (alpha + size_bytes / bandwidth)
""",
)

#: The server costed like a ring.
SERVER_TIME_LIKE_A_RING = _model(
    _RING_TIME,
    server="""

def server_time(size_bytes, world_size, alpha, bandwidth):
    return ring_time(size_bytes, world_size, alpha, bandwidth)
""",
)

#: The fit's bandwidth column without the factor 2(n - 1)/n: B comes out n / (2(n - 1)) too small.
FIT_NO_FACTOR = _model(
    _RING_TIME,
    fit="""

def fit_alpha_beta(sizes, seconds, world_size):
    s, t, n = np.asarray(sizes, dtype=float), np.asarray(seconds, dtype=float), world_size
    rows = np.stack([np.full_like(s, 2 * (n - 1)), s], axis=1)
    (alpha, inverse_bandwidth), *_ = np.linalg.lstsq(rows / t[:, None], np.ones_like(t))
    return float(alpha), float(1 / inverse_bandwidth)
""",
)

#: A least-squares fit on absolute errors: the largest messages decide, alpha is lost.
FIT_ABSOLUTE = _model(
    _RING_TIME,
    fit="""

def fit_alpha_beta(sizes, seconds, world_size):
    s, t, n = np.asarray(sizes, dtype=float), np.asarray(seconds, dtype=float), world_size
    rows = np.stack([np.full_like(s, 2 * (n - 1)), 2 * (n - 1) / n * s], axis=1)
    (alpha, inverse_bandwidth), *_ = np.linalg.lstsq(rows, t)
    return float(alpha), float(1 / inverse_bandwidth)
""",
)

#: The course's answer imported instead of written.
MODEL_IMPORTS_THE_ANSWER = _model(
    """import ddp_lab.answers.lab02.references as c


def ring_time(size_bytes, world_size, alpha, bandwidth):
    return c.ring_allreduce_time(size_bytes, world_size, alpha, bandwidth)"""
)

NO_FACTOR = "the bandwidth term needs the factor 2(n - 1)/n"
E1, E2, E3, E4 = (
    "ex1_ring_all_reduce",
    "ex2_parameter_server",
    "ex3_stale_server",
    "ex4_cost_model",
)
MISTAKES = [
    Mistake(E1, "typical", RING_WRONG_NEIGHBOUR, "sends only to its right neighbour (r + 1) % n"),
    Mistake(E1, "adds in both phases", RING_ADDS_IN_BOTH_PHASES, "is wrong in chunk(s)"),
    Mistake(E1, "skips a step", RING_SKIPS_A_STEP, "skips a step"),
    Mistake(E1, "returns nothing", RING_RETURNS_NOTHING, "other than `tensor` itself"),
    Mistake(E1, "whole tensors", RING_WHOLE_TENSORS, "more than a ring needs"),
    Mistake(E1, "calls all_reduce", RING_CALLS_ALL_REDUCE, "all_reduce is not allowed"),
    Mistake(E1, "imports the answer", RING_IMPORTS_THE_ANSWER, "uses ddp_lab.answers"),
    Mistake(E2, "typical", PS_NEVER_PULLS, "the workers never pulled"),
    Mistake(E2, "sums", PS_SUMS, "is the sum of the workers' gradients"),
    Mistake(E2, "divides by n", PS_DIVIDES_BY_N, "divide by the number of workers, n - 1"),
    Mistake(E3, "typical", STALE_OFF_BY_ONE, "more than the staleness bound"),
    Mistake(E3, "ignores staleness", STALE_IGNORED, "fresher than the rule asks"),
    Mistake(E4, "typical", RING_TIME_NO_FACTOR, NO_FACTOR),
    Mistake(E4, "alpha once", RING_TIME_ALPHA_ONCE, "every one of the 2(n - 1) steps pays alpha"),
    Mistake(E4, "server one way", SERVER_TIME_ONE_WAY, "the parameters go back to every worker"),
    Mistake(E4, "server like a ring", SERVER_TIME_LIKE_A_RING, "that is the ring's cost"),
    Mistake(E4, "fit without the factor", FIT_NO_FACTOR, NO_FACTOR),
    Mistake(E4, "fit absolute errors", FIT_ABSOLUTE, "you minimised absolute errors"),
    Mistake(E4, "imports the answer", MODEL_IMPORTS_THE_ANSWER, "uses ddp_lab.answers"),
]

#: The sample class's ``hang`` student: a ring whose torchrun job deadlocks, and what it costs.
HANGS = {E1: RING_RECV_FIRST}
HANG_LOSES = ["test_ex1_ring_all_reduce"]

#: What a cheater writes by hand: a result file, and files that sit next to a notebook whose
#: own cells still hold the stubs (the grader writes the cells' files itself).
FORGED_FILES = {
    "result.json": '{"curves": {}, "sizes": [], "seconds": {}}',
    "ring.py": (
        "import torch.distributed as dist\n\n\n"
        "def ring_all_reduce(tensor):\n    dist.all_reduce(tensor)\n    return tensor\n"
    ),
    "ps.py": ("def parameter_server(params, optimizer, grad_fn, steps):\n    return params\n"),
    "ps_stale.py": (
        "def stale_parameter_server(params, optimizer, grad_fn, steps, staleness):\n"
        "    return params\n"
    ),
}
