"""Lab 5 (mixed precision, accumulation, clipping): its checks and the facts they rest on.

- the case sets cover every edge case in every draw (200 seeds, inputs only);
- over 100 seeds, the judges (kit oracle + the grader's hidden part) accept the right
  outputs and reject each typical wrong one, built without running student processes; the
  references and the notebook's solutions pass them on real runs (a few seeds);
- the visible checks pass on the solutions and fail on a mistake with its message;
- direct facts: clipping after ``unscale_`` equals float32 clipping while clipping before
  does not; float16 with ``GradScaler`` on the CPU skips a forced inf step and halves the
  scale; accumulation with ``no_sync`` equals the big batch to 1e-6 (float64) with one
  all-reduce per optimizer step; a deadlocking ``grad_norm.py`` is stopped, nothing survives;
- exercise 4 on real 3-rank runs: the reference over 30 draws and the notebook's solution
  pass (no float16 overflow where none was put, the float32 oracle within its tolerance),
  and every typical wrong step fails with its reason.

The real grader runs (full marks, zero, mistakes, cheat) are in ``test_grading.py`` and
``test_mistakes.py``.
"""

from __future__ import annotations

import copy
import gc
import math
import os
import re

import pytest
import torch
import torch.nn.functional as F
from _harness import GradedLab, assert_verdicts, new_leftovers, saved, spawn_gloo

from ddp_lab.answers.lab05 import MISTAKES, MORE_MISTAKES
from ddp_lab.answers.lab05 import references as ref
from ddp_lab.checks import lab05 as checks
from ddp_lab.checks.failure import CheckFailed
from ddp_lab.checks.lab05 import ex1_fp16_report as ex1
from ddp_lab.checks.lab05 import ex2_loss_scaler as ex2
from ddp_lab.checks.lab05 import ex3_accumulation as ex3
from ddp_lab.checks.lab05 import ex4_ddp_step as ex4
from ddp_lab.checks.lab05 import ex5_global_grad_norm as ex5
from ddp_lab.checks.lab05.common import net, random_state, state
from ddp_lab.checks.runner import STUB, namespace, run_ranks

LAB = checks.LAB
#: Draws whose inputs are checked for every edge case (cheap: nothing is run).
SEEDS = range(200)
#: Draws fed to the judges (outputs built in this process, right and wrong).
PROPERTY_SEEDS = range(100)
#: Draws for the costlier wrong answers (the typical one runs over all PROPERTY_SEEDS).
FEW = range(0, 100, 10)
GRADED = GradedLab(LAB)
SOURCES, EXERCISES = GRADED.sources, GRADED.exercises
_judge, _inputs, _saved = GRADED.judge, GRADED.inputs, saved
_mistake_ns = GRADED.mistake_ns


# --- the case sets ---------------------------------------------------------------------------


def _assert_step_edges(inputs: dict) -> None:
    """Exercise 4's draw: 2 and 3 ranks in one job of 3, accumulate 1 and > 2 on each,
    clipping active at the first step in one run of each, one overflow per run, float32."""
    (case,) = inputs["cases"]
    assert case["world_size"] == 3
    runs = case["runs"]
    assert [r["ranks"] for r in runs] == [2, 2, 3, 3], "the group's runs first"
    for world in (2, 3):
        mine = [r for r in runs if r["ranks"] == world]
        assert [r["accumulate"] for r in mine][0] == 1 and mine[1]["accumulate"] > 2
        clipped = [ex4.fp32_step(r["init"], r, 0)[1] > r["max_norm"] for r in mine]
        assert sorted(clipped) == [False, True]
    for r in runs:
        k, steps = r["accumulate"], ex4.steps_of(r)
        assert steps >= 2 and all(t.dtype == torch.float32 for t in r["init"].values())
        o = r["overflow"]
        assert 0 < o["step"] < steps, "a good step before the overflow"
        assert k == 1 or o["micro_batch"] % k < k - 1, "the inf enters under no_sync"
        for rank in range(r["ranks"]):
            for j, x in enumerate(r["xs"][rank]):
                inf = bool(torch.isinf(x.half()).any())
                assert inf == (rank == o["rank"] and j == o["micro_batch"])
        assert 2.0**6 <= r["init_scale"] * 2 ** (steps - 1) <= 2.0**11, "no overflow by luck"


