"""What a graded exercise is, for the grader: inputs, how to run the student, how to judge.

Every autograded test cell of a lab has an :class:`Exercise` in ``ddp_lab.checks.labNN``
(``EXERCISES``). Its three functions run in three different processes:

``make_inputs(gen)``
    in the grader (never student code): fresh random inputs, drawn at grading time.
``run(ns, inputs, workdir)`` (or ``run_rank`` for distributed code)
    in a fresh *student* process: ``ns`` holds the names the student's solution cells
    defined; returns the outputs (tensors, numbers, lists, dicts) that are saved with
    ``torch.save``.
``judge(inputs, outputs)``
    in a fresh *judge* process that never runs student code: loads the outputs with
    ``weights_only=True``, compares them with ``ddp_lab``'s reference implementation, and
    raises :class:`~ddp_lab.checks.CheckFailed` with a message saying what was expected
    and what came back; returns a one-line success message.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class Exercise:
    """One autograded test cell and how to judge it outside the student's kernel.

    Attributes:
        grade_id: the nbgrader ``grade_id`` of the *test* cell that carries the points.
        cells: ``grade_id``\\ s of the solution cells whose code the exercise runs, in order.
        title: what the exercise checks, in a few words (shown in feedback).
        make_inputs: ``gen -> inputs`` (grader side).
        judge: ``(inputs, outputs) -> message`` (judge side; raises ``CheckFailed``).
        run: ``(ns, inputs, workdir) -> outputs`` (student side), or None with ``run_rank``.
        run_rank: ``(ns, inputs, case, rank, world_size) -> outputs`` for code that runs on
            every rank of a torchrun job; ``inputs["cases"]`` lists the jobs, each with a
            ``world_size``.
        forbid: ``torch.distributed`` functions that raise while the student's code runs
            (e.g. ``all_reduce`` in a hand-written ring).
        forbid_modules: modules the solution cells may not mention (the reference the
            exercise asks students to rewrite, e.g. ``ddp_lab.collectives``);
            ``ddp_lab.checks`` is always forbidden.
        timeout: seconds the student process may take in total.
    """

    grade_id: str
    cells: tuple[str, ...]
    title: str
    make_inputs: Callable[[torch.Generator], dict]
    judge: Callable[[dict, dict], str]
    run: Callable[[dict, dict, Path], dict] | None = None
    run_rank: Callable[[dict, dict, dict, int, int], Any] | None = None
    forbid: tuple[str, ...] = ()
    forbid_modules: tuple[str, ...] = ()
    timeout: float = 60.0
    points_note: str = field(default="", compare=False)

    def __post_init__(self):
        if (self.run is None) == (self.run_rank is None):
            raise ValueError(f"{self.grade_id}: give exactly one of run= and run_rank=")


def lab_module(lab: str):
    """The checks module of a lab: ``"lab02_collectives"`` -> ``ddp_lab.checks.lab02``."""
    short = lab.split("_", 1)[0]
    try:
        return importlib.import_module(f"ddp_lab.checks.{short}")
    except ModuleNotFoundError:
        raise KeyError(f"no checks module for lab {lab!r} (ddp_lab.checks.{short})") from None


def exercises(lab: str) -> dict[str, Exercise]:
    """``grade_id -> Exercise`` for every autograded test cell of ``lab``."""
    return {ex.grade_id: ex for ex in lab_module(lab).EXERCISES}


def lab_of_notebook(path: str | Path) -> str:
    """The lab name of a notebook file: ``.../lab02_collectives.ipynb`` -> ``lab02_collectives``."""
    return Path(path).stem
