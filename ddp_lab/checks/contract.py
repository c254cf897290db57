"""What a graded exercise is: its inputs, how student code runs, how the result is judged.

Every graded test cell of a lab has an :class:`Exercise` in its lab's checks package
(``ddp_lab/checks/labNN/exN_*.py``, collected in ``ddp_lab.checks.labNN.EXERCISES``). The
same contract drives both the quick feedback in the notebook (the *visible check*, run by
:mod:`ddp_lab.checks.runner` on small fixed inputs) and the grade (run by the grader on
inputs drawn at grading time). Its functions run in different processes:

``make_inputs(gen)``
    the case set: every edge case of the exercise (world sizes 2 and 3, counts of 1 and many,
    lengths not divisible by the world size, float32 and float64, ...), with random values
    inside each case drawn from ``gen``. The grader seeds ``gen`` at grading time.
``visible_inputs(gen)``
    smaller inputs for the visible check (default: ``make_inputs``), drawn from a fixed seed.
``run(ns, inputs, workdir)`` or ``run_rank(ns, inputs, case, rank, world_size)``
    in the *student* process: call the student's code and return plain outputs (tensors,
    numbers, strings, lists and dicts). ``run_rank`` runs on every rank of a torchrun job,
    one job per ``inputs["cases"]`` entry (each case has a ``world_size``).
``judge(inputs, outputs)``
    in a process that never runs student code: compare with an *independent oracle*
    (``dist.all_reduce``, autograd on the full batch, ``nn.BatchNorm`` on the global batch,
    ``DistributedSampler``) or with properties (limits, invariants); raise
    :class:`~ddp_lab.checks.failure.CheckFailed` saying what was expected and what came
    back, or return a one-line success message. Comparisons with the exact reference answer
    live only in the instructor's part of the package (``ddp_lab.answers``), which the
    grader adds on top.

Where the inputs are built so that the answer is known by construction and that answer must
not reach the student's code (a diagnosis exercise: the cause drawn for each job), put it
under ``inputs[SEALED]``: the grader keeps that entry out of the student's process and gives
it back to the judge alone.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

#: Extra packages that hold the checks of labs outside ``ddp_lab.checks`` (comma-separated),
#: e.g. the grader's self-test lab under ``tests/``.
EXTRA_CHECKS_ENV = "DDP_LAB_EXTRA_CHECKS"
#: The entry of an exercise's inputs that only its judge sees (see the module).
SEALED = "sealed"


def unsealed(inputs: dict) -> dict:
    """``inputs`` without the judge's sealed entry: what the student's code may see."""
    return {k: v for k, v in inputs.items() if k != SEALED}


@dataclass(frozen=True)
class Exercise:
    """One graded test cell and how to check it outside the student's kernel.

    Attributes:
        grade_id: the nbgrader ``grade_id`` of the *test* cell that carries the points.
        cells: ``grade_id``\\ s of the solution cells whose code the exercise runs, in order.
        title: what the exercise checks, in a few words (shown in feedback).
        make_inputs: ``gen -> inputs``: the case set, random values inside each case.
        judge: ``(inputs, outputs) -> message`` (raises ``CheckFailed``).
        run: ``(ns, inputs, workdir) -> outputs`` (student side), or None with ``run_rank``.
        run_rank: ``(ns, inputs, case, rank, world_size) -> outputs`` for code that runs on
            every rank of a torchrun job.
        forbid: ``torch.distributed`` functions that raise while the student's code runs
            (e.g. ``all_reduce`` in a hand-written ring).
        forbid_modules: modules the solution cells may not mention (the runtime module an
            exercise asks students to rewrite, e.g. ``ddp_lab.dist``); the checks, the grader
            and the answers are always forbidden.
        timeout: seconds the student process may take in total.
        visible_inputs: ``gen -> inputs`` for the visible check (default ``make_inputs``).
        files: the files the solution cells write with ``%%writefile`` (the visible check
            looks for them next to the notebook).
    """

    grade_id: str
    cells: tuple[str, ...]
    title: str
    make_inputs: Callable[[torch.Generator], dict]
    judge: Callable[[dict, dict], str]
    run: Callable[[dict, dict, Path], Any] | None = None
    run_rank: Callable[[dict, dict, dict, int, int], Any] | None = None
    forbid: tuple[str, ...] = ()
    forbid_modules: tuple[str, ...] = ()
    timeout: float = 60.0
    visible_inputs: Callable[[torch.Generator], dict] | None = None
    files: tuple[str, ...] = ()

    def __post_init__(self):
        if (self.run is None) == (self.run_rank is None):
            raise ValueError(f"{self.grade_id}: give exactly one of run= and run_rank=")

    @property
    def distributed(self) -> bool:
        """True when the student's code runs on every rank of torchrun jobs."""
        return self.run_rank is not None


def lab_module(lab: str):
    """The checks package of a lab: ``"lab02_collectives"`` -> ``ddp_lab.checks.lab02``.

    Labs outside the package (the grader's self-test) are found in the packages named by
    ``$DDP_LAB_EXTRA_CHECKS``.

    Raises:
        KeyError: no checks for ``lab``.
    """
    short = lab.split("_", 1)[0]
    extra = [p for p in os.environ.get(EXTRA_CHECKS_ENV, "").split(",") if p]
    for package in ("ddp_lab.checks", *extra):
        try:
            return importlib.import_module(f"{package}.{short}")
        except ModuleNotFoundError as err:
            if err.name not in (f"{package}.{short}", package):
                raise
    raise KeyError(f"no checks for lab {lab!r} (ddp_lab.checks.{short})")


def exercises(lab: str) -> dict[str, Exercise]:
    """``grade_id -> Exercise`` for every graded test cell of ``lab``.

    Example:
        >>> sorted(exercises("lab01_data_parallel"))[0]
        'test_ex1_split_batch'
    """
    return {ex.grade_id: ex for ex in lab_module(lab).EXERCISES}


def lab_of_notebook(path: str | Path) -> str:
    """The lab name of a notebook file: ``.../lab02_collectives.ipynb`` -> ``lab02_collectives``.

    Example:
        >>> lab_of_notebook("labs/lab02_collectives/lab02_collectives.ipynb")
        'lab02_collectives'
    """
    return Path(path).stem
