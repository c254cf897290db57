"""What lab 7's exercises share: the lab's name, its files, groups of ranks, and counting
the collectives a piece of code calls.

None of this is an answer to an exercise: the groups are what the checker hands the
student's code, and :func:`counted_collectives` only watches it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from ddp_lab.checks.failure import CheckFailed
from ddp_lab.checks.guards import watched_collectives

LAB = "lab07_beyond_ddp"

#: Files the notebook's distributed solution cells write (``%%writefile``).
ZERO_FILE, PIPELINE_FILE, TP_FILE = "zero.py", "pipeline.py", "tp.py"
#: What the exercises ask students to write themselves (the solution cells may not use it).
BUILT_INS = (
    "torch.distributed.optim",
    "torch.distributed.fsdp",
    "torch.distributed.pipelining",
    "torch.distributed.tensor",
    "torch.distributed._composable",
)
#: Seconds one call of the student's code may take before the rank ends with a diagnosis.
WATCHDOG_S = 30.0
DTYPES = {"float32": torch.float32, "float64": torch.float64}


def groups_for(sizes, world: int) -> dict[int, object]:
    """``{n: process group of ranks 0 .. n-1}`` for every ``n`` in ``sizes`` below ``world``.

    Every rank must call this (creating a group is a collective of the whole job).
    """
    wanted = sorted({n for n in sizes if n < world})
    return {n: dist.new_group(list(range(n))) for n in wanted}


def release(token_sizes, rank: int, world: int) -> None:
    """The ranks outside a group of ``n`` wait for rank 0's word that the group is done
    (a point-to-point message, which no collective of the student's can answer)."""
    token = torch.zeros(1)
    for n in sorted({n for n in token_sizes if n < world}):
        if rank == 0:
            for r in range(n, world):
                dist.send(token, dst=r)
        elif rank >= n:
            dist.recv(token, src=0)


@contextmanager
def counted_collectives(counts: Counter, sizes: list | None = None) -> Iterator[None]:
    """While the block runs, every ``torch.distributed`` collective the code calls adds 1 to
    ``counts[name]`` and then runs as usual (in ``torch.distributed`` and
    ``distributed_c10d``, so that a name imported from either is counted; a collective
    that calls another one inside counts once). With ``sizes``, each call also appends
    ``[name, numbers]``: the numbers of its largest tensor argument (a list of tensors
    counting as their sum)."""

    def note(name, args, kwargs):
        counts[name] += 1
        if sizes is not None:
            sizes.append([name, numbers(*args, *kwargs.values())])

    with watched_collectives(note):
        yield


def numbers(*args) -> int:
    """The numbers of the largest tensor among ``args`` (a list of tensors: their sum)."""

    def size(a) -> int:
        if isinstance(a, torch.Tensor):
            return a.numel()
        if isinstance(a, list | tuple):
            return sum(t.numel() for t in a if isinstance(t, torch.Tensor))
        return 0

    return max((size(a) for a in args), default=0)


def randn(gen: torch.Generator, *shape: int, dtype=torch.float64, scale: float = 1.0):
    """Normal values of ``shape``, drawn in float64 and cast (the same values for both
    dtypes of a draw)."""
    return (scale * torch.randn(*shape, generator=gen, dtype=torch.float64)).to(dtype)


def check_cases(inputs: dict, outputs: dict, oracle: Callable, problem: Callable) -> None:
    """The judge of an exercise run once per case in one process: one result per case in
    ``outputs["results"]``, each against ``oracle(case)``; raises ``CheckFailed`` with
    ``problem(case, got, want)`` of the first wrong one."""
    results = outputs.get("results")
    if not isinstance(results, list) or len(results) != len(inputs["cases"]):
        raise CheckFailed("expected one result per case")
    for case, got in zip(inputs["cases"], results, strict=True):
        if why := problem(case, got, oracle(case)):
            raise CheckFailed(why)