def test_every_draw_holds_every_edge_case():
    for seed in SEEDS:
        gen = torch.Generator().manual_seed(seed)
        backward, large, edges, tiny = ex1.make_inputs(gen)["cases"]
        flat = torch.cat([g.reshape(-1) for g in backward])
        assert (flat == 0).any() and any(not g.any() for g in backward), "zeros: ReLU, a layer"
        assert 0.05 < ex1.oracle(backward)["underflow"] < 0.95
        assert ex1.oracle(large)["max_scale"] < 1
        top = max(float(g.abs().max()) for g in edges) * ex1.oracle(edges)["max_scale"]
        assert 65504 < top < 65520, "the largest entry lands between finfo.max and inf"
        assert 0 < ex1.oracle(edges)["bf16_underflow"] < ex1.oracle(edges)["underflow"]
        tiny_flat = torch.cat([g.reshape(-1) for g in tiny])
        assert float(tiny_flat.abs().max()) < 65520 * 2.0**-128, "2**128 is inf in float32"
        assert ex1.oracle(tiny)["max_scale"] > 2.0**127
        assert (tiny_flat.abs() < torch.finfo(torch.float32).smallest_normal).any()
        assert 0 < ex1.oracle(tiny)["bf16_underflow"] < 1, "float32 values that bf16 loses"

        first, second = _inputs("test_ex2_loss_scaler", seed)["cases"]
        assert first["scaler"]["growth_interval"] == 1
        assert {1, 2} & set(first["events"]) and 3 in first["events"]
        i = first["events"].index(next(e for e in first["events"] if e))
        assert first["events"][i + 1] != 0, "two overflows in a row"
        gi = second["scaler"]["growth_interval"]
        assert gi > 1
        for case in (first, second):  # never GradScaler's defaults, always exact
            growth, backoff = case["scaler"]["growth_factor"], case["scaler"]["backoff_factor"]
            assert growth in (4.0, 8.0) and backoff in (0.25, 0.125)
        overflow = next(j for j, e in enumerate(second["events"]) if e)
        assert gi < overflow < 2 * gi, "a growth first, then an overflow mid-interval"
        assert 3 in second["events"] and second["events"][-gi:] == [0] * gi
        for case in (first, second):
            assert any(case["events"][j] for j in case["explicit_unscale"])

        runs = _inputs("test_ex3_accumulation", seed)["cases"][0]["runs"]
        assert sorted({r["ranks"] for r in runs}) == [2, 3]
        for ranks in (2, 3):
            mine = [r for r in runs if r["ranks"] == ranks]
            n = [len(r["xs"][0]) for r in mine]
            assert mine[0]["k"] == 1 and n[1] % mine[1]["k"] != 0 and mine[2]["k"] > n[2]
            assert n[3] == 1 and mine[3]["k"] > 1, "one micro-batch per rank"

        _assert_step_edges(_inputs("test_ex4_ddp_step", seed))

        worlds = _inputs("test_ex5_global_grad_norm", seed)["cases"]
        assert [c["world_size"] for c in worlds] == [3]
        subs = [s for c in worlds for s in c["subs"]]
        assert [s["ranks"] for s in subs] == [3, 3, 3, 2, 2, 2], "the group's calls come last"
        assert {s["dtype"] for s in subs} == {"float32", "float64"}
        assert {s["norm"] for s in subs} == {"2", "inf"}
        assert any(not shard for s in subs for shard in s["shards"]), "a rank holds nothing"
        tiny = subs[3]
        assert tiny["dtype"] == "float32" and tiny["norm"] == "2"
        want = ex5.oracle(tiny)
        f32 = _float32_norm(tiny)
        assert abs(f32 - want) > 100 * ex5.RTOL[torch.float32] * want, "float32 visibly wrong"
        for s in subs:
            if s["norm"] == "inf":
                flat = torch.cat([g.reshape(-1) for sh in s["shards"] for g in sh])
                assert flat[flat.abs().argmax()] < 0, "the largest magnitude is negative"


