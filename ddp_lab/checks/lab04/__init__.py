"""Checks of lab 4 (SyncBatchNorm): the exercises and the notebook's visible checks.

Four exercises (``ex1_local_moments.py`` ... ``ex4_sync_bn_function.py``, shared case
builders in ``common.py``):

1. ``local_moments(x)`` (a function in the notebook): per-channel sum, sum of squares and
   count of one rank's batch; judged against ``torch.var_mean``;
2. ``sync_mean_var(s, ss, n)`` (file ``sync_stats.py``, every rank): the global mean,
   biased variance and count; judged against the concatenated global batch's statistics;
3. ``sync_input_grad(dy, x_hat, invstd, weight, count)`` (file ``sync_grad.py``, every
   rank): BatchNorm's input gradient; judged against autograd through ``F.batch_norm`` on
   the concatenated global batch;
4. ``SyncBNFunction`` (file ``sync_bn.py``, every rank, built on the files of exercises 2
   and 3): the whole autograd Function; judged against ``F.batch_norm`` on the concatenated
   global batch, step by step (outputs, gradients, running statistics).

Each visible check below runs the exercise's contract on small fixed inputs through
:func:`ddp_lab.checks.runner.visible` (the distributed ones on 2 ranks under torchrun): the
same run and judge as the grader's, which adds more ranks and fresh inputs.
"""

from __future__ import annotations

from pathlib import Path

from ddp_lab.checks import runner
from ddp_lab.checks.failure import CheckFailed
from ddp_lab.checks.lab04 import (
    ex1_local_moments,
    ex2_sync_mean_var,
    ex3_sync_input_grad,
    ex4_sync_bn_function,
)
from ddp_lab.checks.lab04.common import FUNCTION_FILE, GRAD_FILE, STATS_FILE

LAB = "lab04_syncbn"

#: The exercises, in the order of the notebook's test cells.
EXERCISES = [
    ex1_local_moments.EXERCISE,
    ex2_sync_mean_var.EXERCISE,
    ex3_sync_input_grad.EXERCISE,
    ex4_sync_bn_function.EXERCISE,
]

#: True while ``nbgrader autograde`` runs the notebook (the grader, not a student). The
#: notebook then skips its torchrun demonstrations, and the visible checks skip their torchrun
#: jobs: they teach, the grader's verdicts decide.
GRADING = runner.grading()


def local_moments(fn) -> None:
    """Visible check of exercise 1: ``fn`` on 2-, 3- and 4-D inputs, one of them empty.

    Example:
        >>> local_moments(local_moments)  # doctest: +SKIP
        OK: local_moments is right for inputs of shapes ...
    """
    runner.visible(LAB, "test_ex1_local_moments", functions={"local_moments": fn})


def sync_mean_var(path: str = STATS_FILE) -> None:
    """Visible check of exercise 2: the file on 2 ranks (torchrun) of different batch sizes."""
    runner.visible(LAB, "test_ex2_sync_mean_var", folder=Path(path).parent)


def sync_input_grad(path: str = GRAD_FILE) -> None:
    """Visible check of exercise 3: the file on 2 ranks (torchrun) of different batch sizes."""
    runner.visible(LAB, "test_ex3_sync_input_grad", folder=Path(path).parent)


def _pieces_unfinished(folder: Path) -> str | None:
    """Why ``sync_bn.py`` cannot run yet on the student's own pieces, or None."""
    for name, number in ((STATS_FILE, 2), (GRAD_FILE, 3)):
        path = folder / name
        if not path.is_file():
            return (
                f"{FUNCTION_FILE} builds on your {name} (exercise {number}), not found in "
                f"{folder}: run the cell that starts with %%writefile {name}"
            )
        if runner.STUB in path.read_text():
            return (
                f"{FUNCTION_FILE} builds on your {name}, which still holds the released stub: "
                f"finish exercise {number} first (the grader runs this exercise with correct "
                f"versions of {STATS_FILE} and {GRAD_FILE}, so their mistakes cost points once)"
            )
    return None


def sync_bn_function(path: str = FUNCTION_FILE) -> None:
    """Visible check of exercise 4: the file on 2 ranks (torchrun) for 2 steps, with your
    ``sync_stats.py`` and ``sync_grad.py`` next to it."""
    folder = Path(path).parent.resolve()
    mine = folder / FUNCTION_FILE
    if not runner.grading() and mine.is_file() and runner.STUB not in mine.read_text():
        if why := _pieces_unfinished(folder):
            raise CheckFailed(why)
    runner.visible(LAB, "test_ex4_sync_bn_function", folder=folder)


__all__ = [
    "EXERCISES",
    "GRADING",
    "LAB",
    "local_moments",
    "sync_bn_function",
    "sync_input_grad",
    "sync_mean_var",
]
