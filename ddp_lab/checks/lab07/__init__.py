"""Checks of lab 7 (beyond data parallelism): five exercises, 19 points (and three written
answers, 6 points, graded by hand).

1. ``memory_per_rank(numels, bytes_per_number, world_size, stage)`` (2): bytes of
   parameters, gradients and AdamW moments on every rank under DDP and ZeRO stages 1-3;
   judged against real tensors measured (a real AdamW, real chunks of the flat vector);
2. ``ShardedAdamW`` (5, file ``zero.py``, every rank): AdamW with its state sharded over the
   ranks, clipping by the global norm, parameters without a gradient skipped; judged
   against ``torch.optim.AdamW`` itself after every step, by the bytes the object holds
   per rank, and by the collectives each step calls (reduce-scatter, all-gather);
3. ``gpipe_step`` (4, file ``pipeline.py``, every rank): a GPipe step over stages on
   ranks, with micro-batches and send/recv; judged against the unsplit model's autograd,
   and by each stage's schedule (all forwards before any backward);
4. ``ColumnParallelLinear`` / ``RowParallelLinear`` (5, file ``tp.py``, every rank):
   ``nn.Linear`` split by output or input features, and the MLP block built from them;
   judged against ``nn.Linear`` forward and backward, and by the collectives counted;
5. ``activation_bytes(batch, seq, width, heads, bytes_per_number)`` (3): the bytes autograd
   keeps for the backward of one block of the course's GPT, a formula of the sizes (run
   with PyTorch refused); judged against the block itself measured (on the meta device for
   GPT-2-sized blocks).

PyTorch's own tools for the same ideas (``fully_shard``, DTensor, device meshes) are lab 9's.

One file per exercise holds its contract (case set, run, judge). The functions below are the
notebook's visible checks: each runs its exercise on small fixed inputs through
:func:`ddp_lab.checks.runner.visible` (the distributed ones in one torchrun job of 3 ranks,
with a group of 2 inside) and prints ``OK: ...`` or raises
:class:`~ddp_lab.checks.failure.CheckFailed`; the grader runs the same contract on inputs
drawn at grading time.

Example:
    >>> from ddp_lab.checks import lab07 as checks
    >>> checks.memory(memory_per_rank)  # doctest: +SKIP
    OK: memory_per_rank matches real tensors measured on every rank ...
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ddp_lab.checks import runner
from ddp_lab.checks.lab07 import (
    ex1_memory,
    ex2_zero,
    ex3_pipeline,
    ex4_tensor_parallel,
    ex5_activations,
)
from ddp_lab.checks.lab07.common import LAB, PIPELINE_FILE, TP_FILE, ZERO_FILE

__all__ = [
    "EXERCISES",
    "GRADING",
    "LAB",
    "activations",
    "memory",
    "pipeline",
    "tensor_parallel",
    "zero",
]

#: The exercises, in the order of the notebook's test cells.
EXERCISES = [
    ex1_memory.EXERCISE,
    ex2_zero.EXERCISE,
    ex3_pipeline.EXERCISE,
    ex4_tensor_parallel.EXERCISE,
    ex5_activations.EXERCISE,
]

#: True while ``nbgrader autograde`` runs the notebook: the notebook then skips its
#: demonstrations (the grader judges the exercises outside the kernel).
GRADING = runner.grading()


def memory(fn: Callable) -> None:
    """Visible check of exercise 1: an uneven MLP over 2 and 3 ranks and a tiny parameter
    over 3, at every stage, against measured tensors."""
    runner.visible(LAB, "test_ex1_memory", functions={"memory_per_rank": fn})


def zero(path: str = ZERO_FILE) -> None:
    """Visible check of exercise 2: the file on 3 ranks (torchrun), 10 steps over all 3
    (uneven chunks, a frozen parameter, one without a gradient at two steps) and 10 over a
    group of 2 (clipped), against ``torch.optim.AdamW``."""
    runner.visible(LAB, "test_ex2_zero", folder=Path(path).parent)


def pipeline(path: str = PIPELINE_FILE) -> None:
    """Visible check of exercise 3: the file on 3 ranks (torchrun), a 3-stage pipeline with
    4 micro-batches and a 2-stage one with 2, against the unsplit model."""
    runner.visible(LAB, "test_ex3_pipeline", folder=Path(path).parent)


def tensor_parallel(path: str = TP_FILE) -> None:
    """Visible check of exercise 4: the file on 3 ranks (torchrun), a column and a row layer
    over all 3, the MLP block over 2, against ``nn.Linear``."""
    runner.visible(LAB, "test_ex4_tensor_parallel", folder=Path(path).parent)


def activations(fn: Callable) -> None:
    """Visible check of exercise 5: three small blocks (one of a single token and head) and
    a GPT-2-small one, against the bytes measured on the blocks themselves."""
    runner.visible(LAB, "test_ex5_activations", functions={"activation_bytes": fn})
