"""Lab 6 (checkpoints, elastic restarts, faults): its checks and the facts they rest on.

- the case sets cover every edge case in every draw (200 seeds, inputs only);
- over 100 seeds, the grader's full judges (kit oracle + ``HIDDEN``) accept the right
  outputs and reject the typical wrong ones: exercise 1 on real runs of the reference and of
  the mistakes (on a tmpfs), exercises 2 to 4 on outputs built without student processes
  (the uninterrupted run and its flawed twins, the rule's flawed twins, a per-rank replay
  of the script);
- the visible checks pass on the solutions, fail on a mistake with its message, and ask to
  finish a stub;
- direct facts: the one-process simulation equals real DDP runs bit for bit (the reference
  through the grader's path on 2 and 3 ranks), a twin without a flaw is the uninterrupted
  run, the buggy script submitted as the fix is stopped by the watchdog and leaves no
  process.

The real grader runs (full marks, zero, mistakes, cheat) are in ``test_grading.py`` and
``test_mistakes.py``.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
from pathlib import Path

import pytest
import torch
from _harness import (
    GradedLab,
    assert_verdicts,
    lab_notebook,
    new_leftovers,
    saved,
)

from ddp_lab.answers.lab06 import MISTAKES, MORE_MISTAKES
from ddp_lab.answers.lab06 import hidden as extra
from ddp_lab.answers.lab06 import references as ref
from ddp_lab.checks import lab06 as checks
from ddp_lab.checks.failure import CheckFailed
from ddp_lab.checks.lab06 import ex1_atomic_save as ex1
from ddp_lab.checks.lab06 import ex2_resume as ex2
from ddp_lab.checks.lab06 import hang_jobs, recipe
from ddp_lab.checks.runner import STUB, namespace, run_ranks, split_magics
from ddp_lab.grading import integrity

LAB = checks.LAB
#: Draws whose inputs are checked for every edge case (cheap: nothing is run).
SEEDS = range(200)
#: Draws fed to the judges (outputs built in this process, right and wrong).
PROPERTY_SEEDS = range(100)
#: Draws for the costlier wrong answers (the cheap ones run over all PROPERTY_SEEDS).
FEW = range(0, 100, 25)
GRADED = GradedLab(LAB)
SOURCES, EXERCISES = GRADED.sources, GRADED.exercises
_judge, _inputs, _saved = GRADED.judge, GRADED.inputs, saved
_mistake, _ns = GRADED.mistake, GRADED.mistake_ns
SHM = "/dev/shm" if os.path.isdir("/dev/shm") else None


# --- the case sets ---------------------------------------------------------------------------


def _check_resume_case(spec: dict, world: int) -> None:
    n, b, every, spe = len(spec["y"]), spec["batch_size"], spec["every"], spec["steps_per_epoch"]
    share = -(-n // world)
    assert n % world and share % b, "padding by DistributedSampler, a short last batch"
    assert -(-share // b) == spe and spe % every == 0 and spe > every
    total = recipe.EPOCHS * spe
    mid, at, early, end, twice = spec["scenarios"]
    c = mid[0] - mid[0] % every
    assert mid[0] % every and c % spe and c >= spe, "a few steps after a mid-epoch checkpoint"
    assert at[0] % every == 0 and at[0] % spe, "right after a mid-epoch checkpoint"
    assert early[0] < every, "before the first checkpoint"
    c = end[0] - end[0] % every
    assert c and c % spe == 0 and end[0] % every, "after an epoch-end checkpoint"
    assert len(twice) == 2 and 0 < twice[0] < twice[1] and twice[1] - twice[1] % every > 0
    assert all(s < total for sc in spec["scenarios"] for s in sc)


def _facts_of_rule(case: dict) -> set[str]:
    """Which edge cases a history holds, as the reference decides it."""
    h, drop = case["history"], case["drop"]
    plan = ref.rollback_plan(h, drop)
    facts, best = set(), None
    for i, (e, d) in enumerate(zip(h, plan, strict=True)):
        if best is not None:
            gap = best - e["accuracy"]
            facts |= {"tie"} if gap == 0 else set()
            facts |= {"equal"} if gap == drop and drop > 0 else set()
            if d["restore"] is not None and i and plan[i - 1]["restore"] is not None:
                facts.add("twice")
            if d["restore"] is not None and h[i - 1]["accuracy"] - e["accuracy"] <= drop:
                facts.add("slow")
            if d["restore"] is not None and d["restore"] != plan[0]["best"]:
                facts.add("new best")
        if d["restore"] is None and (best is None or e["accuracy"] > best):
            best = e["accuracy"]
    return facts


def test_every_draw_holds_every_edge_case():
    for seed in SEEDS:
        training, large = _inputs("test_ex1_atomic_save", seed)["cases"]
        extra_ = training["first"]["extra"]
        assert extra_[0].numel() == 0 and extra_[1].dim() == 0 and extra_[2].dtype == torch.bool
        for case in (training, large):
            first, second = case["first"], case["second"]
            assert 0 <= case["flip_at"] < 1
            assert [t.shape for t in ex1._tensors(first)] == [t.shape for t in ex1._tensors(second)]
        assert large["first"]["weights"].numel() >= 50_000

        specs = _inputs("test_ex2_resume", seed)["cases"]
        assert [s["world_size"] for s in specs] == [2, 3]
        assert [s["optimizer"]["name"] for s in specs] == ["sgd", "adam"]
        for spec in specs:
            _check_resume_case(spec, spec["world_size"])

        cases = _inputs("test_ex3_rollback", seed)["cases"]
        assert [c["drop"] for c in cases[:2]] == [5.0, 0.0]
        for c in cases[:2]:
            # at drop 0 any decrease rolls back: no slow decline, no drop equal to it but 0
            want = {"tie", "twice", "new best"} | ({"equal", "slow"} if c["drop"] else set())
            assert want <= _facts_of_rule(c), (seed, c["drop"], _facts_of_rule(c))
        assert len(cases[3]["history"]) == 1 and cases[4]["history"] == []
        for c in cases:
            steps = [e["step"] for e in c["history"]]
            assert steps == sorted(set(steps))
            assert all(4 * e["accuracy"] == int(4 * e["accuracy"]) for e in c["history"][:1])

        jobs = _inputs("test_ex5_fix_hang", seed)["cases"]
        assert [j["world_size"] for j in jobs] == [2, 3]
        for job in jobs:
            w = job["world_size"]
            extra_run, level, fewer, even = job["runs"]
            for run in job["runs"]:
                assert run["epochs"] >= 2
            shares = [len(range(r, len(extra_run["y"]), w)) for r in range(w)]
            b = extra_run["batch_size"]
            assert len({math.ceil(s / b) for s in shares}) == 2, "one rank needs a step more"
            shares = [len(range(r, len(level["y"]), w)) for r in range(w)]
            assert len(set(shares)) == 2 and len({math.ceil(s / b) for s in shares}) == 1
            assert len(fewer["y"]) < w
            assert len(even["y"]) % w == 0 and (len(even["y"]) // w) % b


# --- exercise 1: real runs of the reference and the mistakes --------------------------------


def _ex1_outputs(ns: dict, inputs: dict, where: str | None = SHM) -> dict:
    """Exercise 1's outputs from a real run (on a tmpfs by default: fsync costs nothing)."""
    with tempfile.TemporaryDirectory(dir=where) as tmp:
        return _saved(EXERCISES["test_ex1_atomic_save"].run(ns, inputs, Path(tmp)))