# --- judges over 100 draws (outputs built without student processes) ------------------------


def test_report_judge_accepts_the_reference_and_rejects_the_mistakes_every_draw():
    judge = _judge("test_ex1_fp16_report")
    gid = "test_ex1_fp16_report"
    mistakes = {m.name: _mistake_ns(m.name) for m in MISTAKES if m.cell == "ex1_fp16_report"}
    for seed in PROPERTY_SEEDS:
        inputs = _inputs(gid, seed)
        right = _saved(EXERCISES[gid].run({"fp16_report": ref.fp16_report}, inputs, None))
        wrongs = {n: _saved(EXERCISES[gid].run(ns, inputs, None)) for n, ns in mistakes.items()}
        assert_verdicts(judge, seed, inputs, right, wrongs)


def _oracle_run(case: dict) -> dict:
    return ex2.oracle(case)


@pytest.mark.slow
def test_scaler_judge_rejects_every_broken_scaler_with_its_reason():
    judge = _judge("test_ex2_loss_scaler")
    for seed in range(3):
        inputs = _inputs("test_ex2_loss_scaler", seed)
        right = _saved({"runs": [_oracle_run(c) for c in inputs["cases"]]})
        assert "bit for bit" in judge(inputs, right)
        for m in (m for m in MISTAKES if m.cell == "ex2_loss_scaler"):
            ns = namespace({m.cell: m.source}, [m.cell])
            got = _saved(EXERCISES["test_ex2_loss_scaler"].run(ns, inputs, None))
            with pytest.raises(CheckFailed, match=m.reason):
                judge(inputs, got)


def _accum_outputs(
    inputs: dict, factor=None, counts=None, drift: float = 0.0, returned=len
) -> dict:
    """Every rank's outputs as a right (or wrong) run would give them."""
    case = inputs["cases"][0]
    ranks = []
    for r in range(case["world_size"]):
        out = []
        for spec in case["runs"]:
            if r >= spec["ranks"]:
                out.append(None)
                continue
            steps = ex3.big_batch_steps(spec, factor(spec) if factor else None)
            if drift and r == 1:
                steps = [{k: v + drift for k, v in s.items()} for s in steps]
            sizes = [len(g) for g in ex3.groups(len(spec["xs"][0]), spec["k"])]
            out.append(
                {
                    "allreduces": counts(sizes) if counts else [1] * len(sizes),
                    "returned": returned(sizes),
                    "after_last_step": 0,
                    "weights": steps,
                    "buckets": 1,
                }
            )
        ranks.append(out)
    return {"cases": [ranks]}


def test_accumulation_judge_accepts_the_big_batch_and_rejects_the_mistakes_every_draw():
    judge = _judge("test_ex3_accumulation")
    for seed in PROPERTY_SEEDS:
        inputs = _inputs("test_ex3_accumulation", seed)

        def sizes_of(spec):
            return [len(g) for g in ex3.groups(len(spec["xs"][0]), spec["k"])]

        wrongs = {"no_no_sync": _accum_outputs(inputs, counts=lambda sizes: sizes)}
        if seed in FEW:
            wrongs |= {
                "loss_not_divided": _accum_outputs(inputs, lambda s: lambda g: sizes_of(s)[g]),
                "tail_divided_by_k": _accum_outputs(
                    inputs, lambda s: lambda g: sizes_of(s)[g] / s["k"]
                ),
                "syncs_the_first": _accum_outputs(inputs, drift=1e-3),
                "returns_floor_division": _accum_outputs(
                    inputs, returned=lambda sizes: sum(sizes) // max(sizes)
                ),
                "returns_nothing": _accum_outputs(inputs, returned=lambda sizes: "a NoneType"),
            }
        assert_verdicts(judge, seed, inputs, _accum_outputs(inputs), wrongs)
        if seed == 0:
            named = wrongs
    inputs, wrongs = _inputs("test_ex3_accumulation", 0), named
    with pytest.raises(CheckFailed, match="under ddp_model.no_sync"):
        judge(inputs, wrongs["no_no_sync"])
    with pytest.raises(CheckFailed, match="is not divided by the number of micro-batches"):
        judge(inputs, wrongs["loss_not_divided"])
    with pytest.raises(CheckFailed, match="was divided by k"):
        judge(inputs, wrongs["tail_divided_by_k"])
    for name in ("returns_floor_division", "returns_nothing"):
        with pytest.raises(CheckFailed, match="the number of optimizer steps taken"):
            judge(inputs, wrongs[name])


