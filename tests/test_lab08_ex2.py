"""Lab 8 exercise 2 (``find_straggler``): its case set, its judge and its mistakes.

- over 200 seeds the case set (drawn without running it) holds every edge case: every phase
  slowed on 2 and on 3 ranks, a straggler that is rank 0 and one that is not, a hiccup in the
  last step's optimizer and one in the first step (of a job not slowed in its data loading),
  hiccups on other ranks only, slowdowns within the contract's bounds;
- on jobs recorded now (two draws, one launch each): the contract's promise holds (the
  straggler's median own time in its phase beats every other rank's by the slowdown's
  order, and no other rank and phase comes near), the reference and the solution cell agree
  with the truth and pass the grader's full judge, and every mistake fails with its reason
  on the grader's path (namespace, run, saved outputs, full judge);
- the visible check passes on the solution (jobs recorded now), fails on a mistake with a
  readable message and asks to finish a stub, and leaves the work to the grader under it.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
import torch
from _harness import saved

from ddp_lab.answers import full_judge
from ddp_lab.answers.lab08 import ex2 as ans
from ddp_lab.answers.lab08 import references_ex2 as ref
from ddp_lab.checks import runner
from ddp_lab.checks.contract import SEALED, unsealed
from ddp_lab.checks.failure import CheckFailed
from ddp_lab.checks.lab08 import ex2_straggler as ex2
from ddp_lab.checks.lab08 import straggler_jobs as jobs
from ddp_lab.checks.lab08.common import LAB, PHASES
from ddp_lab.checks.lab08.jobs import KEYS

JUDGE = full_judge(ex2.EXERCISE, ans.HIDDEN[ex2.GRADE_ID])


def _fn(source: str):
    return runner.namespace({ans.CELL: source}, [ans.CELL])["find_straggler"]


def test_every_draw_holds_every_edge_case():
    for seed in range(200):
        specs = ex2.draw_specs(torch.Generator().manual_seed(seed))
        assert sorted((s["world_size"], s["phase"]) for s in specs) == sorted(
            (w, p) for w in (2, 3) for p in PHASES
        )
        ranks = [s["rank"] for s in specs]
        assert 0 in ranks and any(r > 0 for r in ranks), seed
        assert all(0 <= s["rank"] < s["world_size"] for s in specs)
        assert all(jobs.SLOW_MS <= s["slow_ms"] <= jobs.SLOW_MAX_MS for s in specs)
        hiccups = [(s, s["hiccup"]) for s in specs if s["hiccup"]]
        assert all(h[0] != s["rank"] and 0 <= h[0] < s["world_size"] for s, h in hiccups)
        assert any(h[1:] == ["optimizer", ex2.STEPS - 1] for _, h in hiccups), seed
        assert any(h[2] == 0 and s["phase"] != "data" for s, h in hiccups), seed
        assert not any(h[2] == 0 and s["phase"] == "data" for s, h in hiccups), seed


@pytest.fixture(scope="module")
def draws():
    """A grading run's inputs, recorded now (one launch of 3 ranks; tests/test_mistakes.py
    records another draw, and the sample class's grading runs more)."""
    return [ex2.make_inputs(torch.Generator().manual_seed(0))]


def _margins(job: dict, truth: dict) -> tuple[float, float]:
    """(the straggler's excess in its phase, the largest excess of any other rank and
    phase), in ms: median own time over the steps minus the most of the other ranks'."""
    own = [{p: statistics.median(v) for p, v in ref.own_times(t).items()} for t in job["traces"]]
    n = len(own)

    def excess(r, p):
        return (own[r][p] - max(own[q][p] for q in range(n) if q != r)) / 1e3

    others = [excess(r, p) for r in range(n) for p in PHASES if (r, p) != tuple(truth.values())]
    return excess(truth["rank"], truth["phase"]), max(others)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_recorded_jobs_keep_the_contract_and_the_reference_finds_every_straggler(draws):
    solution = _fn(ans.SOLUTION_CELL)
    for inputs in draws:
        assert len(inputs["jobs"]) == 8
        for job, truth in zip(inputs["jobs"], inputs[SEALED]["truths"], strict=True):
            assert len(job["traces"]) == job["world_size"]
            for events in job["traces"]:
                marks = [e for e in events if e["name"].startswith("ProfilerStep#")]
                assert len(marks) == ex2.STEPS
                assert all(
                    {"name", "ts", "dur", "tid"} <= set(e) <= set(KEYS) and e["ph"] == "X"
                    for e in events
                )
            mine, other = _margins(job, truth)
            assert mine >= 0.6 * jobs.SLOW_MS and other < 0.4 * jobs.SLOW_MS, (mine, other)
            assert ref.find_straggler(job["traces"]) == truth
            assert solution(job["traces"]) == truth
        outputs = saved({"answers": [solution(j["traces"]) for j in inputs["jobs"]]})
        assert "find_straggler named the slow rank" in JUDGE(inputs, outputs)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mistake", ans.MISTAKES, ids=lambda m: m.name)