REF1 = {"save_checkpoint": ref.save_checkpoint, "load_checkpoint": ref.load_checkpoint}


def test_atomic_save_judge_accepts_the_reference_and_rejects_the_mistakes_every_draw():
    judge = _judge("test_ex1_atomic_save")
    typical = _ns("written_in_place")
    others = {
        m.name: _ns(m.name) for m in (*MISTAKES, *MORE_MISTAKES) if m.cell == "ex1_atomic_save"
    }
    for seed in PROPERTY_SEEDS:
        inputs = _inputs("test_ex1_atomic_save", seed)
        wrongs = {"written_in_place": _ex1_outputs(typical, inputs)}
        if seed in FEW:
            wrongs |= {name: _ex1_outputs(ns, inputs) for name, ns in others.items()}
        assert_verdicts(judge, seed, inputs, _ex1_outputs(REF1, inputs), wrongs)


@pytest.mark.parametrize(
    "mistake",
    [m for m in (*MISTAKES, *MORE_MISTAKES) if m.cell in ("ex1_atomic_save", "ex3_rollback")],
    ids=lambda m: m.name,
)
def test_in_process_mistakes_fail_with_their_reason(mistake):
    gid = f"test_{mistake.cell}"
    ns = namespace({mistake.cell: mistake.source}, [mistake.cell])
    for seed in range(2):
        inputs = _inputs(gid, seed)
        got = (
            _ex1_outputs(ns, inputs, where=None)  # next to tempfile's own temporary files
            if gid == "test_ex1_atomic_save"
            else _saved(EXERCISES[gid].run(ns, inputs, None))
        )
        with pytest.raises(CheckFailed, match=re.escape(mistake.reason)):
            _judge(gid)(inputs, got)


