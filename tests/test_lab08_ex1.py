"""Lab 8 exercise 1 (``step_breakdown``): its case set, its oracle, its mistakes, its cells.

- every draw (200 seeds, inputs only) holds every synthetic edge case, and the real jobs
  hold one bucket and several, a plain and a slow link, 2 and 3 ranks; in every draw each
  typical mistake's value differs from the truth by far more than the tolerance on some
  synthetic trace, so no mistake depends on what the real traces happen to show;
- over 100 seeds (synthetic traces), the reference passes the grader's full judge and every
  mistake fails it with its own reason, on the grader's path in this process;
- real traces (one launch): the oracle agrees with the reference, the reference passes,
  every mistake fails with its reason; facts the prose states hold there (collectives on
  gloo's threads, not the training thread; one collective per step with one bucket,
  several with several; DDP's wait a gap inside ``ddp_lab: backward``);
- the visible check passes on the reference and fails on a mistake with one readable line;
- the kit files hold no copy of the reference (the kit's leak measure);
- the cells: ids, points, the solution cell, the demo's guard.
"""

from __future__ import annotations

import doctest
import time
from pathlib import Path

import pytest
import torch

from ddp_lab.answers import full_judge
from ddp_lab.answers.lab08 import ex1 as answers
from ddp_lab.answers.lab08.ex1_cells import CELLS
from ddp_lab.answers.lab08.references_ex1 import step_breakdown
from ddp_lab.checks import runner
from ddp_lab.checks.contract import unsealed
from ddp_lab.checks.failure import CheckFailed
from ddp_lab.checks.lab08 import ex1_step_breakdown as ex
from ddp_lab.checks.lab08 import trace_jobs
from ddp_lab.checks.values import plain
from ddp_lab.grading import integrity, kit

#: Draws of synthetic traces checked for edge cases and twins (cheap: no judge).
SEEDS = range(200)
#: Draws on which the reference and every mistake are judged.
PROPERTY_SEEDS = range(100)
EXERCISE = ex.EXERCISE
JUDGE = full_judge(EXERCISE, answers.HIDDEN[answers.GID])
#: a mistake must miss the truth by this much (ms) on some synthetic trace of every draw
MARGIN_MS = 0.05


def _ns(source: str) -> dict:
    return runner.namespace({answers.CELL: source}, [answers.CELL])


SOLUTION = _ns(answers.SOLUTION_CELL)
MISTAKE_NS = {m.name: _ns(m.source) for m in answers.MISTAKES}


def _graded(ns: dict, inputs: dict, tmp_path) -> str:
    """The grader's path in this process: run, save, reload, full judge; its message."""
    outputs = plain(runner.run_here(EXERCISE, ns, unsealed(inputs), tmp_path))
    torch.save(outputs, tmp_path / "outputs.pt")
    outputs = torch.load(tmp_path / "outputs.pt", weights_only=True)
    try:
        return "passed: " + JUDGE(inputs, outputs)
    except CheckFailed as err:
        return str(err)


def _by_label(cases: list[dict]) -> dict[str, list[dict]]:
    return {c["label"].removeprefix("a synthetic trace: "): c["events"] for c in cases}


def _spans(events, keep):
    return [(e["ts"], e["ts"] + e["dur"], e) for e in events if keep(e)]


def _marks(events):
    return sorted(
        (e for e in events if e["name"].startswith("ProfilerStep#")), key=lambda e: e["ts"]
    )


def _is_op(e):
    return e["cat"] == "cpu_op" and e["tid"] == ex.MAIN


def _is_comm(e):
    return e["name"].startswith(ex.COLLECTIVE_PREFIXES)


# --- the case set --------------------------------------------------------------------------


