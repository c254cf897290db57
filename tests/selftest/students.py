"""Right answers to the self-test lab's two exercises, as a student would write them: the
tests that need a working submission (verdicts, runner, limits) start from these."""

GOOD_ADD = "def add(a, b):\n    return a + b"

#: ``rank_sum.py``: the sum over every rank with send/recv through rank 0.
RANK_SUM_FILE = '''import torch
import torch.distributed as dist

def rank_sum(t):
    """Sum t over all ranks, in place, with send/recv through rank 0."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        buf = torch.empty_like(t)
        for src in range(1, world):
            dist.recv(buf, src=src)
            t += buf
        for dst in range(1, world):
            dist.send(t, dst=dst)
    else:
        dist.send(t, dst=0)
        dist.recv(t, src=0)
'''

#: The solution cell that writes it.
GOOD_SUM = "%%writefile rank_sum.py\n" + RANK_SUM_FILE
