"""The checks behind the notebooks' test cells (part of the student kit).

Each lab has a package here, ``ddp_lab.checks.labNN``, with one file per exercise. An
exercise file holds the exercise's contract (:class:`~ddp_lab.checks.contract.Exercise`):
its case set, how the student's code runs, and a judge that compares the result with an
independent oracle (``dist.all_reduce``, autograd on the full batch, ``nn.BatchNorm`` on the
global batch, ``DistributedSampler``) or with properties. The lab package exports one
*visible check* per test cell, which runs that contract on small fixed inputs through
:mod:`ddp_lab.checks.runner` and prints ``OK: ...`` or raises :class:`CheckFailed`::

    checks.data_parallel_step(data_parallel_step)    # visible, in the student's kernel

The points come from the grader (``ddp_lab.grading``, instructor only), which runs the same
contract outside the kernel on inputs drawn at grading time and adds the instructor's exact
comparisons (``ddp_lab.answers``). Shared pieces: :mod:`~ddp_lab.checks.failure` (the
failure type and comparisons), :mod:`~ddp_lab.checks.values` (saveable values, random
draws), :mod:`~ddp_lab.checks.guards` (what student code may not call).
"""

from __future__ import annotations

from ddp_lab.checks.failure import (
    CheckFailed,
    all_close,
    assert_close,
    is_close,
    max_abs_diff,
    passed,
    require,
)

__all__ = [
    "CheckFailed",
    "all_close",
    "assert_close",
    "is_close",
    "max_abs_diff",
    "passed",
    "require",
]