# --- exercise 2: outputs built from the uninterrupted run and its flawed twins -------------------


def _resume_outputs(spec: dict, want: dict, how: str = "right") -> list:
    """Every rank's outputs for every scenario, as a right (or wrong) ``train`` gives them.

    ``how``: ``"right"``; ``"scratch"`` (the resumed call starts over); ``"diverged"`` (rank 1
    did not load the model); or a twin's flaw (the final weights of that twin).
    """
    world, every = spec["world_size"], spec["every"]
    total = recipe.EPOCHS * spec["steps_per_epoch"]
    ranks = [[] for _ in range(world)]
    for stops in spec["scenarios"]:
        final = want
        if how not in ("right", "scratch", "diverged"):
            restarts = [c for c in recipe.checkpoint_steps(spec, stops) if c > 0]
            final = extra._Twin(spec, world, how).run(restarts)
        start, attempts = 0, []
        for stop in [*stops, None]:
            if stop is None:
                steps = total if how == "scratch" else total - start
            else:
                steps = stop - start
            reached = total if stop is None else stop
            attempts.append(
                {
                    "steps": steps,
                    "interrupted": stop is not None,
                    "propagated": stop is not None,
                    "files": [ex2.CKPT_NAME] if max(reached, start) >= every else [],
                    "final": final,
                    # rank 0 saves each checkpoint once; every rank meets in a barrier after it
                    "barriers": (start + steps) // every - start // every,
                }
            )
            if stop is not None:
                start = stop - stop % every
        for r in range(world):
            mine = [
                dict(a, files=a["files"] if r == 0 else [], saves=a["barriers"] if r == 0 else 0)
                for a in attempts
            ]
            if how == "diverged" and r == 1:
                mine[-1] = dict(mine[-1], final={k: v + 1e-3 for k, v in final.items()})
            ranks[r].append({"attempts": mine})
    return ranks


_ORACLES: dict = {}
_ORACLE = recipe.oracle


def _cached_oracle(spec: dict) -> dict:
    key = (spec["seed"], spec["world_size"], float(spec["x"].sum()))
    if key not in _ORACLES:
        _ORACLES[key] = _ORACLE(spec)
    return _ORACLES[key]


@pytest.fixture
def cached_oracle(monkeypatch):
    """The judge's oracle, computed once per case (the test builds its outputs from it)."""
    monkeypatch.setattr(ex2, "oracle", _cached_oracle)
    monkeypatch.setattr(recipe, "oracle", _cached_oracle)
    yield _cached_oracle
    _ORACLES.clear()


#: The twins the property test builds on a few draws, and what the verdict must say.
TWIN_REASONS = {flaw: why for flaw, why in extra._TWINS if flaw != "no_optimizer"}


def test_resume_judge_accepts_the_uninterrupted_run_and_rejects_the_mistakes_every_draw(
    cached_oracle,
):
    judge = _judge("test_ex2_resume")
    for seed in PROPERTY_SEEDS:
        inputs = _inputs("test_ex2_resume", seed)
        wants = [cached_oracle(spec) for spec in inputs["cases"]]

        def outputs(how, inputs=inputs, wants=wants):
            pairs = zip(inputs["cases"], wants, strict=True)
            return {"cases": [_resume_outputs(s, w, how) for s, w in pairs]}

        wrongs = {how: outputs(how) for how in ("scratch", "diverged")}
        if seed in FEW:
            wrongs |= {flaw: outputs(flaw) for flaw in TWIN_REASONS}
        assert_verdicts(judge, seed, inputs, outputs("right"), wrongs)
        if seed == 0:
            named = wrongs
    inputs = _inputs("test_ex2_resume", 0)
    with pytest.raises(CheckFailed, match="started from scratch"):
        judge(inputs, named["scratch"])
    with pytest.raises(CheckFailed, match="rank 1's final weights differ from rank 0's"):
        judge(inputs, named["diverged"])
    for flaw, why in TWIN_REASONS.items():
        with pytest.raises(CheckFailed, match=re.escape(why[:40])):
            judge(inputs, named[flaw])


