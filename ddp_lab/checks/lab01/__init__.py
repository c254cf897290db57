"""Checks of lab 1 (data parallelism in one process): five exercises, 16 points (plus two
written answers, 4 points, graded by the instructor).

1. ``split_batch`` (2): shards that cover every sample once, in order, sizes within one,
   empty shards when there are more replicas than samples;
2. ``data_parallel_step`` (4): one replica per shard, the gradients combined with the
   weights the student derives, one SGD step; equal to the whole batch's step (float32 and
   float64, a shard of one sample, replicas without data, a model holding stale gradients);
3. ``data_parallel_forward`` (3): ``nn.DataParallel``'s forward by hand (replicate, scatter,
   parallel_apply, gather) with replicas connected to the module in autograd, so that one
   backward gives the module the whole batch's gradient;
4. ``combine_shard_stats`` (4): the whole batch's mean and biased variance from shard
   statistics (the formula is the student's), numerically safe far from 0 in float32 and
   float64, empty shards left out;
5. ``dataparallel_step_time`` (3): a cost model of ``nn.DataParallel`` whose replicate and
   reduce are pipelined chain transfers (NCCL's broadcast and reduce).

One file per exercise holds its contract (case set, run, judge). The functions below are
the notebook's visible checks: each runs its exercise on small fixed inputs in the kernel,
through :func:`ddp_lab.checks.runner.visible`, and prints ``OK: ...`` or raises
:class:`~ddp_lab.checks.failure.CheckFailed`; the grader runs the same contract on its fixed
case set with values drawn at grading time.

Example:
    >>> from ddp_lab.checks import lab01 as checks
    >>> checks.split_batch(lambda x, y, n: list(zip(x.tensor_split(n), y.tensor_split(n))))
    OK: every sample in exactly one shard, sizes within one: ...
"""

from __future__ import annotations

from collections.abc import Callable

from ddp_lab.checks import runner
from ddp_lab.checks.lab01 import (
    ex1_split_batch,
    ex2_data_parallel_step,
    ex3_data_parallel_forward,
    ex4_combine_shard_stats,
    ex5_dataparallel_step_time,
)
from ddp_lab.checks.lab01.common import LAB

__all__ = [
    "EXERCISES",
    "LAB",
    "combine_shard_stats",
    "data_parallel_forward",
    "data_parallel_step",
    "dataparallel_step_time",
    "split_batch",
]

#: The exercises, in the order of the notebook's test cells.
EXERCISES = [
    ex1_split_batch.EXERCISE,
    ex2_data_parallel_step.EXERCISE,
    ex3_data_parallel_forward.EXERCISE,
    ex4_combine_shard_stats.EXERCISE,
    ex5_dataparallel_step_time.EXERCISE,
]


def _visible(grade_id: str, name: str, fn: Callable) -> None:
    runner.visible(LAB, grade_id, functions={name: fn})


def split_batch(fn: Callable) -> None:
    """Visible check of exercise 1: 10, 8 and 6 samples into 4 shards, 7 into 1, 2 into 3."""
    _visible("test_ex1_split_batch", "split_batch", fn)


def data_parallel_step(fn: Callable) -> None:
    """Visible check of exercise 2: shards of 5, 2 and 1 samples (float64), of 3, 1 and 0
    (float32), each model holding stale gradients."""
    _visible("test_ex2_data_parallel_step", "data_parallel_step", fn)


def data_parallel_forward(fn: Callable) -> None:
    """Visible check of exercise 3: 10 samples on 4 replicas, 5 on 1, 2 on 3."""
    _visible("test_ex3_data_parallel_forward", "data_parallel_forward", fn)


def combine_shard_stats(fn: Callable) -> None:
    """Visible check of exercise 4: shards of 6, 3 and 1 samples; float32 shards near 20000;
    shards of 5, 2 and 0 samples."""
    _visible("test_ex4_combine_shard_stats", "combine_shard_stats", fn)


def dataparallel_step_time(fn: Callable) -> None:
    """Visible check of exercise 5: the docstring's example and the cost model's properties
    on 1, 3 and 4 devices (the grader also compares every term)."""
    _visible("test_ex5_dataparallel_step_time", "dataparallel_step_time", fn)
