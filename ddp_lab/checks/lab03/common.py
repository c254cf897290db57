"""What lab 3's exercises share: a tiny float64 model, a data set that records its reads,
and the single-process SGD loop that DDP must reproduce.

None of this is an answer to an exercise: :func:`sgd_on_batches` is the loop of the
notebook's ``single.py`` (the given starting point), run on batches chosen by the caller.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from unittest import mock

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from ddp_lab.checks.failure import all_close

#: float64 exercises: DDP's averaged gradients equal the big batch's to rounding.
ATOL, RTOL = 1e-9, 1e-7


class TinyNet(nn.Module):
    """Linear - tanh - (times a buffer) - linear: parameters *and* a buffer, in float64."""

    def __init__(self, d: int, h: int, c: int):
        super().__init__()
        self.hidden = nn.Linear(d, h)
        self.out = nn.Linear(h, c)
        self.register_buffer("scale", torch.ones(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(x)) * self.scale)


def tiny_net(dims: Sequence[int], state: dict | None = None) -> TinyNet:
    """A float64 :class:`TinyNet` of ``dims = (d, h, c)``, loaded with ``state`` if given.

    Example:
        >>> tiny_net([3, 4, 2]).out.weight.dtype
        torch.float64
    """
    model = TinyNet(*(int(v) for v in dims)).double()
    if state is not None:
        model.load_state_dict(state)
    return model


def random_state(dims: Sequence[int], gen: torch.Generator) -> dict:
    """Random weights (and a random buffer) for a :class:`TinyNet` of ``dims``."""
    d, h, c = (int(v) for v in dims)
    return {
        "hidden.weight": torch.randn(h, d, generator=gen, dtype=torch.float64) / math.sqrt(d),
        "hidden.bias": 0.1 * torch.randn(h, generator=gen, dtype=torch.float64),
        "out.weight": torch.randn(c, h, generator=gen, dtype=torch.float64) / math.sqrt(h),
        "out.bias": 0.1 * torch.randn(c, generator=gen, dtype=torch.float64),
        "scale": 0.5 + torch.rand(h, generator=gen, dtype=torch.float64),
    }


def random_dims(gen: torch.Generator) -> list[int]:
    """``[d, h, c]``: 3-6 inputs, 4-8 hidden units, 2-4 classes."""
    return [int(torch.randint(lo, hi, (1,), generator=gen)) for lo, hi in ((3, 7), (4, 9), (2, 5))]


class RecordingDataset(Dataset):
    """``(x[i], y[i])`` pairs that remember which indices were read, in order.

    Example:
        >>> ds = RecordingDataset(torch.zeros(3, 2), torch.zeros(3, dtype=torch.long))
        >>> _ = ds[2]; ds.reads
        [2]
    """

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x, self.y, self.reads = x, y, []

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int):
        self.reads.append(int(index))
        return self.x[index], self.y[index]


def state(model: nn.Module) -> dict:
    """A detached copy of ``model.state_dict()``."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same_state(got, expected: dict, atol: float = ATOL, rtol: float = RTOL) -> bool:
    """True when ``got`` is a state dict with ``expected``'s keys and values close to it."""
    return all_close(got, expected, atol, rtol)


def sgd_on_batches(
    model: nn.Module, dataset: Dataset, batches: Sequence[Sequence[int]], lr: float
) -> nn.Module:
    """``single.py``'s loop: plain SGD on the mean cross-entropy, one step per list of
    sample indices (in place)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for idx in batches:
        x, y = next(iter(DataLoader(dataset, batch_size=len(idx), sampler=list(idx))))
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


def single_process_batches(n: int, batch_size: int, epochs: int, seed: int) -> list[list[int]]:
    """The batches ``single.py`` reads: per epoch, the order of a one-rank
    ``DistributedSampler(shuffle=True, seed=seed)`` after ``set_epoch(epoch)``, in chunks of
    ``batch_size``, the incomplete last chunk dropped."""
    sampler = DistributedSampler(range(n), num_replicas=1, rank=0, shuffle=True, seed=seed)
    steps = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        order = list(sampler)
        steps += [order[k : k + batch_size] for k in range(0, n - batch_size + 1, batch_size)]
    return steps


@contextmanager
def as_world(group) -> Iterator[None]:
    """While the block runs, ``group`` is the default process group (``None``: no change).

    A torchrun job of 3 ranks checks code on 2 ranks too: the checker makes a group of ranks
    0 and 1 and, on those ranks, lets the student's code see it as *the* world (``dist.
    get_world_size()``, collectives with ``group=None``, ``DistributedDataParallel``,
    ``DistributedSampler``, ``dist.group.WORLD``). The student's code does not know the
    job has a third rank, and no call of theirs can reach it: the rank outside waits on the
    real world group, which no student collective can answer.
    """
    if group is None:
        yield
        return
    world = c10d._world.default_pg
    c10d._world.default_pg = group
    try:
        yield
    finally:
        c10d._world.default_pg = world


def subgroups(sizes, world: int) -> dict[int, object]:
    """``n -> process group of ranks 0 .. n-1`` for every ``n < world`` in ``sizes`` (every
    rank of the job must call this, in the same order)."""
    return {n: dist.new_group(list(range(n))) for n in sorted(set(sizes)) if n < world}


def wait_for_everyone() -> None:
    """A barrier of the whole job (the real world group), taken by the checker between two
    runs: the ranks that sat out a smaller run wait here for the others."""
    dist.barrier(group=c10d._world.default_pg)


def per_run(case: dict, rank: int, world: int, one_run) -> list:
    """``one_run(run, rank, ranks)`` for every run of ``case["runs"]`` this rank takes part
    in (``None`` for the others), each over its own number of ranks ``run["ranks"]``: runs
    over fewer ranks than the job's see a group of ranks ``0 .. n-1`` as their world
    (:func:`as_world`, and ``WORLD_SIZE`` says ``n``); the whole job meets after each run."""
    groups = subgroups([run["ranks"] for run in case["runs"]], world)
    out = []
    for run in case["runs"]:
        n = run["ranks"]
        if rank < n:
            sizes = {"WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(n)} if n < world else {}
            with as_world(groups.get(n)), mock.patch.dict(os.environ, sizes):
                out.append(one_run(run, rank, n))
        else:
            out.append(None)
        wait_for_everyone()
    return out


def run_outputs(case: dict, ranks: list) -> list[tuple[dict, list]]:
    """``(run, [rank 0's outputs, rank 1's, ...])`` for every run of a case, from the job's
    ``[rank][run]`` outputs (the judge's view)."""
    return [(run, [ranks[r][i] for r in range(run["ranks"])]) for i, run in enumerate(case["runs"])]
