"""Exercise 1: a ring all-reduce from send/recv (``ring.py``), on every rank of torchrun jobs.

Oracle: every rank must end with the element-wise sum of the ranks' inputs (what
``dist.all_reduce`` gives), in place. The case set runs on 2 and 3 ranks with tensors shorter
than the world size, lengths it does not divide, 2-D shapes, float64 and float32. While the
student's code runs the built-in collectives raise (:data:`ddp_lab.checks.guards.COLLECTIVES`),
and a call that deadlocks ends its rank after
:data:`~ddp_lab.checks.lab02.common.CALL_TIMEOUT_S` seconds with the likely cause.
"""

from __future__ import annotations

import torch

from ddp_lab.checks import guards
from ddp_lab.checks.contract import Exercise
from ddp_lab.checks.lab02 import common

WORLD_SIZES = (2, 3)


def make_inputs(gen: torch.Generator) -> dict:
    """The graded case set: 2 and 3 ranks (see :func:`common.make_cases`)."""
    return common.make_cases(gen, WORLD_SIZES)


def visible_inputs(gen: torch.Generator) -> dict:
    """3 ranks, tensors of 1, 2, 3, 7, 10 and 3x5 small integers."""
    return common.visible_cases()


EXERCISE = Exercise(
    "test_ex1_ring_all_reduce",
    ("ex1_ring_all_reduce",),
    "ring all-reduce from send/recv",
    make_inputs,
    common.judge(common.RING),
    run_rank=common.run_rank(common.RING),
    forbid=guards.COLLECTIVES,
    timeout=90,
    visible_inputs=visible_inputs,
    files=(common.RING.file,),
)
