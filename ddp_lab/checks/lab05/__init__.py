"""Checks of lab 5 (mixed precision, gradient accumulation, clipping): five exercises, 16 points
(and two written answers, 4 points, graded by hand).

1. ``fp16_report(grads)`` (3): float16 underflow at scale 1, the largest safe power-of-two
   loss scale, the underflow left at that scale, bfloat16's underflow; judged against
   thresholds derived from ``torch.finfo``;
2. ``LossScaler`` (4): a dynamic loss scaler; judged against ``torch.amp.GradScaler`` run on
   the same inputs (scaled losses, scale trajectory, weights bit for bit);
3. ``train_accumulated`` (3, file ``accum.py``, every rank): accumulation over ``k``
   micro-batches with ``no_sync``; judged against one process on the big batch and by the
   all-reduces per optimizer step that the checker's communication hook counts;
4. ``train_steps`` (3, file ``ddp_step.py``, every rank): labs 3 to 5 in one DDP step,
   accumulation with ``no_sync``, float16 autocast with a ``GradScaler``, ``unscale_`` before
   clipping, an overflow skipped on every rank; judged against one float32 process on the
   global batch (clipped on the true gradients), step by step, by the all-reduces per
   optimizer step that the checker's communication hook counts, and by the scale after each
   step (a second ``GradScaler`` driven through the same steps);
5. ``global_grad_norm`` (3, file ``grad_norm.py``, every rank): the norm of gradients
   sharded over ranks; judged against the norm of the concatenated gradients.

One file per exercise holds its contract (case set, run, judge). The functions below are the
notebook's visible checks: each runs its exercise on small fixed inputs through
:func:`ddp_lab.checks.runner.visible` (the distributed ones under torchrun) and
prints ``OK: ...`` or raises :class:`~ddp_lab.checks.failure.CheckFailed`; the grader runs
the same contract on inputs drawn at grading time, over groups of 2 and 3 ranks.

Example:
    >>> from ddp_lab.checks import lab05 as checks
    >>> checks.fp16_report(fp16_report)  # doctest: +SKIP
    OK: fp16_report is right on 2 sets of gradients ...
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ddp_lab.checks import runner
from ddp_lab.checks.lab05 import (
    ex1_fp16_report,
    ex2_loss_scaler,
    ex3_accumulation,
    ex4_ddp_step,
    ex5_global_grad_norm,
)
from ddp_lab.checks.lab05.common import ACCUM_FILE, DDP_STEP_FILE, LAB, NORM_FILE

__all__ = [
    "EXERCISES",
    "GRADING",
    "LAB",
    "accumulation",
    "ddp_step",
    "fp16_report",
    "global_grad_norm",
    "loss_scaler",
]

#: The exercises, in the order of the notebook's test cells.
EXERCISES = [
    ex1_fp16_report.EXERCISE,
    ex2_loss_scaler.EXERCISE,
    ex3_accumulation.EXERCISE,
    ex4_ddp_step.EXERCISE,
    ex5_global_grad_norm.EXERCISE,
]

#: True while ``nbgrader autograde`` runs the notebook: the notebook then skips its
#: demonstrations (the grader judges the exercises outside the kernel).
GRADING = runner.grading()


def _visible(grade_id: str, name: str, fn: Callable) -> None:
    runner.visible(LAB, grade_id, functions={name: fn})


def fp16_report(fn: Callable) -> None:
    """Visible check of exercise 1: a small backward pass, values at the thresholds, tiny
    gradients (a scale above ``2**127``)."""
    _visible("test_ex1_fp16_report", "fp16_report", fn)


def loss_scaler(cls: type) -> None:
    """Visible check of exercise 2: two runs with forced overflows (growth intervals 1 and 2)
    against ``torch.amp.GradScaler``."""
    _visible("test_ex2_loss_scaler", "LossScaler", cls)


def accumulation(path: str = ACCUM_FILE) -> None:
    """Visible check of exercise 3: the file on 2 ranks (torchrun), k = 1, an uneven tail,
    k larger than the number of micro-batches, and one micro-batch per rank."""
    runner.visible(LAB, "test_ex3_accumulation", folder=Path(path).parent)


def ddp_step(path: str = DDP_STEP_FILE) -> None:
    """Visible check of exercise 4: the file on 2 ranks (torchrun), accumulate 1 with
    clipping active and accumulate 3 or 4, each run with one step that overflows."""
    runner.visible(LAB, "test_ex4_ddp_step", folder=Path(path).parent)


def global_grad_norm(path: str = NORM_FILE) -> None:
    """Visible check of exercise 5: the file on 3 ranks (torchrun): a norm over all of them,
    two over the group of ranks 0 and 1."""
    runner.visible(LAB, "test_ex5_global_grad_norm", folder=Path(path).parent)