def _step_outputs(inputs: dict, mistake: str | None = None) -> dict:
    """Every rank's outputs as a right (float32) or wrong train_steps would leave them."""
    (case,) = inputs["cases"]
    ranks = [[] for _ in range(case["world_size"])]
    for spec in case["runs"]:
        scales = ex4.expected_scales(spec)
        used, k = [spec["init_scale"], *scales], spec["accumulate"]
        before, updates, norms = spec["init"], [], []
        for s in range(ex4.steps_of(spec)):
            if s == spec["overflow"]["step"]:
                after, norm = before, math.nan
                if mistake == "skips_without_update":
                    norms.append(math.inf)
                    continue
            else:
                after, norm = ex4.fp32_step(before, spec, s)
                factor = {"clip_before_unscale": used[s], "loss_not_divided": k}.get(mistake, 1)
                if factor != 1:  # the gradient times factor, clipped at max_norm
                    clipped = ex4.fp32_step(before, spec, s, spec["max_norm"] / factor)[0]
                    if mistake == "clip_before_unscale":  # clipped, then divided by S
                        factor = 1
                    after = {w: before[w] + factor * (clipped[w] - before[w]) for w in before}
                    norm *= used[s] if mistake == "clip_before_unscale" else k
            count = k if mistake == "no_no_sync" else 1
            updates.append({"allreduces": count, "scale": scales[s], "weights": after})
            norms.append(norm)
            before = after
        out = {"norms": norms, "updates": updates, "after_last": 0, "buckets": 1}
        for r in range(case["world_size"]):
            ranks[r].append(out if r < spec["ranks"] else None)
    return _saved({"cases": [ranks]})


STEP_WRONGS = {
    "clip_before_unscale": "clipped the scaled gradients",
    "no_no_sync": "under ddp_model.no_sync()",
    "loss_not_divided": "not divided by accumulate",
    "skips_without_update": "skipped steps included",
}


def test_step_judge_accepts_the_float32_big_batch_and_rejects_the_mistakes_every_draw():
    judge = _judge("test_ex4_ddp_step")
    for seed in PROPERTY_SEEDS:
        inputs = _inputs("test_ex4_ddp_step", seed)
        names = list(STEP_WRONGS) if seed in FEW else list(STEP_WRONGS)[:2]
        wrongs = {name: _step_outputs(inputs, name) for name in names}
        assert_verdicts(judge, seed, inputs, _step_outputs(inputs), wrongs)
        if seed == 0:
            named = wrongs
    inputs = _inputs("test_ex4_ddp_step", 0)
    for name, reason in STEP_WRONGS.items():
        with pytest.raises(CheckFailed, match=re.escape(reason)):
            judge(inputs, named[name])


def _float32_norm(sub: dict) -> float:
    """The L2 norm as float32 arithmetic gives it: squares summed in float32 on each rank,
    then over the ranks."""
    total = torch.zeros((), dtype=torch.float32)
    for shard in sub["shards"]:
        for g in shard:
            total = total + (g.float() ** 2).sum()
    return float(total.sqrt())


