"""Every typical mistake of every lab loses its own exercise, with its own diagnosis.

Each lab's mistakes live in one place, ``ddp_lab/answers/labNN/mistakes.py`` (``MISTAKES``, a
list of :class:`ddp_lab.answers.Mistake`). The exercises of a lab are independent, so the
mistakes are grouped into rounds holding at most one per exercise, and one grader run
(``judge_notebook``, out of the kernel, real student processes) judges a whole round: every
mistake must fail its exercise, and the message must contain the mistake's ``reason``
(which proves that it failed for its own cause, not for a neighbour's).
"""

from __future__ import annotations

import pytest
from _harness import ROOT, notebook_with

from ddp_lab.answers import lab_answers
from ddp_lab.checks.contract import exercises
from ddp_lab.grading.verdict import judge_notebook

LABS = sorted(p.name for p in (ROOT / "solutions").iterdir() if p.is_dir())
SEED = 1234


def _mistakes(lab: str):
    module = lab_answers(lab)
    return list(getattr(module, "MISTAKES", [])) if module else []


def _rounds() -> list[tuple[str, int, tuple]]:
    """``(lab, round number, mistakes)`` with at most one mistake per exercise in a round."""
    out = []
    for lab in LABS:
        rounds: list[dict] = []
        for m in _mistakes(lab):
            for r in rounds:
                if m.cell not in r:
                    r[m.cell] = m
                    break
            else:
                rounds.append({m.cell: m})
        out += [(lab, i, tuple(r.values())) for i, r in enumerate(rounds)]
    return out


@pytest.mark.parametrize("lab", LABS)
def test_every_exercise_has_a_typical_mistake_with_a_reason(lab):
    mistakes = _mistakes(lab)
    cells = {gid.removeprefix("test_") for gid in exercises(lab)}
    assert {m.cell for m in mistakes} == cells, "every exercise needs at least one mistake"
    assert all(m.reason for m in mistakes)
    names = [(m.cell, m.name) for m in mistakes]
    assert len(names) == len(set(names)), "mistake names repeat"


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "lab,number,mistakes",
    _rounds(),
    ids=lambda v: v if isinstance(v, str) else str(v) if isinstance(v, int) else "",
)
def test_mistakes_fail_their_own_exercises(lab, number, mistakes):
    nb = notebook_with(lab, {m.cell: m.source for m in mistakes})
    verdicts = judge_notebook(nb, lab, [f"test_{m.cell}" for m in mistakes], seed=SEED)
    for m in mistakes:
        v = verdicts[f"test_{m.cell}"]
        assert not v.passed, f"{lab} {m.cell} mistake {m.name!r} passed: {v}"
        assert m.reason in v.message, f"{lab} {m.cell} {m.name!r}: {v.message}"