def test_resume_judge_wants_rank_0_alone_writing_and_a_barrier_on_every_rank(cached_oracle):
    inputs = _inputs("test_ex2_resume", 0)
    spec = inputs["cases"][0]
    right = _resume_outputs(spec, cached_oracle(spec))
    stops = spec["scenarios"][0]
    assert ex2.problem(spec, stops, [r[0] for r in right], cached_oracle(spec)) is None
    both = [[{"attempts": [dict(a, saves=1) for a in r[0]["attempts"]]}] for r in right]
    want = cached_oracle(spec)
    assert "rank 0 alone writes" in ex2.problem(spec, stops, [r[0] for r in both], want)
    lone = [[{"attempts": [dict(a, barriers=0) for a in r[0]["attempts"]]}] for r in right]
    lone[0] = right[0]  # only rank 0 waits
    assert "every rank waits in a barrier" in ex2.problem(spec, stops, [r[0] for r in lone], want)


def test_a_twin_without_a_flaw_is_the_uninterrupted_run():
    """The diagnoses' emulated resume (fresh optimizer and schedule loaded from their state
    dicts, the epoch's iterator re-created and skipped, the generators restored) changes
    nothing: the simulation's restart machinery is sound."""
    for seed in (0, 1):
        for spec in _inputs("test_ex2_resume", seed)["cases"]:
            want = recipe.oracle(spec)
            for stops in spec["scenarios"]:
                restarts = [c for c in recipe.checkpoint_steps(spec, stops) if c > 0]
                got = extra._Twin(spec, spec["world_size"], "none").run(restarts)
                assert all(torch.equal(got[k], want[k]) for k in want), (seed, stops)


# --- exercise 3: the rule's properties against the reference and its flawed twins ----------------


def test_rollback_judge_accepts_the_reference_and_rejects_the_mistakes_every_draw():
    judge = _judge("test_ex3_rollback")
    gid = "test_ex3_rollback"
    mistakes = {
        m.name: _ns(m.name) for m in (*MISTAKES, *MORE_MISTAKES) if m.cell == "ex3_rollback"
    }
    for seed in PROPERTY_SEEDS:
        inputs = _inputs(gid, seed)
        right = _saved(EXERCISES[gid].run({"rollback_plan": ref.rollback_plan}, inputs, None))
        wrongs = {n: _saved(EXERCISES[gid].run(ns, inputs, None)) for n, ns in mistakes.items()}
        assert_verdicts(judge, seed, inputs, right, wrongs)


def test_rollback_properties_are_the_rule_on_hand_made_histories():
    def h(*accs):
        return [{"step": 10 * (i + 1), "accuracy": a} for i, a in enumerate(accs)]

    plan = ref.rollback_plan
    assert plan([], 5) == []
    assert plan(h(0.0), 0) == [{"restore": None, "best": 10, "discarded": 0}]
    assert [d["restore"] for d in plan(h(50, 45, 44.75), 5)] == [None, None, 10]
    assert [d["best"] for d in plan(h(50, 50, 40), 5)] == [10, 10, 10]
    assert [d["discarded"] for d in plan(h(50, 40, 40, 60, 40), 5)] == [0, 10, 10, 0, 10]
    assert [d["restore"] for d in plan(h(50, 49.75, 50), 0)] == [None, 10, None]
    for hist, drop in ((h(50, 45, 44.75), 5), (h(50, 40, 40, 60, 40), 5), (h(1, 1, 0.5), 0)):
        assert ex3_problem({"history": hist, "drop": drop}, plan(hist, drop)) is None


def ex3_problem(case, plan):
    from ddp_lab.checks.lab06.ex3_rollback import plan_problem

    return plan_problem(case, plan)