def _norm_outputs(inputs: dict, how: str = "right") -> dict:
    cases = []
    for case in inputs["cases"]:
        ranks = [[] for _ in range(case["world_size"])]
        for sub in case["subs"]:
            for r in range(sub["ranks"], case["world_size"]):
                ranks[r].append(None)  # outside the group
            p = ex5.NORMS[sub["norm"]]
            local = []
            for shard in sub["shards"]:
                flat = [g.reshape(-1).double() for g in shard]
                v = torch.cat(flat) if flat else torch.zeros(0, dtype=torch.float64)
                local.append(float(torch.linalg.vector_norm(v, p)) if v.numel() else 0.0)
            value = {
                "right": [ex5.oracle(sub)] * len(local),
                "local_only": local,
                "sums_norms": [sum(local)] * len(local),
                "inf_norm_summed": [sum(local) if p == math.inf else ex5.oracle(sub)] * len(local),
                "mean_of_squares": [
                    math.sqrt(sum(v * v for v in local) / len(local)) if p == 2 else ex5.oracle(sub)
                ]
                * len(local),
                "squares_in_float32": [
                    _float32_norm(sub) if p == 2 and sub["dtype"] == "float32" else ex5.oracle(sub)
                ]
                * len(local),
                "returns_a_float": [ex5.oracle(sub)] * len(local),
                "returns_float32": [ex5.oracle(sub)] * len(local),
            }[how]
            dtype = torch.float32 if how == "returns_float32" else torch.float64
            for r, v in enumerate(value):
                ranks[r].append(v if how == "returns_a_float" else torch.tensor(v, dtype=dtype))
        cases.append(ranks)
    return {"cases": cases}


def test_norm_judge_accepts_the_global_norm_and_rejects_the_mistakes_every_draw():
    judge = _judge("test_ex5_global_grad_norm")
    names = (
        "local_only",
        "sums_norms",
        "inf_norm_summed",
        "mean_of_squares",
        "squares_in_float32",
        "returns_a_float",
        "returns_float32",
    )
    for seed in PROPERTY_SEEDS:
        inputs = _inputs("test_ex5_global_grad_norm", seed)
        wrongs = {n: _norm_outputs(inputs, n) for n in names}
        assert_verdicts(judge, seed, inputs, _norm_outputs(inputs), wrongs)
    for name, reason in zip(
        names,
        (
            "the norm of its own gradients",
            "summed the ranks' norms",
            "summed the ranks' largest",
            "averaged the sums of squares",
            "accumulated in float32",
            "promises a 0-d float64 tensor",
            "promises a 0-d float64 tensor",
        ),
        strict=True,
    ):
        with pytest.raises(CheckFailed, match=reason):
            judge(inputs, wrongs[name])


@pytest.mark.parametrize(
    "mistake",
    [m for m in MORE_MISTAKES if m.cell in ("ex1_fp16_report", "ex2_loss_scaler")],
    ids=lambda m: m.name,
)
def test_more_mistakes_fail_their_exercise_with_their_reason(mistake):
    """The mistakes beyond the grader's rounds, on the grader's run and full judge."""
    gid = f"test_{mistake.cell}"
    ns = namespace({mistake.cell: mistake.source}, [mistake.cell])
    for seed in range(2):
        inputs = _inputs(gid, seed)
        with pytest.raises(CheckFailed, match=mistake.reason):
            _judge(gid)(inputs, _saved(EXERCISES[gid].run(ns, inputs, None)))


# --- the references and the notebook's solutions on real runs -------------------------------


@pytest.mark.parametrize("gid,name", [("test_ex1_fp16_report", "fp16_report")])
def test_references_and_solutions_pass_in_process(gid, name):
    cell = gid.removeprefix("test_")
    solution = namespace(SOURCES, [cell])
    for seed in range(3):
        inputs = _inputs(gid, seed)
        for fn in (getattr(ref, name), solution[name]):
            _judge(gid)(inputs, _saved(EXERCISES[gid].run({name: fn}, inputs, None)))


def test_scaler_solution_equals_grad_scaler_bit_for_bit():
    cls = namespace(SOURCES, ["ex2_loss_scaler"])["LossScaler"]
    inputs = _inputs("test_ex2_loss_scaler", 0)
    got = _saved(EXERCISES["test_ex2_loss_scaler"].run({"LossScaler": cls}, inputs, None))
    assert "bit for bit" in _judge("test_ex2_loss_scaler")(inputs, got)


def test_solution_files_are_the_references():
    for cell, name in (
        ("ex3_accumulation", "accum.py"),
        ("ex4_ddp_step", "ddp_step.py"),
        ("ex5_global_grad_norm", "grad_norm.py"),
    ):
        assert SOURCES[cell].startswith(f"%%writefile {name}\n")
        assert name in ref.FILES


