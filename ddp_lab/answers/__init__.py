"""The instructor's part of the course: reference answers, exact checks, typical mistakes.

**Not part of the student kit** (``make student-kit`` leaves this package out, and a test
proves that no kit file holds its code). Each lab has a package ``ddp_lab.answers.labNN``:

- ``references.py``: the reference implementation of every exercise (what the solutions do);
- ``hidden.py``: ``HIDDEN = {test grade_id: Hidden(...)}``, what the grader adds to the
  kit's oracle judge: exact comparisons with the reference and diagnoses of wrong answers;
- ``mistakes.py``: one typical wrong answer per exercise (``MISTAKES``), more of them with
  the exercise each must fail (``MORE_MISTAKES``), deadlocks (``HANGS``) and forged result
  files (``FORGED_FILES``), used by the tests and by the sample class.

The grader's judge composes a verdict from the kit's judge and :class:`Hidden`
(:func:`full_judge`). Student code never runs with this package visible: the grading
sandbox hides it, and solution cells that mention it are refused.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ddp_lab.checks.contract import EXTRA_CHECKS_ENV, Exercise
from ddp_lab.checks.failure import CheckFailed


@dataclass(frozen=True)
class Hidden:
    """What the grader adds to an exercise's visible contract.

    Attributes:
        inputs: ``gen -> inputs`` replacing ``Exercise.make_inputs`` when drawing the case set
            needs the reference itself (synthetic times from the exact cost model).
        check: ``(inputs, outputs) -> None``, run after the kit's judge passed: compares with
            the exact reference answer; raises ``CheckFailed``.
        explain: ``(inputs, outputs) -> str | None``, run when the kit's judge failed: a more
            precise diagnosis (which typical mistake it is), or None to keep the kit's message.
        files: ``() -> {filename: source}`` written into the exercise's folder before the
            student's code runs (the reference pieces an exercise builds on, so that a
            mistake in an earlier exercise does not cost this one).
    """

    inputs: Callable[[torch.Generator], dict] | None = None
    check: Callable[[dict, dict], None] | None = None
    explain: Callable[[dict, dict], str | None] | None = None
    files: Callable[[], dict[str, str]] | None = None


@dataclass(frozen=True)
class Mistake:
    """A typical wrong answer to one exercise, and what the grader must say about it.

    Attributes:
        cell: the solution cell it replaces (``ex2_sync_mean_var``).
        name: a short name (``"typical"`` for the one the sample class submits).
        source: the whole cell's source, as a student would write it.
        reason: a fragment the failed verdict's message must contain (the diagnosis).
    """

    cell: str
    name: str
    source: str
    reason: str


def typical(mistakes: list[Mistake]) -> dict[str, str]:
    """``cell -> source`` of the first mistake listed for each cell (the sample class's)."""
    out: dict[str, str] = {}
    for m in mistakes:
        out.setdefault(m.cell, m.source)
    return out


def lab_answers(lab: str):
    """The answers package of ``lab`` (``ddp_lab.answers.lab03``), or None when it has none.

    Labs outside the course (the grader's self-test) may keep theirs next to their checks
    (``<package>.<short>_answers`` in ``$DDP_LAB_EXTRA_CHECKS``).
    """
    short = lab.split("_", 1)[0]
    extra = [p for p in os.environ.get(EXTRA_CHECKS_ENV, "").split(",") if p]
    names = [f"ddp_lab.answers.{short}", *(f"{p}.{short}_answers" for p in extra)]
    for name in names:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name is None or not name.startswith(err.name):
                raise
    return None


def hidden(lab: str) -> dict[str, Hidden]:
    """``grade_id -> Hidden`` of ``lab`` (``{}`` when the lab has no hidden parts)."""
    module = lab_answers(lab)
    return dict(getattr(module, "HIDDEN", {})) if module is not None else {}


def full_judge(ex: Exercise, extra: Hidden | None) -> Callable[[dict, dict], str]:
    """The grader's judge of ``ex``: the kit's oracle judge, then the exact check; a wrong
    answer (either failed) gets the precise diagnosis when ``extra.explain`` has one."""

    def judge(inputs: dict, outputs: dict) -> str:
        try:
            message = ex.judge(inputs, outputs)
            if extra and extra.check:
                extra.check(inputs, outputs)
            return message
        except CheckFailed:
            better = extra.explain(inputs, outputs) if extra and extra.explain else None
            if better:
                raise CheckFailed(better) from None
            raise

    return judge
