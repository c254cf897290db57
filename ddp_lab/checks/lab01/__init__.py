"""Checks of lab 1 (data parallelism in one process): five exercises, 15 points.

1. ``split_batch`` (3): shards that cover every sample once, in order, sizes within one;
2. ``average_gradients`` (2): the mean over replicas, parameter by parameter;
3. ``data_parallel_gradients`` (4): replicas on unequal shards equal the full-batch
   gradient, the model left untouched;
4. ``combine_shard_stats`` (3): BatchNorm's batch mean and (biased) variance from per-shard
   statistics and counts;
5. ``dataparallel_step_time`` (3): the ``nn.DataParallel`` cost model of the notebook.

One file per exercise holds its contract (case set, run, judge). The functions below are
the notebook's visible checks: each runs its exercise on small fixed inputs in the kernel,
through :func:`ddp_lab.checks.runner.visible`, and prints ``OK: ...`` or raises
:class:`~ddp_lab.checks.failure.CheckFailed`; the grader runs the same contract on inputs
drawn at grading time.

Example:
    >>> from ddp_lab.checks import lab01 as checks
    >>> checks.average_gradients(lambda g: [sum(p) / len(p) for p in zip(*g)])
    OK: averaged 4 replicas' gradients of 2 parameters
"""

from __future__ import annotations

from collections.abc import Callable

from ddp_lab.checks import runner
from ddp_lab.checks.lab01 import (
    ex1_split_batch,
    ex2_average_gradients,
    ex3_data_parallel_gradients,
    ex4_combine_shard_stats,
    ex5_dataparallel_step_time,
)
from ddp_lab.checks.lab01.common import LAB

__all__ = [
    "EXERCISES",
    "LAB",
    "average_gradients",
    "combine_shard_stats",
    "data_parallel_gradients",
    "dataparallel_step_time",
    "split_batch",
]

#: The exercises, in the order of the notebook's test cells.
EXERCISES = [
    ex1_split_batch.EXERCISE,
    ex2_average_gradients.EXERCISE,
    ex3_data_parallel_gradients.EXERCISE,
    ex4_combine_shard_stats.EXERCISE,
    ex5_dataparallel_step_time.EXERCISE,
]


def _visible(grade_id: str, name: str, fn: Callable) -> None:
    runner.visible(LAB, grade_id, functions={name: fn})


def split_batch(fn: Callable) -> None:
    """Visible check of exercise 1: 10, 8 and 6 samples into 4 shards, 7 into 1."""
    _visible("test_ex1_split_batch", "split_batch", fn)


def average_gradients(fn: Callable) -> None:
    """Visible check of exercise 2: 4 replicas, 2 parameters."""
    _visible("test_ex2_average_gradients", "average_gradients", fn)


def data_parallel_gradients(fn: Callable) -> None:
    """Visible check of exercise 3: an MLP 4-5-3, shards of 5, 2 and 1 samples."""
    _visible("test_ex3_data_parallel_gradients", "data_parallel_gradients", fn)


def combine_shard_stats(fn: Callable) -> None:
    """Visible check of exercise 4: shards of 6, 3 and 1 samples, 2 features."""
    _visible("test_ex4_combine_shard_stats", "combine_shard_stats", fn)


def dataparallel_step_time(fn: Callable) -> None:
    """Visible check of exercise 5: the docstring's example and the cost model's properties
    on 1 and 4 devices (the grader also compares every term)."""
    _visible("test_ex5_dataparallel_step_time", "dataparallel_step_time", fn)