def test_every_draw_holds_every_edge_case():
    for seed in SEEDS:
        gen = torch.Generator().manual_seed(seed)
        specs = ex.draw_jobs(gen)
        one = [s["cap"] > 2 * trace_jobs.model_mb() for s in specs]
        assert sorted(zip(one, [bool(s["slow"]) for s in specs], strict=True)) == sorted(
            [(True, False), (True, True), (False, False), (False, True)]
        )
        assert sorted(s["world_size"] for s in specs) == [2, 2, 3, 3]
        assert all(s["cap"] <= 0.5 for s, o in zip(specs, one, strict=True) if not o)
        cases = ex.synthetic_cases(gen)
        t = _by_label(cases)
        assert len(t) == len(ex.SYNTHETIC) == 6
        for events in t.values():
            ts = [e["ts"] for e in events]
            assert ts != sorted(ts), "events out of time order"
        nested = t["nested operators and concurrent collectives, 3 steps"]
        assert len(_marks(nested)) == 3
        for mark in _marks(nested):
            lo, hi = mark["ts"], mark["ts"] + mark["dur"]
            ops = [s for s in _spans(nested, _is_op) if lo <= s[0] < hi]
            deep = [
                c for c in ops for b in ops for a in ops
                if a[0] <= b[0] and b[1] <= a[1] and b[0] <= c[0] and c[1] <= b[1]
                and len({id(a[2]), id(b[2]), id(c[2])}) == 3
            ]  # fmt: skip
            assert deep, "operators nested 3 deep"
            comms = [s for s in _spans(nested, _is_comm) if lo <= s[0] < hi]
            assert any(
                a[2]["tid"] != b[2]["tid"] and a[0] < b[1] and b[0] < a[1]
                for a in comms
                for b in comms
            ), "collectives of two threads at once"
        edges = t["operators and collectives across the steps' edges"]
        for mark in _marks(edges):
            lo, hi = mark["ts"], mark["ts"] + mark["dur"]
            for keep in (_is_op, _is_comm):
                spans = _spans(edges, keep)
                assert any(a < lo < b for a, b, _ in spans), "across the start"
                assert any(a < hi < b for a, b, _ in spans), "across the end"
        rows = {k: ex.oracle(v) for k, v in t.items()}
        first, _ = rows["a step without communication"]
        assert first["comm_ms"] == 0 and first["compute_ms"] > 0.5
        before = _marks(t["a step without communication"])[0]["ts"]
        assert any(b < before for _, b, _ in _spans(t["a step without communication"], _is_comm))
        (hidden,) = rows["communication hidden under an operator"]
        assert hidden["comm_ms"] > 0.5 and hidden["exposed_ms"] == 0
        (exposed,) = rows["communication exposed in a gap of the backward range"]
        assert exposed["comm_ms"] > 0.5 and abs(exposed["exposed_ms"] - exposed["comm_ms"]) < 1e-9
        threads = t["operators of other threads"]
        others = [e for e in threads if e["cat"] == "cpu_op" and e["tid"] != ex.MAIN]
        assert {e["tid"] for e in others} == {ex.GLOO1, ex.LOADER}


def _twin_gap(kwargs: dict, field: str, cases: list[dict]) -> float:
    gaps = []
    for c in cases:
        for w, v in zip(
            ex.oracle(c["events"]), answers.variant(c["events"], **kwargs), strict=True
        ):
            gaps.append(abs(w[field] - v[field]))
    return max(gaps)


def test_every_twin_misses_the_truth_in_every_draw():
    for seed in SEEDS:
        cases = ex.synthetic_cases(torch.Generator().manual_seed(seed))
        for field, twins in answers._TWINS.items():
            for kwargs, _ in twins:
                assert _twin_gap(kwargs, field, cases) > MARGIN_MS, (seed, field, kwargs)


# --- judged without real traces, over many draws -------------------------------------------


def test_reference_passes_and_mistakes_fail_over_seeds(tmp_path):
    for seed in PROPERTY_SEEDS:
        inputs = ex.visible_inputs(torch.Generator().manual_seed(seed))
        assert _graded(SOLUTION, inputs, tmp_path).startswith("passed: ")
        for m in answers.MISTAKES:
            message = _graded(MISTAKE_NS[m.name], inputs, tmp_path)
            assert m.reason in message, (seed, m.name, message)


