"""Every typical mistake of every lab loses its own exercise, with its own diagnosis.

Each lab's mistakes live in one place, ``ddp_lab/answers/labNN/mistakes.py`` (``MISTAKES``, a
list of :class:`ddp_lab.answers.Mistake`); every ``reason`` must appear in the failed
verdict's message, which proves that the exercise failed for its own cause.

- The typical mistakes (the first of each exercise) are the sample class's ``mistake``
  student: ``tests/test_grading.py`` grades that notebook with ``make autograde`` and checks
  every reason in its feedback.
- The other mistakes of exercises that run in one process take the grader's own path in
  this process (``runner.namespace`` -> ``run_here`` -> the saved and reloaded outputs ->
  ``full_judge``): the same code, without the seconds a fresh process costs.
- The other mistakes of distributed exercises go through the real grader in rounds holding
  at most one mistake per exercise.
"""

from __future__ import annotations

import pytest
import torch
from _harness import ROOT, notebook_with, solution_sources

from ddp_lab.answers import full_judge, hidden, lab_answers
from ddp_lab.checks import runner
from ddp_lab.checks.contract import exercises, unsealed
from ddp_lab.checks.failure import CheckFailed
from ddp_lab.checks.values import plain
from ddp_lab.grading.verdict import judge_notebook

LABS = sorted(p.name for p in (ROOT / "solutions").iterdir() if p.is_dir())
SEED = 1234


def _mistakes(lab: str):
    module = lab_answers(lab)
    return list(getattr(module, "MISTAKES", [])) if module else []


def _split(lab: str):
    """(typical mistakes, other in-process mistakes, other distributed mistakes)."""
    table = exercises(lab)
    typical, here, spread, seen = [], [], [], set()
    for m in _mistakes(lab):
        if m.cell not in seen:
            seen.add(m.cell)
            typical.append(m)
        elif table[f"test_{m.cell}"].distributed:
            spread.append(m)
        else:
            here.append(m)
    return typical, here, spread


def _grader_rounds() -> list[tuple[str, str, tuple]]:
    """``(lab, name, mistakes)``: rounds of the distributed exercises' other mistakes, at
    most one per exercise in a round."""
    out = []
    for lab in LABS:
        spread = _split(lab)[2]
        rounds: list[dict] = []
        for m in spread:
            for r in rounds:
                if m.cell not in r:
                    r[m.cell] = m
                    break
            else:
                rounds.append({m.cell: m})
        out += [(lab, f"more-{i}", tuple(r.values())) for i, r in enumerate(rounds)]
    return out


def _in_process() -> list[tuple[str, object]]:
    return [(lab, m) for lab in LABS for m in _split(lab)[1]]


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
    "lab,name,mistakes", _grader_rounds(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_mistakes_fail_their_own_exercises_in_the_grader(lab, name, mistakes):
    nb = notebook_with(lab, {m.cell: m.source for m in mistakes})
    verdicts = judge_notebook(nb, lab, [f"test_{m.cell}" for m in mistakes], seed=SEED)
    for m in mistakes:
        v = verdicts[f"test_{m.cell}"]
        assert not v.passed, f"{lab} {m.cell} mistake {m.name!r} passed: {v}"
        assert m.reason in v.message, f"{lab} {m.cell} {m.name!r}: {v.message}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "lab,mistake", _in_process(), ids=lambda v: v if isinstance(v, str) else v.name
)
def test_more_mistakes_fail_on_the_graders_path_in_this_process(lab, mistake, tmp_path):
    gid = f"test_{mistake.cell}"
    ex, extra = exercises(lab)[gid], hidden(lab).get(gid)
    inputs = (extra.inputs if extra and extra.inputs else ex.make_inputs)(
        torch.Generator().manual_seed(SEED)
    )
    sources = {**solution_sources(lab), mistake.cell: mistake.source}
    try:
        ns = runner.namespace(sources, ex.cells, tmp_path, ex.forbid, ex.forbid_modules)
        outputs = plain(runner.run_here(ex, ns, unsealed(inputs), tmp_path))  # as the grader
    except Exception as err:  # noqa: BLE001 - the grader reports the student's error
        message = f"your code failed: {type(err).__name__}: {err}"
    else:
        torch.save(outputs, tmp_path / "outputs.pt")  # what the judge process loads
        outputs = torch.load(tmp_path / "outputs.pt", weights_only=True)
        with pytest.raises(CheckFailed) as failed:
            full_judge(ex, extra)(inputs, outputs)
        message = str(failed.value)
    assert mistake.reason in message, f"{lab} {mistake.cell} {mistake.name!r}: {message}"
