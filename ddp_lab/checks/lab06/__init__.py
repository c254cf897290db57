"""Checks of lab 6 (checkpoints, elastic restarts and faults): five exercises, 16 points,
and two written answers (4 points).

1. ``save_checkpoint`` / ``load_checkpoint`` (4): atomic, checksummed; judged by failures
   the checker injects while a save runs (an exception mid-write, a full disk), the SHA-256
   of the previous checkpoint, the ``fsync`` and ``rename`` calls it records, and damaged
   files (truncated, a byte flipped) that must raise ``ValueError``;
2. ``train`` in ``resume.py`` (5, every rank): checkpoints and a resume mid-epoch; the
   checker interrupts the run at steps of its choice and the resumed run must end with the
   uninterrupted run's weights bit for bit on every rank (the judge computes that run);
3. ``rollback_plan`` (2): the rollback rule over a run's evaluations; judged by the rule's
   properties on histories built with every edge case;
4. ``diagnose_hang`` (2): which rank, which collective and which cause, from the per-rank
   logs of real jobs the checker runs (``TORCH_DISTRIBUTED_DEBUG=DETAIL``, 2 and 3 ranks),
   each with a divergence drawn at grading time from five real causes; judged against the
   truth of each job's construction, which the student's process never sees;
5. ``fixed_train.py`` (3, every rank): the hanging script fixed; judged against one process
   on uneven data, 2 and 3 ranks, under a watchdog, with what every rank prints and returns
   (only rank 0 logs).

The lab's two written answers (4 points: where ``torch.load`` without ``map_location`` puts
the tensors, the checkpoint interval) are graded by hand.

One file per exercise holds its contract (case set, run, judge). The functions below are the
notebook's visible checks: each runs its exercise on small fixed inputs through
:func:`ddp_lab.checks.runner.visible` (the distributed ones under torchrun) and prints
``OK: ...`` or raises :class:`~ddp_lab.checks.failure.CheckFailed`; the grader runs the same
contract on inputs drawn at grading time, over groups of 2 and 3 ranks.

Example:
    >>> from ddp_lab.checks import lab06 as checks
    >>> checks.rollback_plan(rollback_plan)  # doctest: +SKIP
    OK: rollback_plan decided 12 evaluations of 3 histories right ...
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ddp_lab.checks import runner
from ddp_lab.checks.lab06 import (
    ex1_atomic_save,
    ex2_resume,
    ex3_rollback,
    ex4_diagnose_hang,
    ex5_fix_hang,
)
from ddp_lab.checks.lab06.common import FIXED_FILE, LAB, RESUME_FILE

__all__ = [
    "EXERCISES",
    "GRADING",
    "LAB",
    "atomic_save",
    "diagnose_hang",
    "fixed_script",
    "resume",
    "rollback_plan",
]

#: The exercises, in the order of the notebook's test cells.
EXERCISES = [
    ex1_atomic_save.EXERCISE,
    ex2_resume.EXERCISE,
    ex3_rollback.EXERCISE,
    ex4_diagnose_hang.EXERCISE,
    ex5_fix_hang.EXERCISE,
]

#: True while ``nbgrader autograde`` runs the notebook: the notebook then skips its
#: demonstrations (the grader judges the exercises outside the kernel).
GRADING = runner.grading()


def atomic_save(save_checkpoint: Callable, load_checkpoint: Callable) -> None:
    """Visible check of exercise 1: a training checkpoint saved, crashed, filled up,
    damaged."""
    runner.visible(
        LAB,
        "test_ex1_atomic_save",
        functions={"save_checkpoint": save_checkpoint, "load_checkpoint": load_checkpoint},
    )


def resume(path: str = RESUME_FILE) -> None:
    """Visible check of exercise 2: the file on 2 ranks (torchrun), interrupted after a
    mid-epoch checkpoint, right after one, and before the first."""
    runner.visible(LAB, "test_ex2_resume", folder=Path(path).parent)


def rollback_plan(fn: Callable) -> None:
    """Visible check of exercise 3: the scripted history at drop 5, one evaluation, none."""
    runner.visible(LAB, "test_ex3_rollback", functions={"rollback_plan": fn})


def diagnose_hang(fn: Callable) -> None:
    """Visible check of exercise 4: ten jobs run now (every cause on 2 and 3 ranks, about
    6 s); under the grader the check is left to it (it runs jobs of its own)."""
    if GRADING:
        print("a hang diagnosed from its logs: judged by the grader on jobs it runs itself")
        return
    runner.visible(LAB, "test_ex4_diagnose_hang", functions={"diagnose_hang": fn})


def fixed_script(path: str = FIXED_FILE) -> None:
    """Visible check of exercise 5: the file on 2 ranks (torchrun), four uneven runs."""
    runner.visible(LAB, "test_ex5_fix_hang", folder=Path(path).parent)