# --- exercise 4: a per-rank replay of the script ------------------------------------------------


def _replay(
    spec: dict,
    world: int,
    steps: str = "longest",
    worst: str = "global",
    grads: str = "global",
    who: str = "rank 0",
) -> list[dict]:
    """Every rank's (w, logs, printed lines) as the script computes them, its all-reduces
    done by hand; ``who`` keeps the records (``"all logs"``) or prints them
    (``"all print"``) on every rank instead of rank 0 alone."""
    x, y, b, n = spec["x"], spec["y"], spec["batch_size"], len(spec["y"])
    ws = [torch.zeros(x.shape[1], dtype=torch.float64) for _ in range(world)]
    logs = []
    for epoch in range(spec["epochs"]):
        order = torch.randperm(n, generator=torch.Generator().manual_seed(spec["seed"] + epoch))
        mine = [order[r::world] for r in range(world)]
        pick = max if steps == "longest" else min
        for k in range(math.ceil(pick(len(m) for m in mine) / b)):
            parts = []
            for r in range(world):
                idx = mine[r][k * b : (k + 1) * b]
                err = x[idx] @ ws[r] - y[idx]
                top = float(err.square().max()) if len(idx) else 0.0
                parts.append((2 * x[idx].T @ err, float(err.square().sum()), len(idx), top))
            grad = sum(p[0] for p in parts)
            count = sum(p[2] for p in parts)
            if (k + 1) % spec["log_every"] == 0:
                top = max(p[3] for p in parts) if worst == "global" else parts[0][3]
                logs.append([epoch, k, sum(p[1] for p in parts) / count, top])
            for r in range(world):
                if grads == "global":
                    ws[r] = ws[r] - spec["lr"] * grad / count
                elif parts[r][2]:
                    ws[r] = ws[r] - spec["lr"] * parts[r][0] / parts[r][2]
    lines = [f"epoch {e} step {k}: loss {loss:.4f}" for e, k, loss, _ in logs]
    return [
        {
            "w": ws[r],
            "logs": logs if r == 0 or who == "all logs" else [],
            "printed": lines if r == 0 or who == "all print" else [],
        }
        for r in range(world)
    ]


def _fix_outputs(inputs: dict, **how) -> dict:
    cases = []
    for job in inputs["cases"]:
        world = job["world_size"]
        per_run = [_replay(spec, world, **how) for spec in job["runs"]]
        cases.append([[run[r] for run in per_run] for r in range(world)])
    return _saved({"cases": cases})


FIX_WRONGS = {
    "shortest_shard": ({"steps": "shortest"}, "stopped at the shortest shard"),
    "logs_own_worst": ({"worst": "own"}, "rank 0 logged its own largest squared error"),
    "no_gradient_all_reduce": ({"grads": "local"}, "weights differ from one process's"),
    "every_rank_logs": ({"who": "all logs"}, "only rank 0 logs, the other ranks return"),
    "every_rank_prints": ({"who": "all print"}, "only rank 0 prints"),
}


def test_fix_judge_accepts_the_script_fixed_and_rejects_the_mistakes_every_draw():
    judge = _judge("test_ex5_fix_hang")
    for seed in PROPERTY_SEEDS:
        inputs = _inputs("test_ex5_fix_hang", seed)
        wrongs = {name: _fix_outputs(inputs, **how) for name, (how, _) in FIX_WRONGS.items()}
        assert_verdicts(judge, seed, inputs, _fix_outputs(inputs), wrongs)
        if seed == 0:
            named = wrongs
    inputs = _inputs("test_ex5_fix_hang", 0)
    for name, (_, reason) in FIX_WRONGS.items():
        with pytest.raises(CheckFailed, match=reason):
            judge(inputs, named[name])


# --- the notebook's solutions ----------------------------------------------------------------


def test_solution_files_are_the_references():
    for cell, name in (("ex2_resume", "resume.py"), ("ex5_fix_hang", "fixed_train.py")):
        assert SOURCES[cell].startswith(f"%%writefile {name}\n")
        ours = integrity.fingerprints(SOURCES[cell])
        assert integrity.similarity(ours, integrity.fingerprints(ref.FILES[name])) == 1.0


