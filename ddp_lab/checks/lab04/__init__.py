"""Checks of lab 4 (SyncBatchNorm): three exercises, and the notebook's visible checks.

1. ``sync_mean_var(x)`` (file ``sync_stats.py``, every rank): the global batch's per-channel
   mean, biased variance and count from this rank's slice, numerically safe, with traffic
   that does not grow with the world size; judged against ``torch.var_mean`` of the
   concatenated global batch, then by its collectives, recorded by the checker
   (:mod:`~ddp_lab.checks.lab04.traffic`: all-reduces only, at most 3 of at most ``3C + 3``
   values, the same sizes on 2 ranks as on 3; an all-gather fails);
2. ``sync_input_grad(dy, x_hat, invstd, weight, count)`` (file ``sync_grad.py``, every
   rank): BatchNorm's input gradient, derived by the student; judged against autograd
   through ``F.batch_norm`` on the concatenated global batch;
3. ``SyncBNFunction`` (file ``sync_bn.py``, every rank, built on the files of exercises 1
   and 2): the whole autograd Function; judged against ``F.batch_norm`` on the concatenated
   global batch, step by step (outputs, gradients, running statistics).

One file per exercise holds its contract (``ex1_sync_mean_var.py`` ... , shared case
builders and the runs over 2 and 3 ranks in ``common.py``). The grader runs each exercise in
one torchrun job of 3 ranks (runs over all 3 and over ranks 0 and 1); each visible check
below runs the same contract on 2 ranks on small fixed inputs through
:func:`ddp_lab.checks.runner.visible`.

Example:
    >>> from ddp_lab.checks import lab04 as checks
    >>> checks.sync_mean_var("sync_stats.py")  # doctest: +SKIP
    OK: sync_mean_var gives every rank the global mean, variance and count on 2 ranks ...
"""

from __future__ import annotations

from pathlib import Path

from ddp_lab.checks import runner
from ddp_lab.checks.failure import CheckFailed
from ddp_lab.checks.lab04 import ex1_sync_mean_var, ex2_sync_input_grad, ex3_sync_bn_function
from ddp_lab.checks.lab04.common import FUNCTION_FILE, GRAD_FILE, STATS_FILE

LAB = "lab04_syncbn"

#: The exercises, in the order of the notebook's test cells.
EXERCISES = [
    ex1_sync_mean_var.EXERCISE,
    ex2_sync_input_grad.EXERCISE,
    ex3_sync_bn_function.EXERCISE,
]

#: True while ``nbgrader autograde`` runs the notebook (the grader, not a student). The
#: notebook then skips its torchrun demonstrations, and the visible checks skip their torchrun
#: jobs: they teach, the grader's verdicts decide.
GRADING = runner.grading()


def sync_mean_var(path: str = STATS_FILE) -> None:
    """Visible check of exercise 1: the file on 2 ranks (torchrun), float32 far from 0 and a
    rank without samples."""
    runner.visible(LAB, "test_ex1_sync_mean_var", folder=Path(path).parent)


def sync_input_grad(path: str = GRAD_FILE) -> None:
    """Visible check of exercise 2: the file on 2 ranks (torchrun) of different batch sizes."""
    runner.visible(LAB, "test_ex2_sync_input_grad", folder=Path(path).parent)


def unfinished(folder: str | Path = ".") -> str | None:
    """Why ``sync_bn.py`` cannot run yet on the student's own pieces, or None.

    Example:
        >>> unfinished("no_such_folder")  # doctest: +ELLIPSIS
        'sync_bn.py builds on your sync_stats.py (exercise 1), not found in ...'
    """
    folder = Path(folder).resolve()
    for name, number in ((STATS_FILE, 1), (GRAD_FILE, 2), (FUNCTION_FILE, 3)):
        path = folder / name
        if not path.is_file():
            return (
                f"{FUNCTION_FILE} builds on your {name} (exercise {number}), not found in "
                f"{folder}: run the cell that starts with %%writefile {name}"
            )
        if runner.STUB in path.read_text():
            why = f"your {name} still holds the released stub: finish exercise {number} first"
            if number < 3:
                why += (
                    f" (the grader runs exercise 3 with correct versions of {STATS_FILE} and "
                    f"{GRAD_FILE}, so their mistakes cost points once)"
                )
            return why
    return None


def sync_bn_function(path: str = FUNCTION_FILE) -> None:
    """Visible check of exercise 3: the file on 2 ranks (torchrun) for 3 steps, with your
    ``sync_stats.py`` and ``sync_grad.py`` next to it."""
    folder = Path(path).parent.resolve()
    mine = folder / FUNCTION_FILE
    if not runner.grading() and mine.is_file() and runner.STUB not in mine.read_text():
        if why := unfinished(folder):
            raise CheckFailed(why)
    runner.visible(LAB, "test_ex3_sync_bn_function", folder=folder)


__all__ = [
    "EXERCISES",
    "GRADING",
    "LAB",
    "sync_bn_function",
    "sync_input_grad",
    "sync_mean_var",
    "unfinished",
]