def test_the_oracle_is_the_reference_on_synthetic_traces():
    for seed in SEEDS:
        for c in ex.synthetic_cases(torch.Generator().manual_seed(seed)):
            assert ex.row_problem(step_breakdown(c["events"]), ex.oracle(c["events"]), "x") is None


def test_the_docstring_example_holds():
    ns = dict(SOLUTION)
    finder = doctest.DocTestFinder()
    runner_ = doctest.DocTestRunner()
    for t in finder.find(ns["step_breakdown"], "step_breakdown", globs=ns):
        runner_.run(t)
    assert runner_.summarize(verbose=False).failed == 0


def test_a_wrong_shape_gets_a_readable_message():
    inputs = ex.visible_inputs(torch.Generator().manual_seed(0))
    with pytest.raises(CheckFailed, match="one per ProfilerStep range"):
        JUDGE(inputs, {"results": [[] for _ in inputs["cases"]]})
    with pytest.raises(CheckFailed, match="keys step, step_ms"):
        JUDGE(inputs, {"results": [[{"step": 1}] * 3 for _ in inputs["cases"]]})


# --- real traces ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real():
    start = time.monotonic()
    inputs = ex.make_inputs(torch.Generator().manual_seed(2024))
    return inputs, time.monotonic() - start


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_real_traces_judged(real, tmp_path):
    inputs, seconds = real
    assert seconds < 40, f"make_inputs took {seconds:.1f} s"
    cases = [c for c in inputs["cases"] if c["label"].startswith("a real")]
    assert len(cases) == 10  # 2 + 2 + 3 + 3 ranks
    for c in cases:
        assert ex.row_problem(step_breakdown(c["events"]), ex.oracle(c["events"]), "x") is None
    assert _graded(SOLUTION, inputs, tmp_path).startswith("passed: ")
    for m in answers.MISTAKES:
        message = _graded(MISTAKE_NS[m.name], inputs, tmp_path)
        assert m.reason in message, (m.name, message)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_real_traces_show_what_the_prose_says(real):
    inputs, _ = real
    for c in inputs["cases"]:
        if not c["label"].startswith("a real"):
            continue
        events = c["events"]
        marks = _marks(events)
        assert 2 <= len(marks) <= 3
        main = marks[0]["tid"]
        comms = [e for e in events if e["name"] == "gloo:all_reduce"]
        assert comms and all(e["tid"] != main for e in comms), "gloo runs on its own threads"
        assert {e["tid"] for e in events if e["cat"] == "cpu_op"} == {main}
        per_step = [
            sum(m["ts"] <= e["ts"] < m["ts"] + m["dur"] for e in events if e["name"].startswith(
                trace_jobs.PREFIX + "all_reduce bucket"))
            for m in marks
        ]  # fmt: skip
        if "one DDP bucket" in c["label"]:
            assert per_step == [1] * len(marks)
        else:
            assert min(per_step) >= 3
        # DDP's wait: inside 'ddp_lab: backward', a gap between operators while gloo works
        phases = answers.variant(events, compute="phases")
        pairs = list(zip(ex.oracle(events), phases, strict=True))
        assert all(wrong["exposed_ms"] <= want["exposed_ms"] + 1e-9 for want, wrong in pairs)
        assert any(wrong["exposed_ms"] < want["exposed_ms"] - 0.05 for want, wrong in pairs)


# --- the visible check ---------------------------------------------------------------------


def test_visible_check_passes_on_the_reference_and_fails_on_a_mistake(capsys):
    ex.visible(SOLUTION["step_breakdown"])
    assert capsys.readouterr().out.startswith("OK: step_breakdown gives every step's")
    with pytest.raises(CheckFailed) as failed:
        ex.visible(MISTAKE_NS["typical"]["step_breakdown"])
    message = str(failed.value)
    assert "compute_ms should be" in message and "got" in message and "\n" not in message

    def stub(events):
        raise NotImplementedError

    with pytest.raises(CheckFailed, match="still raises NotImplementedError"):
        ex.visible(stub)