def test_solutions_pass_in_process():
    ns = namespace(SOURCES, ["ex1_atomic_save", "ex3_rollback"])
    for seed in range(2):
        inputs = _inputs("test_ex1_atomic_save", seed)
        _judge("test_ex1_atomic_save")(inputs, _ex1_outputs(ns, inputs))
        inputs = _inputs("test_ex3_rollback", seed)
        got = _saved(EXERCISES["test_ex3_rollback"].run(ns, inputs, None))
        _judge("test_ex3_rollback")(inputs, got)


def test_visible_checks_pass_the_solutions_and_name_a_mistake(capsys):
    ns = namespace(SOURCES, ["ex1_atomic_save", "ex3_rollback"])
    checks.atomic_save(ns["save_checkpoint"], ns["load_checkpoint"])
    checks.rollback_plan(ns["rollback_plan"])
    assert capsys.readouterr().out.count("OK: ") == 2
    bad = _ns("no_fsync")
    with pytest.raises(CheckFailed, match="no os.fsync"):
        checks.atomic_save(bad["save_checkpoint"], bad["load_checkpoint"])
    with pytest.raises(CheckFailed, match="restore step"):
        checks.rollback_plan(_ns("vs_previous")["rollback_plan"])

    def stub(*args, **kwargs):
        raise NotImplementedError()

    with pytest.raises(CheckFailed, match="finish this exercise first"):
        checks.atomic_save(stub, stub)
    with pytest.raises(CheckFailed, match="finish this exercise first"):
        checks.rollback_plan(stub)


def _write(folder: Path, source: str) -> Path:
    name, text = next(iter(split_magics(source)[1].items()))
    (folder / name).write_text(text)
    return folder / name


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_visible_distributed_checks_run_the_files_under_torchrun(tmp_path, capsys):
    checks.resume(str(_write(tmp_path, SOURCES["ex2_resume"])))
    checks.fixed_script(str(_write(tmp_path, SOURCES["ex5_fix_hang"])))
    assert capsys.readouterr().out.count("OK: ") == 2
    _write(tmp_path, _mistake("epoch_only").source)
    with pytest.raises(CheckFailed, match="position within the epoch"):
        checks.resume(str(tmp_path / "resume.py"))
    # right weights, but no rank waits for rank 0's file: the checker counts the barriers
    assert SOURCES["ex2_resume"].count("dist.barrier()\n") == 1
    _write(tmp_path, SOURCES["ex2_resume"].replace("dist.barrier()\n", "pass\n"))
    with pytest.raises(CheckFailed, match="every rank waits in a barrier"):
        checks.resume(str(tmp_path / "resume.py"))
    (tmp_path / "fixed_train.py").write_text(f"def train(*args, **kwargs):\n    {STUB}()\n")
    with pytest.raises(CheckFailed, match="finish this exercise first"):
        checks.fixed_script(str(tmp_path / "fixed_train.py"))


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    "gid,cell", [("test_ex2_resume", "ex2_resume"), ("test_ex5_fix_hang", "ex5_fix_hang")]
)
def test_the_references_pass_the_graders_runs_on_2_and_3_ranks(tmp_path, gid, cell):
    """The grader's path (every case of make_inputs under torchrun, the full judge): real DDP
    runs, interrupted and resumed, equal the judge's one-process simulation bit for bit."""
    _write(tmp_path, SOURCES[cell])
    work = tmp_path / "work"
    work.mkdir()
    inputs = _inputs(gid, 7)
    ex = EXERCISES[gid]
    outputs = _saved(run_ranks(ex, LAB, inputs, work, tmp_path, ex.timeout))
    assert "2 and 3 ranks" in _judge(gid)(inputs, outputs)


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    "name", [m.name for m in MORE_MISTAKES if m.cell == "ex5_fix_hang"] or ["none"]
)
def test_more_fix_mistakes_fail_on_the_graders_runs_with_their_reason(tmp_path, name):
    """The ex4 mistakes the grading rounds leave out, through the grader's path (every case
    of make_inputs under torchrun on 2 and 3 ranks, the full judge)."""
    if name == "none":
        pytest.skip("every ex4 mistake runs through the real grader")
    mistake = _mistake(name)
    _write(tmp_path, mistake.source)
    work = tmp_path / "work"
    work.mkdir()
    ex = EXERCISES["test_ex5_fix_hang"]
    inputs = _inputs("test_ex5_fix_hang", 3)
    outputs = _saved(run_ranks(ex, LAB, inputs, work, tmp_path, ex.timeout))
    with pytest.raises(CheckFailed, match=re.escape(mistake.reason)):
        _judge("test_ex5_fix_hang")(inputs, outputs)