# --- visible checks ---------------------------------------------------------------------------


def test_visible_checks_pass_the_solutions_and_name_a_mistake(capsys):
    ns = namespace(SOURCES, ["ex1_fp16_report", "ex2_loss_scaler"])
    checks.fp16_report(ns["fp16_report"])
    checks.loss_scaler(ns["LossScaler"])
    assert capsys.readouterr().out.count("OK: ") == 2
    with pytest.raises(CheckFailed, match="max_scale should be"):
        checks.fp16_report(_mistake_ns("scale_from_finfo_max")["fp16_report"])
    with pytest.raises(CheckFailed, match="skip optimizer.step"):
        checks.loss_scaler(_mistake_ns("never_skips")["LossScaler"])
    with pytest.raises(CheckFailed, match="finish this exercise first"):
        checks.fp16_report(lambda grads: (_ for _ in ()).throw(NotImplementedError()))


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_visible_distributed_checks_run_the_files_under_torchrun(tmp_path, capsys):
    for cell, name in (
        ("ex3_accumulation", "accum.py"),
        ("ex4_ddp_step", "ddp_step.py"),
        ("ex5_global_grad_norm", "grad_norm.py"),
    ):
        (tmp_path / name).write_text(SOURCES[cell].split("\n", 1)[1])
    checks.accumulation(str(tmp_path / "accum.py"))
    checks.ddp_step(str(tmp_path / "ddp_step.py"))
    checks.global_grad_norm(str(tmp_path / "grad_norm.py"))
    assert capsys.readouterr().out.count("OK: ") == 3
    clip_first = next(m for m in MISTAKES if m.name == "clip_before_unscale")
    (tmp_path / "ddp_step.py").write_text(clip_first.source.split("\n", 1)[1])
    with pytest.raises(CheckFailed, match="times the float32 step"):
        checks.ddp_step(str(tmp_path / "ddp_step.py"))
    bad = next(m for m in MISTAKES if m.name == "no_no_sync")
    (tmp_path / "accum.py").write_text(bad.source.split("\n", 1)[1])
    with pytest.raises(CheckFailed, match="all-reduces, expected 1"):
        checks.accumulation(str(tmp_path / "accum.py"))
    (tmp_path / "grad_norm.py").write_text(
        f"def global_grad_norm(g, n=2.0, group=None):\n    {STUB}()\n"
    )
    with pytest.raises(CheckFailed, match="finish this exercise first"):
        checks.global_grad_norm(str(tmp_path / "grad_norm.py"))


# --- direct facts -----------------------------------------------------------------------------


def _clip_step(order: str, scale: float = 2.0**16, max_norm: float = 0.05):
    torch.manual_seed(0)
    model = net(random_state((12, 16, 4), torch.Generator().manual_seed(3)))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x, y = torch.randn(16, 12, generator=torch.Generator().manual_seed(4)), torch.arange(16) % 4
    scaler = torch.amp.GradScaler("cpu", init_scale=scale, enabled=order != "fp32")
    with torch.autocast("cpu", dtype=torch.float16, enabled=order != "fp32"):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    if order == "before":
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        scaler.unscale_(opt)
    else:
        scaler.unscale_(opt)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(opt)
    return float(norm), state(model)


def test_clipping_after_unscale_equals_fp32_clipping_and_before_does_not():
    norm32, w32 = _clip_step("fp32")
    start = state(net(random_state((12, 16, 4), torch.Generator().manual_seed(3))))
    d32 = ex4.flat_delta(w32, start)
    assert norm32 > 0.05, "the true norm must exceed max_norm: clipping matters"
    norm_after, w_after = _clip_step("after")
    norm_before, w_before = _clip_step("before")
    off = float((ex4.flat_delta(w_after, start) - d32).norm() / d32.norm())
    assert off < 1e-2 and abs(norm_after - norm32) < 1e-2 * norm32
    assert float(ex4.flat_delta(w_before, start).norm() / d32.norm()) < 1e-3
    assert norm_before == pytest.approx(norm32 * 2**16, rel=1e-2)