def test_every_mistake_fails_with_its_reason_on_the_graders_path(draws, mistake, tmp_path):
    for inputs in draws:
        ns = runner.namespace({mistake.cell: mistake.source}, ex2.EXERCISE.cells, tmp_path)
        outputs = saved(runner.run_here(ex2.EXERCISE, ns, unsealed(inputs), tmp_path))
        with pytest.raises(CheckFailed) as failed:
            JUDGE(inputs, outputs)
        assert mistake.reason in str(failed.value), str(failed.value)


def test_the_first_mistake_is_written_apart_from_the_solution():
    typical = ans.MISTAKES[0].source
    assert "own" not in typical and "median" not in typical and "### " not in typical


def test_wrong_forms_are_named_without_the_truth():
    n = 3
    inputs = {
        "jobs": [{"world_size": 2, "traces": [[], []]}] * n,
        SEALED: {"truths": [{"rank": 1, "phase": "forward"}] * n},
    }
    for bad, words in (
        ([None] * n, "expected {"),
        ([{"rank": 5, "phase": "data"}] * n, "is not a rank of this job"),
        ([{"rank": 0, "phase": "comm"}] * n, "is none of"),
        ([{"rank": True, "phase": "data"}] * n, "is not a rank"),
    ):
        with pytest.raises(CheckFailed, match=words):
            JUDGE(inputs, saved({"answers": bad}))
    with pytest.raises(CheckFailed, match="one answer per job"):
        JUDGE(inputs, {"answers": []})
    with pytest.raises(CheckFailed, match="rank 1 is the straggler, but 'data'") as failed:
        JUDGE(inputs, saved({"answers": [{"rank": 1, "phase": "data"}] * n}))
    assert "forward" not in str(failed.value)  # the truth is not told


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_visible_check_passes_the_solution_and_explains_a_mistake(draws, capsys):
    ex2.visible(_fn(ans.SOLUTION_CELL))  # jobs recorded now
    assert "OK: find_straggler named the slow rank" in capsys.readouterr().out
    victim = _fn(ans.MISTAKES[0].source)
    with pytest.raises(CheckFailed, match="is not the straggler"):
        runner.visible(LAB, ex2.GRADE_ID, functions={"find_straggler": victim}, inputs=draws[0])

    def stub(traces):
        raise NotImplementedError

    with pytest.raises(CheckFailed, match="still raises NotImplementedError"):
        runner.visible(LAB, ex2.GRADE_ID, functions={"find_straggler": stub}, inputs=draws[0])


def test_under_the_grader_the_visible_check_leaves_it_to_the_grader(monkeypatch, capsys):
    monkeypatch.setenv("NBGRADER_EXECUTION", "autograde")
    ex2.visible(lambda traces: {"rank": 0, "phase": "data"})
    assert "judged by the grader" in capsys.readouterr().out


def test_the_cells_hold_the_solution_a_test_and_a_written_answer():
    from ddp_lab.answers.lab08.ex2_cells import CELLS

    ids = [c["id"] for c in CELLS]
    assert len(ids) == len(set(ids)) and all(i.startswith(("ex2_", "test_ex2_")) for i in ids)
    by_id = {c["id"]: c for c in CELLS}
    assert by_id["ex2_straggler"]["source"] == ans.SOLUTION_CELL.strip("\n")
    assert "checks.straggler(find_straggler)" in by_id["test_ex2_straggler"]["source"]
    assert by_id["ex2_a_victims"]["metadata"]["nbgrader"]["points"] == 2
    assert Path(jobs.__file__).name == "straggler_jobs.py"