def _hang_script() -> str:
    """The notebook's given (buggy) script, a plain code cell."""
    cell = next(c for c in lab_notebook(LAB)["cells"] if c["id"] == "hang_script")
    return "".join(cell["source"])


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_hanging_script_submitted_as_the_fix_is_stopped_and_leaves_no_process(tmp_path):
    source = _hang_script().replace("%%writefile hang_train.py", "%%writefile fixed_train.py")
    _write(tmp_path, source)
    ex = EXERCISES["test_ex5_fix_hang"]
    inputs = ex.visible_inputs(torch.Generator().manual_seed(0))
    work = tmp_path / "work"
    work.mkdir()
    before = set(os.listdir("/proc"))
    with pytest.raises(CheckFailed, match="fixed_train.py"):
        run_ranks(ex, LAB, inputs, work, tmp_path, timeout=90)
    assert not new_leftovers(before, str(tmp_path))


# --- exercise 4: real hanging jobs, their truth, the diagnosis ------------------------------


@pytest.fixture(scope="module")
def hang_draws():
    """Two grading draws of exercise 4 (each one torchrun launch of 3 ranks, seconds)."""
    return [_inputs("test_ex4_diagnose_hang", seed) for seed in (0, 1)]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_hang_draw_holds_every_cause_and_detail_agrees_with_the_truth(hang_draws):
    from ddp_lab.answers.lab06.hidden_diagnose import _own_seq
    from ddp_lab.checks.contract import SEALED

    for inputs in hang_draws:
        truths = inputs[SEALED]["truths"]
        seen = {
            (j["job"]["world_size"], t["cause"])
            for j, t in zip(inputs["jobs"], truths, strict=True)
        }
        assert seen == {(w, c) for w in (2, 3) for c in hang_jobs.CAUSES}
        for job, truth in zip(inputs["jobs"], truths, strict=True):
            assert sorted(job["logs"]) == list(range(job["job"]["world_size"]))
            assert all("Detected mismatch between collectives" in t for t in job["logs"].values())
            noticed = _own_seq(job, truth["rank"])
            if truth["cause"] in ("rank_only", "shape", "dtype"):
                # torch's own SequenceNumber is the position the construction says
                assert noticed == truth["collective"], (job["job"], truth)
            elif truth["cause"] == "uneven":
                assert noticed > truth["collective"], "DETAIL notices only later: the trap"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_diagnose_judge_accepts_the_solution_and_rejects_each_misreading(hang_draws):
    from ddp_lab.answers.lab06.mistakes_diagnose import DIAGNOSE_MISTAKES
    from ddp_lab.checks.contract import unsealed

    ex, judge = EXERCISES["test_ex4_diagnose_hang"], _judge("test_ex4_diagnose_hang")
    solution = namespace(SOURCES, ["ex4_diagnose_hang"])
    for inputs in hang_draws:
        assert "sealed" not in unsealed(inputs) and "sealed" in inputs
        judge(inputs, _saved(ex.run(solution, unsealed(inputs), None)))
        for m in DIAGNOSE_MISTAKES:
            if m.name == "reads_inputs":  # needs the grader's folder: test_mistakes.py runs it
                continue
            ns = namespace({m.cell: m.source}, [m.cell])
            with pytest.raises(CheckFailed, match=re.escape(m.reason)):
                judge(inputs, _saved(ex.run(ns, unsealed(inputs), None)))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_diagnose_visible_check_passes_the_solution_and_asks_to_finish_a_stub(capsys):
    checks.diagnose_hang(namespace(SOURCES, ["ex4_diagnose_hang"])["diagnose_hang"])
    assert "OK: diagnose_hang named" in capsys.readouterr().out

    def stub(logs, job):
        raise NotImplementedError()

    with pytest.raises(CheckFailed, match="finish this exercise first"):
        checks.diagnose_hang(stub)
