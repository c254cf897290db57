"""Exercise 2: a parameter-server average from send/recv (``ps.py``), on every rank.

Oracle: every rank must end with the sum of the ranks' inputs divided by the world size (what
``dist.all_reduce(t); t /= world_size`` gives), in place. The case set runs on 3 ranks (a
server and two workers) with the same tensors as the ring; the built-in collectives raise
while the student's code runs, and a deadlocked call ends its rank with the likely cause.
"""

from __future__ import annotations

import torch

from ddp_lab.checks import guards
from ddp_lab.checks.contract import Exercise
from ddp_lab.checks.lab02 import common

WORLD_SIZES = (3,)


def make_inputs(gen: torch.Generator) -> dict:
    """The graded case set: 3 ranks (see :func:`common.make_cases`)."""
    return common.make_cases(gen, WORLD_SIZES)


def visible_inputs(gen: torch.Generator) -> dict:
    """3 ranks, tensors of 1, 2, 3, 7, 10 and 3x5 small integers."""
    return common.visible_cases()


EXERCISE = Exercise(
    "test_ex2_parameter_server",
    ("ex2_parameter_server",),
    "parameter-server average",
    make_inputs,
    common.judge(common.SERVER),
    run_rank=common.run_rank(common.SERVER),
    forbid=guards.COLLECTIVES,
    timeout=60,
    visible_inputs=visible_inputs,
    files=(common.SERVER.file,),
)