# --- the kit and the cells -----------------------------------------------------------------


def test_the_kit_files_hold_no_copy_of_the_reference():
    ref = integrity.fingerprints(kit._body(*_reference_node()))
    region = integrity.fingerprints(integrity.solution_region(answers.SOLUTION_CELL))
    for path in (ex.__file__, trace_jobs.__file__):
        prints = integrity.fingerprints(open(path).read())
        assert integrity.containment(ref, prints) < kit.LEAK_AT / 2, path
        assert integrity.containment(region, prints) < kit.LEAK_AT / 2, path


def _reference_node():
    import ast
    from pathlib import Path

    from ddp_lab.answers.lab08 import references_ex1

    text = Path(references_ex1.__file__).read_text()
    node = next(n for n in ast.parse(text).body if getattr(n, "name", "") == "step_breakdown")
    return text, node


def test_the_cells():
    ids = [c["id"] for c in CELLS]
    assert len(ids) == len(set(ids))
    assert all(i.startswith(("ex1_", "test_ex1_")) for i in ids)
    by_id = {c["id"]: c for c in CELLS}
    assert by_id["ex1_step_breakdown"]["source"] == answers.SOLUTION_CELL.strip("\n")
    meta = by_id["test_ex1_step_breakdown"]["metadata"]["nbgrader"]
    assert meta["points"] == 4 and meta["grade"]
    assert "checks.step_breakdown(step_breakdown)" in by_id["test_ex1_step_breakdown"]["source"]
    assert by_id["ex1_a_exposed"]["metadata"]["nbgrader"]["points"] == 2
    assert "if not checks.GRADING:" in by_id["ex1_demo_jobs"]["source"]
    assert "except NotImplementedError" in by_id["ex1_demo_jobs"]["source"]
    for m in answers.MISTAKES:
        assert m.source.startswith(answers.PRELUDE + answers.HEADER)
    assert answers.MISTAKES[0].name == "typical"


def _crash(code: int):
    """A LaunchFailed as torchrun reports a worker that died of signal ``-code``."""
    from ddp_lab.launch import LaunchFailed, LaunchResult

    agent = f"Root Cause (first observed failure):\n[0]:\n  rank      : 0\n  exitcode  : {code}\n"
    return LaunchFailed("a worker died", LaunchResult(1, {-1: agent}, None, 1.0, ["torchrun"]))


@pytest.mark.parametrize(
    "codes,launches,fails",
    [((-11,), 2, False), ((-6, -11), 3, False), ((-11, -11, -6), 3, True), ((1,), 1, True)],
)
def test_a_recording_killed_by_the_profiler_is_recorded_again(monkeypatch, codes, launches, fails):
    """jobs.launch runs a launch again when a worker died of SIGSEGV or SIGABRT (the
    profiler's rare crash in the grader's own jobs), twice at most; any other failure (an
    exit code) is raised at once."""
    import ddp_lab.launch
    from ddp_lab.checks.lab08 import jobs

    calls = []

    def fake_torchrun(target, args, **kwargs):
        calls.append(target)
        if len(calls) <= len(codes):
            raise _crash(codes[len(calls) - 1])
        specs = torch.load(Path(args[0]), weights_only=True)
        for rank in range(max(s["world_size"] for s in specs)):
            torch.save([[{"name": "x", "ph": "X"}]] * len(specs), Path(args[1]) / f"rank{rank}.pt")

    monkeypatch.setattr(ddp_lab.launch, "torchrun", fake_torchrun)
    monkeypatch.setattr(jobs, "_RECORDED", {})
    specs = [{"world_size": 2, "cap": 1.0, "slow": 0, "active": 1, "seed": len(codes)}]
    if fails:
        with pytest.raises(ddp_lab.launch.LaunchFailed):
            jobs.launch("ddp_lab.checks.lab08.trace_jobs", specs)
    else:
        assert jobs.launch("ddp_lab.checks.lab08.trace_jobs", specs)[0][0] == [
            {"name": "x", "ph": "X"}
        ]
    assert len(calls) == launches
