"""Checks of lab 3 (DistributedDataParallel): six exercises, one visible check per test cell.

1. ``MySampler`` (kernel): DistributedSampler by hand, judged against torch's own;
2. ``ddp_train.py`` (torchrun): setup / train / teardown, judged against one process on the
   global batch and DistributedSampler, ``setup()`` also on a faked multi-node GPU job;
3. ``evaluate.py`` (torchrun): exact distributed evaluation, judged against the count on
   the whole set;
4. ``my_ddp.py`` (torchrun): MyDDP with asynchronous all-reduces in hooks, judged against
   DDP's weights, the all-reduces counted, and the overlap timed on a slowed link;
5. ``bucketed_ddp.py`` (torchrun): the same with DDP's buckets, judged against torch's own
   bucketing routine as well;
6. ``warmup_steps_for`` (kernel): the shortest warm-up of the trainer's linear ramp that
   keeps every step's rise of the scaled rate within ``base_lr`` and sees a given number of
   samples, judged against the trainer's own schedule.

Each exercise's contract is in its own file; the functions below run it through
:func:`ddp_lab.checks.runner.visible` on small fixed inputs, the same way the grader runs it
on inputs drawn at grading time (the torchrun ones over 2 and 3 ranks in one job). Under
``nbgrader autograde`` the torchrun checks only say that the grader runs them.

:data:`GRADING` lets the notebook skip its demonstrations while the grader runs it, and
:data:`TRAIN_CHECK` is the run of the notebook's DDP-equals-one-process demonstration.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ddp_lab.checks import runner
from ddp_lab.checks.lab03 import (
    ex1_shard_sampler,
    ex2_ddp_train,
    ex3_evaluate,
    ex4_my_ddp,
    ex5_bucketed_ddp,
    ex6_warmup_steps,
)

LAB = "lab03_ddp"

#: The exercises, in the order of their test cells.
EXERCISES = [
    ex1_shard_sampler.EXERCISE,
    ex2_ddp_train.EXERCISE,
    ex3_evaluate.EXERCISE,
    ex4_my_ddp.EXERCISE,
    ex5_bucketed_ddp.EXERCISE,
    ex6_warmup_steps.EXERCISE,
]

#: True while ``nbgrader autograde`` runs the notebook (the grader, not a student). The
#: notebook skips its demonstrations then: they teach, they are not graded, and each would
#: cost seconds of every student's grading time. (A constant, not a function: a cheat that
#: replaces every function of this module cannot turn the demonstrations back on.)
GRADING = runner.grading()

#: The flags of the notebook's demonstration run of ``ddp_train.py`` (2 processes x 16
#: samples, compared with one process on batches of 32).
TRAIN_CHECK = {"epochs": 2, "batch_size": 16, "lr": 0.05, "train_size": 200, "seed": 3}


def shard_sampler(cls: type) -> None:
    """Check ``MySampler`` against torch's ``DistributedSampler`` on four small cases, three
    epochs each.

    Raises:
        CheckFailed: naming the case and what is wrong (overlap, padding, no reshuffle ...).
    """
    runner.visible(LAB, "test_ex1_shard_sampler", functions={"MySampler": cls})


def ddp_train(path: str = "ddp_train.py") -> None:
    """Run ``setup`` / ``train`` / ``teardown`` of ``path`` on 2 ranks for 3 epochs, then
    ``setup()`` on a faked GPU node; compare the samples each rank read with
    ``DistributedSampler`` and the weights with one process trained on the global batch.

    Raises:
        CheckFailed: the failing rank's error, or what differs and the likely cause.
    """
    runner.visible(LAB, "test_ex2_ddp_train", folder=Path(path).parent)


def evaluate(path: str = "evaluate.py") -> None:
    """Run ``evaluate`` from ``path`` on 2 ranks, on an odd number of samples and on one
    sample; compare with the correct predictions counted on the whole set.

    Raises:
        CheckFailed: duplicates or missing samples, ranks that disagree, a wrong accuracy.
    """
    runner.visible(LAB, "test_ex3_evaluate", folder=Path(path).parent)


def my_ddp(path: str = "my_ddp.py") -> None:
    """Run ``MyDDP`` from ``path`` on 2 ranks that start from different weights; compare
    with what ``DistributedDataParallel`` gives, count the all-reduces, and time a step on
    a slowed link with and without overlap.

    Raises:
        CheckFailed: no broadcast, gradients not averaged, no overlap.
    """
    runner.visible(LAB, "test_ex4_my_ddp", folder=Path(path).parent)


def bucketed_ddp(path: str = "bucketed_ddp.py") -> None:
    """Run ``BucketedDDP`` from ``path`` on 2 ranks; compare with DDP's weights and buckets,
    and time a step on a slowed link with and without overlap.

    Raises:
        CheckFailed: other buckets than DDP's rule gives, gradients not averaged, no overlap.
    """
    runner.visible(LAB, "test_ex5_bucketed_ddp", folder=Path(path).parent)


def warmup_steps_for(fn: Callable) -> None:
    """Check ``warmup_steps_for`` on five hand-picked calls: the shortest warm-up that keeps
    every step's rise within ``base_lr`` and sees ``warmup_samples`` samples.

    Raises:
        CheckFailed: with the call, the value it returned, and which condition it breaks.
    """
    runner.visible(LAB, "test_ex6_warmup_steps", functions={"warmup_steps_for": fn})
