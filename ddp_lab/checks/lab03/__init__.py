"""Checks of lab 3 (DistributedDataParallel): one visible check per test cell.

Each exercise's contract is in its own file (``ex1_shard_indices`` ... ``ex5_scaled_lr``);
the visible checks below run it through :func:`ddp_lab.checks.runner.visible` on small
fixed inputs, the same way the grader runs it on inputs drawn at grading time:

- :func:`shard_indices` and :func:`learning_rates` call the student's functions in the
  kernel;
- :func:`ddp_train`, :func:`evaluate` and :func:`my_ddp` run the student's file on 2 ranks
  of a torchrun job (``ddp_lab.checks.rank_worker``); under ``nbgrader autograde`` they only
  say that the grader runs them outside the kernel.

:data:`GRADING` lets the notebook skip its torchrun demonstrations while the grader runs it,
and :data:`TRAIN_CHECK` is the run of the notebook's DDP-equals-one-process demonstration.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ddp_lab.checks import runner
from ddp_lab.checks.lab03 import (
    ex1_shard_indices,
    ex2_ddp_train,
    ex3_evaluate,
    ex4_my_ddp,
    ex5_scaled_lr,
)

LAB = "lab03_ddp"

#: The exercises, in the order of their test cells.
EXERCISES = [
    ex1_shard_indices.EXERCISE,
    ex2_ddp_train.EXERCISE,
    ex3_evaluate.EXERCISE,
    ex4_my_ddp.EXERCISE,
    ex5_scaled_lr.EXERCISE,
]

#: True while ``nbgrader autograde`` runs the notebook (the grader, not a student). The
#: notebook skips its torchrun demonstrations then: they teach, they are not graded, and each
#: would cost seconds of every student's grading time. (A constant, not a function: a cheat
#: that replaces every function of this module cannot turn the demonstrations back on.)
GRADING = runner.grading()

#: The flags of the notebook's demonstration run of ``ddp_train.py`` (2 processes x 16
#: samples, compared with one process on batches of 32).
TRAIN_CHECK = {"epochs": 2, "batch_size": 16, "lr": 0.05, "train_size": 200, "seed": 3}


def shard_indices(fn: Callable) -> str:
    """Check ``shard_indices(n, rank, world_size, epoch, seed)`` against torch's
    ``DistributedSampler`` on three small cases.

    Raises:
        CheckFailed: naming the case and what is wrong (overlap, padding, no reshuffle ...).
    """
    return runner.visible(LAB, "test_ex1_shard_indices", functions={"shard_indices": fn})


def ddp_train(path: str = "ddp_train.py") -> str:
    """Run ``setup`` / ``train`` / ``teardown`` of ``path`` on 2 ranks; compare the samples
    each rank read with ``DistributedSampler`` and the weights with one process trained on
    the global batch.

    Raises:
        CheckFailed: the failing rank's error, or what differs and the likely cause.
    """
    return runner.visible(LAB, "test_ex2_ddp_train", folder=Path(path).parent)


def evaluate(path: str = "evaluate.py") -> str:
    """Run ``evaluate`` from ``path`` on 2 ranks and a length not divisible by 2; compare
    with the correct predictions counted on the whole set.

    Raises:
        CheckFailed: duplicates or missing samples, ranks that disagree, a wrong accuracy.
    """
    return runner.visible(LAB, "test_ex3_evaluate", folder=Path(path).parent)


def my_ddp(path: str = "my_ddp.py") -> str:
    """Run ``MyDDP`` from ``path`` on 2 ranks that start from different weights; compare
    with rank 0's weights, the big batch's gradient and plain SGD on the big batches (what
    ``DistributedDataParallel`` gives).

    Raises:
        CheckFailed: no broadcast, gradients not averaged, weights that differ.
    """
    return runner.visible(LAB, "test_ex4_my_ddp", folder=Path(path).parent)


def learning_rates(scaled_lr: Callable, warmup_lr: Callable) -> str:
    """Check the properties of ``scaled_lr`` (linear in the global batch) and ``warmup_lr``
    (a straight ramp from ``base_lr`` to ``peak_lr``) on a few hand-picked cases.

    Raises:
        CheckFailed: with the call, the value it returned, and what was expected.
    """
    return runner.visible(
        LAB,
        "test_ex5_scaled_lr",
        functions={"scaled_lr": scaled_lr, "warmup_lr": warmup_lr},
    )