def test_fp16_scaler_on_the_cpu_skips_a_forced_inf_step_and_halves_the_scale():
    model = net(random_state((6, 8, 3), torch.Generator().manual_seed(0)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    x, y = torch.randn(4, 6), torch.tensor([0, 1, 2, 0])
    before = copy.deepcopy(state(model))
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    model.hidden.weight.grad[0, 0] = math.inf
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0**9
    assert all(torch.equal(before[k], v) for k, v in state(model).items())
    mine = ref.LossScaler(init_scale=2.0**10)  # the reference does the same
    scaled = mine.scale(F.cross_entropy(model(x), y))
    scaled.backward()
    model.hidden.weight.grad[0, 0] = math.nan
    mine.step(opt)
    mine.update()
    assert mine.get_scale() == 2.0**9
    assert all(torch.equal(before[k], v) for k, v in state(model).items())


def _accumulation_worker(rank: int, world: int, tmp: str) -> None:
    import torch.distributed as dist

    torch.manual_seed(0)
    spec = ex3._run_spec(torch.Generator().manual_seed(11), world, 7, 3)  # groups 3, 3, 1
    out = ex3._one_run(ref.train_accumulated, spec, rank, None)
    want = ex3.big_batch_steps(spec)
    diffs = [
        max((out["weights"][s][k] - want[s][k]).abs().max().item() for k in want[s])
        for s in range(len(want))
    ]
    torch.save(
        {"diffs": diffs, "allreduces": out["allreduces"], "buckets": out["buckets"]},
        os.path.join(tmp, f"rank{rank}.pt"),
    )
    gc.collect()  # the DDP wrapper goes before the group does
    dist.barrier()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_accumulation_equals_the_big_batch_with_one_allreduce_per_step(tmp_path):
    spawn_gloo(_accumulation_worker, 2, str(tmp_path))
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert got["buckets"] == 1
        assert got["allreduces"] == [1, 1, 1], "one all-reduce per optimizer step"
        assert max(got["diffs"]) < 1e-6, got["diffs"]


def _accumulation_mistake_worker(rank: int, world: int, tmp: str, source: str) -> None:
    import torch.distributed as dist

    ns: dict = {}
    exec(source.split("\n", 1)[1], ns)  # the cell without its %%writefile line
    spec = ex3._run_spec(torch.Generator().manual_seed(11), world, 7, 3)  # groups 3, 3, 1
    out = ex3._one_run(ns["train_accumulated"], spec, rank, None)
    torch.save(out, os.path.join(tmp, f"rank{rank}.pt"))
    gc.collect()
    dist.barrier()


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "mistake", [m for m in MORE_MISTAKES if m.cell == "ex3_accumulation"], ids=lambda m: m.name
)
def test_more_accumulation_mistakes_fail_with_their_reason_on_two_ranks(tmp_path, mistake):
    """The accumulation mistakes beyond the grader's rounds (a forward pass outside
    ``no_sync``, the first micro-batch synchronised), really run on 2 ranks and judged."""
    spawn_gloo(_accumulation_mistake_worker, 2, str(tmp_path), mistake.source)
    outs = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    spec = ex3._run_spec(torch.Generator().manual_seed(11), 2, 7, 3)
    why = ex3.problem(spec, 2, outs)
    assert why is not None and mistake.reason in why, why


def _step_worker(rank: int, world: int, tmp: str, jobs: list) -> None:
    """Exercise 4's runs of every job ``(label, cell source or None, seeds)`` on this rank,
    through the checker's own per-run code (the 2-rank runs over a group of ranks 0, 1)."""
    import torch.distributed as dist

    pair = dist.new_group([0, 1])
    out = {}
    for label, source, seeds in jobs:
        ns: dict = {}
        if source is not None:
            exec(source.split("\n", 1)[1], ns)  # the cell without its %%writefile line
        fn = ns.get("train_steps", ref.train_steps)
        for seed in seeds:
            runs = ex4.make_inputs(torch.Generator().manual_seed(seed))["cases"][0]["runs"]
            out[f"{label}/{seed}"] = [
                ex4._one_run(fn, spec, rank, pair if spec["ranks"] == 2 else None)
                if rank < spec["ranks"]
                else None
                for spec in runs
            ]
    torch.save(out, os.path.join(tmp, f"rank{rank}.pt"))
    gc.collect()  # the DDP wrappers go before the groups do
    dist.barrier()


_STEP_MISTAKES = [m for m in (*MISTAKES, *MORE_MISTAKES) if m.cell == "ex4_ddp_step"]
_STEP_JOBS = [
    ("reference", None, range(30)),
    ("solution", SOURCES["ex4_ddp_step"], range(30, 33)),
    *((m.name, m.source, range(2)) for m in _STEP_MISTAKES),
]


@pytest.fixture(scope="module")
def step_runs(tmp_path_factory) -> dict:
    """One 3-rank job: the reference over 30 draws, the notebook's solution over 3, every
    typical wrong step over 2 (about a minute on 2 cores)."""
    tmp = tmp_path_factory.mktemp("ddp_step")
    spawn_gloo(_step_worker, 3, str(tmp), _STEP_JOBS, timeout=600)
    ranks = [torch.load(tmp / f"rank{r}.pt", weights_only=True) for r in range(3)]
    return {key: {"cases": [[ranks[r][key] for r in range(3)]]} for key in ranks[0]}


@pytest.mark.slow
@pytest.mark.timeout(700)
def test_the_reference_and_the_solution_step_equal_the_big_batch_on_real_runs(step_runs):
    """Real float16 runs: no right step overflows where no inf was put, the float32 oracle
    is within the tolerance, the injected overflow is skipped on every rank."""
    judge = _judge("test_ex4_ddp_step")
    for label, seeds in (("reference", range(30)), ("solution", range(30, 33))):
        for seed in seeds:
            inputs = _inputs("test_ex4_ddp_step", seed)
            try:
                judge(inputs, step_runs[f"{label}/{seed}"])
            except CheckFailed as err:
                pytest.fail(f"{label}, seed {seed}: {err}")


@pytest.mark.slow
@pytest.mark.timeout(700)
@pytest.mark.parametrize("mistake", _STEP_MISTAKES, ids=lambda m: m.name)
def test_step_mistakes_fail_with_their_reason_on_real_runs(step_runs, mistake):
    for seed in range(2):
        inputs = _inputs("test_ex4_ddp_step", seed)
        with pytest.raises(CheckFailed, match=re.escape(mistake.reason)):
            _judge("test_ex4_ddp_step")(inputs, step_runs[f"{mistake.name}/{seed}"])


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_deadlocking_norm_is_stopped_and_leaves_no_process(tmp_path):
    (tmp_path / "grad_norm.py").write_text(
        "import torch, torch.distributed as dist\n\n\n"
        "def global_grad_norm(local_grads, norm_type=2.0, group=None):\n"
        "    t = torch.zeros((), dtype=torch.float64)\n"
        "    nxt = (dist.get_rank() + 1) % dist.get_world_size()\n"
        "    dist.recv(t, src=nxt)  # every rank waits for the next one: nobody sends\n"
        "    return t\n"
    )
    before = set(os.listdir("/proc"))
    ex = EXERCISES["test_ex5_global_grad_norm"]
    inputs = ex.visible_inputs(torch.Generator().manual_seed(0))
    work = tmp_path / "work"
    work.mkdir()
    with pytest.raises(CheckFailed, match="did not finish within"):
        run_ranks(ex, LAB, inputs, work, tmp_path, timeout=25)
    assert not new_leftovers(before, str(tmp_path))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_norm_that_ignores_the_group_is_stopped_with_the_reason(tmp_path):
    bad = next(m for m in MORE_MISTAKES if m.name == "ignores_group")
    (tmp_path / "grad_norm.py").write_text(bad.source.split("\n", 1)[1])
    ex = EXERCISES["test_ex5_global_grad_norm"]
    inputs = ex.visible_inputs(torch.Generator().manual_seed(0))
    work = tmp_path / "work"
    work.mkdir()
    before = set(os.listdir("/proc"))
    with pytest.raises(CheckFailed, match=bad.reason):
        run_ranks(ex, LAB, inputs, work, tmp_path, timeout=120)
    assert not new_leftovers(before, str(tmp_path))
