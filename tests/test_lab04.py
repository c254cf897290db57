"""Lab 4 (SyncBatchNorm): its checks pass the reference and fail every classic mistake.

The judges are tested directly on outputs simulated for every rank in this process (fast, no
process), with the grader's full judge (the kit's oracle judge plus
``ddp_lab.answers.lab04.HIDDEN``), over 100 draws of the fixed case set: the right outputs
pass, each mistake fails with its own diagnosis. The visible checks run through the real
runner (torchrun on 2 ranks); the runs over 2 and 3 ranks of one job through a 3-process
gloo group; and the grader itself (``judge_notebook``) where only it can tell: a deadlock,
and exercise 3 graded on the reference pieces. Every mistake of
``ddp_lab/answers/lab04/mistakes.py`` is also fed to the grader by ``tests/test_mistakes.py``.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from pathlib import Path

import pytest
import torch
from _harness import new_leftovers, notebook_with, own_tmpdir, solution_sources, spawn_gloo

from ddp_lab.answers import full_judge, hidden
from ddp_lab.answers.lab04 import HANGS, MISTAKES
from ddp_lab.answers.lab04 import hidden as extra
from ddp_lab.answers.lab04 import references as ref
from ddp_lab.checks import lab04 as checks
from ddp_lab.checks.contract import exercises
from ddp_lab.checks.failure import CheckFailed
from ddp_lab.checks.lab04 import ex1_sync_mean_var as ex1
from ddp_lab.checks.lab04 import ex2_sync_input_grad as ex2
from ddp_lab.checks.lab04 import ex3_sync_bn_function as ex3
from ddp_lab.checks.lab04 import traffic
from ddp_lab.checks.lab04.common import EPS, var_mean
from ddp_lab.checks.runner import split_magics
from ddp_lab.grading.verdict import judge_notebook

LAB = "lab04_syncbn"
SEED = 20240604
STUB = "raise NotImplementedError()"
GIDS = ("test_ex1_sync_mean_var", "test_ex2_sync_input_grad", "test_ex3_sync_bn_function")


def _exercise(grade_id: str):
    return exercises(LAB)[grade_id]


def _judge(grade_id: str):
    """The grader's judge: the kit's oracle judge, then the hidden checks and diagnoses."""
    ex = _exercise(grade_id)
    return full_judge(ex, hidden(LAB).get(ex.grade_id))


def _inputs(grade_id: str, seed: int = SEED) -> dict:
    return _exercise(grade_id).make_inputs(torch.Generator().manual_seed(seed))


def _runs(inputs: dict) -> list[dict]:
    return [run for case in inputs["cases"] for run in case["runs"]]


def _mistake(cell: str, name: str = "typical") -> str:
    return next(m.source for m in MISTAKES if m.cell == cell and m.name == name)


def _write(folder: Path, source: str) -> None:
    """Do what a ``%%writefile`` cell does, in ``folder``."""
    for name, text in split_magics(source)[1].items():
        (folder / name).write_text(text)


# ----------------------------------------------------------------- the fixed case sets


@pytest.mark.parametrize("grade_id", GIDS)
def test_every_draw_holds_every_edge_case(grade_id):
    """One 3-rank job; runs over 2 and 3 ranks; float32 and float64; unequal slices; an
    empty rank; a rank holding one sample; 1 channel and several; 2-D and 4-D inputs."""
    for seed in range(30):
        inputs = _inputs(grade_id, seed)
        assert [c["world_size"] for c in inputs["cases"]] == [3]
        runs = _runs(inputs)
        assert {r["ranks"] for r in runs} == {2, 3}
        assert {r["dtype"] for r in runs} == {"float32", "float64"}
        assert any(r["ranks"] == 3 and 0 in r["sizes"] for r in runs), "an empty rank"
        assert any(1 in r["sizes"] for r in runs), "a rank holding one sample"
        assert {r["channels"] == 1 for r in runs} == {True, False}
        assert {len(r["tail"]) for r in runs} >= {0, 2}
        for run in runs:
            full = [s for s in run["sizes"] if s]
            assert full and (len(full) == 1 or len(set(full)) > 1), run["sizes"]
            xs = run["xs"][0] if grade_id == GIDS[2] else run["xs"]
            assert [len(x) for x in xs] == run["sizes"]
            assert {str(x.dtype) for x in xs} == {f"torch.{run['dtype']}"}
        if grade_id == GIDS[0]:
            far = {(r["dtype"], r["ranks"]) for r in runs if r["far"]}
            assert {"float32", "float64"} <= {d for d, _ in far} and {2, 3} <= {n for _, n in far}
        if grade_id == GIDS[2]:
            assert all(len(r["xs"]) == ex3.STEPS == 3 for r in runs), "several steps"
        visible = _exercise(grade_id).visible_inputs(torch.Generator().manual_seed(seed))
        assert [c["world_size"] for c in visible["cases"]] == [2]
    a, b = (_runs(_inputs(GIDS[0], s))[0]["xs"][0] for s in (1, 2))
    assert a.shape != b.shape or not torch.equal(a, b), "the values are drawn"


# ---------------------------------------------------- simulated outputs (every rank, here)


def _per_rank(inputs: dict, one) -> dict:
    """``{"cases": [[rank 0's outputs per run], ...]}`` with ``one(run, rank)`` per rank."""
    cases = []
    for case in inputs["cases"]:
        w = case["world_size"]
        cases.append(
            [[one(run, r) if r < run["ranks"] else None for run in case["runs"]] for r in range(w)]
        )
    return {"cases": cases}


def _dims(x: torch.Tensor) -> list[int]:
    return [0, *range(2, x.dim())]


def _stats(run: dict, rank: int, mistake: str | None = None) -> list:
    """One rank's ``[mean, var, count]`` as the solution (or a mistake) computes them."""
    xs = run["xs"]
    dt = xs[0].dtype
    stats = [ref.local_stats(x) for x in xs]
    counts = [n for n, _, _ in stats]
    means, variances = torch.stack([m for _, m, _ in stats]), torch.stack([v for _, _, v in stats])
    mean, var, total = ref.two_pass(xs)
    if mistake == "all_gather":  # lab 1's pooling of the ranks' (count, mean, variance)
        mean, var, total = ref.pool(counts, means, variances)
    if mistake == "averaged":  # every rank's mean and variance, NaN for an empty one
        nan = [x.mean(_dims(x)) if len(x) else torch.full_like(mean, float("nan")) for x in xs]
        ranks = len(xs)
        return [
            sum(nan) / ranks,
            sum(torch.var(x, _dims(x), correction=0) for x in xs) / ranks,
            total,
        ]
    if mistake in ("float32 sums", "float64 sums"):
        acc = dt if mistake == "float32 sums" else torch.float64
        s = sum(x.to(acc).sum(_dims(x)) for x in xs)
        q = sum((x.to(acc) * x.to(acc)).sum(_dims(x)) for x in xs)
        m = s / float(total)
        return [m, q / float(total) - m * m, total]
    if mistake == "within":
        w = torch.tensor(counts, dtype=dt).reshape(-1, 1) / total
        return [mean, (w * variances).sum(0), total]
    if mistake == "unbiased":
        return [mean, var * total / (total - 1), total]
    if mistake == "local count":
        return [mean, var, torch.tensor(float(counts[rank]))]
    if mistake == "no collective":
        return [means[rank], variances[rank], torch.tensor(float(counts[rank]))]
    if mistake == "batch dim only":
        x = xs[rank]
        return [x.mean(0), x.var(0, correction=0), float(len(x))]
    return [mean.clone(), var.clone(), total.clone()]


def _calls(run: dict, mistake: str | None = None) -> list:
    """One rank's recorded collectives, ``[name, values, bytes]``, as the solution (two
    all-reduces, ``C + 1`` and ``C`` values) or a mistake moves them."""
    c, n = run["channels"], run["ranks"]
    size = 8 if run["dtype"] == "float64" else 4
    if mistake == "all_gather":  # every rank's (n_k, m_k, v_k), n times over
        return [["all_gather", n * (2 * c + 1), n * (2 * c + 1) * size]]
    if mistake == "slot per rank":  # a zero tensor with a slot per rank, all-reduced
        return [["all_reduce", n * (2 * c + 1), n * (2 * c + 1) * size]]
    if mistake == "a call per rank":  # rank k's numbers in the k-th all-reduce
        return [["all_reduce", 2 * c + 1, (2 * c + 1) * size]] * n
    if mistake == "too many calls":
        return [["all_reduce", 1, size]] + [["all_reduce", c, c * size]] * 3
    return [["all_reduce", c + 1, (c + 1) * size], ["all_reduce", c, c * size]]


#: mistakes with the right numbers and the wrong traffic -> what the verdict must say
TRAFFIC_MISTAKES = {
    "all_gather": "A gather brings every rank's tensor to every rank",
    "slot per rank": "an all-gather in disguise",
    "a call per rank": "the traffic grows with the world size",
    "too many calls": "all-reduces in one call of sync_mean_var",
}

#: mistake -> what the grader's verdict must say
STATS_MISTAKES = {
    "averaged": "averaged the ranks' means",
    "float32 sums": "two large numbers",
    "float64 sums": "two large numbers",
    "within": "between the ranks' means",
    "unbiased": "unbiased variance",
    "local count": "this rank's count",
    "no collective": "its own slice",
    "batch dim only": "every dimension but the channel dimension 1",
    **TRAFFIC_MISTAKES,
}


def _grad(run: dict, rank: int, mistake: str | None = None) -> torch.Tensor:
    """One rank's input gradient as the solution (or a mistake) computes it."""
    dys, x_hats = run["dys"], run["x_hats"]
    sums = [ref.grad_sums(d, h) for d, h in zip(dys, x_hats, strict=True)]
    total = (sum(s for s, _ in sums), sum(s for _, s in sums))
    count = run["count"]
    args = (dys[rank], x_hats[rank], run["invstd"])
    if mistake == "local sums":
        return ref.input_grad(*args, run["weight"], *sums[rank], count)
    if mistake == "local count":
        return ref.input_grad(*args, run["weight"], *total, max(dys[rank][:, 0].numel(), 1))
    if mistake == "no x_hat term":
        return ref.input_grad(*args, run["weight"], total[0], torch.zeros_like(total[1]), count)
    if mistake == "no weight":
        return ref.input_grad(*args, torch.ones_like(run["weight"]), *total, count)
    return ref.input_grad(*args, run["weight"], *total, count)


GRAD_MISTAKES = {
    "local sums": "must be all-reduced",
    "local count": "this rank's count",
    "no x_hat term": "the variance depends on x",
    "no weight": "weight (gamma) is missing",
}


def _function_run(run: dict, mistake: str | None = None) -> list[dict]:
    """Every rank's outputs of the solution's Function (or a mistake), steps and ranks
    simulated in order in this process."""
    w, m = run["ranks"], run["momentum"]
    running_mean, running_var = run["running_mean"].clone(), run["running_var"].clone()
    outs = [
        {k: [] for k in ("y", "grad_x", "grad_weight", "grad_bias", "rm", "rv")} for _ in range(w)
    ]
    for xs, dys in zip(run["xs"], run["dys"], strict=True):
        mean, var, total = _stats({"xs": xs}, 0)
        count = float(total)
        tracked = var if mistake == "biased running var" else var * count / (count - 1)
        if mistake == "momentum swapped":
            running_mean, running_var = (
                m * running_mean + (1 - m) * mean,
                m * running_var + (1 - m) * tracked,
            )
        elif mistake != "not in place":
            running_mean = (1 - m) * running_mean + m * mean
            running_var = (1 - m) * running_var + m * tracked
        invstd = (var + EPS).rsqrt()
        view = (1, -1, *([1] * (xs[0].dim() - 2)))
        x_hats = [(x - mean.reshape(view)) * invstd.reshape(view) for x in xs]
        local = [ref.grad_sums(d, h) for d, h in zip(dys, x_hats, strict=True)]
        g_dy, g_dyh = (sum(s for s, _ in local), sum(s for _, s in local))
        for r in range(w):
            sums = local[r] if mistake == "local backward" else (g_dy, g_dyh)
            dx = ref.input_grad(dys[r], x_hats[r], invstd, run["weight"], *sums, count)
            d_w, d_b = (g_dyh, g_dy) if mistake == "reduced param grads" else local[r][::-1]
            outs[r]["y"].append(x_hats[r] * run["weight"].reshape(view) + run["bias"].reshape(view))
            outs[r]["grad_x"].append(dx)
            outs[r]["grad_weight"].append(d_w.clone())
            outs[r]["grad_bias"].append(d_b.clone())
            outs[r]["rm"].append(running_mean.clone())
            outs[r]["rv"].append(running_var.clone())
    return outs


FUNCTION_MISTAKES = {
    "biased running var": "tracks the UNBIASED one",
    "reduced param grads": "counts them twice",
    "local backward": "the input gradient",
    "not in place": "IN PLACE",
    "momentum swapped": "the wrong way round",
}


def _outputs(grade_id: str, inputs: dict, mistake: str | None = None) -> dict:
    if grade_id == GIDS[0]:
        return _per_rank(
            inputs,
            lambda run, r: {"stats": _stats(run, r, mistake), "calls": _calls(run, mistake)},
        )
    if grade_id == GIDS[1]:
        return _per_rank(inputs, lambda run, r: _grad(run, r, mistake))
    simulated = {}

    def one(run, r):
        key = id(run)
        if key not in simulated:
            simulated[key] = _function_run(run, mistake)
        return simulated[key][r]

    return _per_rank(inputs, one)


MISTAKES_OF = {GIDS[0]: STATS_MISTAKES, GIDS[1]: GRAD_MISTAKES, GIDS[2]: FUNCTION_MISTAKES}


def _fails_with(judge, inputs: dict, outputs: dict, reason: str, seed: int, name: str) -> None:
    with pytest.raises(CheckFailed) as failed:
        judge(inputs, outputs)
        pytest.fail(f"seed {seed}: the mistake {name!r} passed")
    assert reason in str(failed.value), f"seed {seed}, {name!r}: {failed.value}"


# ------------------------------------------------------------ property: any draw, any seed

PROPERTY_SEEDS = range(100)


@pytest.mark.parametrize("grade_id", GIDS)
def test_property_verdicts_do_not_depend_on_the_draw(grade_id):
    """100 draws of the fixed case set: every rank's right outputs (simulated here) pass the
    grader's full judge; each typical mistake fails it, with its own diagnosis."""
    judge = _judge(grade_id)
    for seed in PROPERTY_SEEDS:
        inputs = _inputs(grade_id, seed)
        try:
            judge(inputs, _outputs(grade_id, inputs))
        except CheckFailed as err:
            pytest.fail(f"seed {seed}: the right answer failed: {err}")
        for name, reason in MISTAKES_OF[grade_id].items():
            _fails_with(judge, inputs, _outputs(grade_id, inputs, name), reason, seed, name)


# -------------------------------------------------------- judges on hand-built outputs


def test_kit_judges_say_what_is_wrong_without_the_hidden_diagnoses():
    inputs = _inputs(GIDS[0])
    empty = copy.deepcopy(inputs)  # the runs with an empty rank only: its 0/0 is NaN
    empty["cases"][0]["runs"] = [r for r in _runs(inputs) if 0 in r["sizes"]]
    averaged = _outputs(GIDS[0], empty, "averaged")
    with pytest.raises(CheckFailed, match="a rank without samples has no mean of its own") as kit:
        _exercise(GIDS[0]).judge(empty, averaged)
    assert "averaged" not in str(kit.value)
    far = _outputs(GIDS[0], inputs, "float32 sums")
    with pytest.raises(CheckFailed, match=r"global biased variance: off by .* \(allowed"):
        _exercise(GIDS[0]).judge(inputs, far)
    inputs = _inputs(GIDS[1])
    with pytest.raises(CheckFailed, match="each rank needs sums over the GLOBAL batch"):
        _exercise(GIDS[1]).judge(inputs, _outputs(GIDS[1], inputs, "local sums"))


def test_stats_tolerance_follows_dtype_and_magnitude():
    """Near 1e8 in float64 the sum of squares is off by far more than allowed, while the
    solution's pooled deviations are well inside; a wrong count is said as such."""
    inputs = _inputs(GIDS[0])
    run = next(r for r in _runs(inputs) if r["far"] and r["dtype"] == "float64")
    tol_mean, tol_var = ex1.tolerances(run)
    var, _ = var_mean(torch.cat(run["xs"]))
    good = _stats(run, 0)[1].double()
    bad = _stats(run, 0, "float64 sums")[1].double()
    assert (good - var).abs().max() < tol_var / 4 < tol_var * 100 < (bad - var).abs().max()
    wrong = _outputs(GIDS[0], inputs)
    wrong["cases"][0][1][0]["stats"][2] = torch.tensor(1.0)
    with pytest.raises(CheckFailed, match="global count should be"):
        _judge(GIDS[0])(inputs, wrong)


def test_function_oracle_equals_batchnorm_modules():
    """The kit's oracle is nn.BatchNorm1d/2d on the concatenated batch; the ranks' own weight
    and bias shares add up to the module's gradients."""
    for run in _runs(_inputs(GIDS[2])):
        oracle = ex3.batchnorm_oracle(run)
        nd = run["xs"][0][0].dim()
        bn = (torch.nn.BatchNorm1d if nd < 4 else torch.nn.BatchNorm2d)(
            run["channels"], momentum=run["momentum"]
        ).double()
        with torch.no_grad():
            for key in ("weight", "bias", "running_mean", "running_var"):
                getattr(bn, key).copy_(run[key])
        for step, (xs, dys) in enumerate(zip(run["xs"], run["dys"], strict=True)):
            x = torch.cat(xs).double().requires_grad_(True)
            y = bn(x)
            (y * torch.cat(dys).double()).sum().backward()
            assert torch.allclose(y, torch.cat(oracle["y"][step]), atol=1e-12)
            assert torch.allclose(x.grad, torch.cat(oracle["grad_x"][step]), atol=1e-12)
            assert torch.allclose(bn.weight.grad, sum(oracle["grad_weight"][step]), atol=1e-12)
            assert torch.allclose(bn.bias.grad, sum(oracle["grad_bias"][step]), atol=1e-12)
            assert torch.allclose(bn.running_mean, oracle["rm"][step], atol=1e-12)
            assert torch.allclose(bn.running_var, oracle["rv"][step], atol=1e-12)
            bn.zero_grad()


def test_function_judge_names_a_missing_gradient_and_a_wrong_rank():
    inputs = _inputs(GIDS[2])
    good = _outputs(GIDS[2], inputs)
    judge = _judge(GIDS[2])
    assert "equals BatchNorm over the global batch on 2 and 3 ranks for 3 steps" in judge(
        inputs, good
    )
    no_grad = copy.deepcopy(good)
    no_grad["cases"][0][1][0]["grad_x"][0] = None
    with pytest.raises(CheckFailed, match="x got no gradient"):
        judge(inputs, no_grad)
    broken = copy.deepcopy(good)
    broken["cases"][0][2][1] = "<int>"
    with pytest.raises(CheckFailed, match="unexpected result a int"):
        judge(inputs, broken)


# ----------------------------------------------------- the references (instructor only)


def test_hidden_files_are_the_notebooks_pieces():
    """The files the grader puts next to a student's sync_bn.py are the notebook's solutions
    of exercises 1 and 2 (the same code, docstrings aside)."""
    files = hidden(LAB)[GIDS[2]].files()
    assert files == {"sync_stats.py": ref.STATS_SOURCE, "sync_grad.py": ref.GRAD_SOURCE}
    solutions = solution_sources(LAB)
    for cell, text in (
        ("ex1_sync_mean_var", ref.STATS_SOURCE),
        ("ex2_sync_input_grad", ref.GRAD_SOURCE),
    ):
        region = solutions[cell].split("### BEGIN SOLUTION")[1].split("    ### END SOLUTION")[0]
        assert region.strip("\n") in text, cell


def test_reference_files_in_a_world_of_one_process():
    """The reference statistics and gradient in a one-process gloo group (no port): the
    batch's statistics far from 0, and autograd's gradient."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        x = 1e4 + torch.randn(5, 3, 4, 4, dtype=torch.float32)
        mean, var, count = ref.sync_mean_var(x)
        exp_var, exp_mean = var_mean(x)
        ulps = 16 * torch.finfo(torch.float32).eps * float(x.abs().max())  # the judge's
        assert float(count) == 80 and torch.allclose(mean.double(), exp_mean, atol=ulps)
        assert torch.allclose(var.double(), exp_var, atol=1e-2)
        empty = ref.sync_mean_var(torch.zeros(0, 3))
        assert float(empty[2]) == 0 and torch.isnan(empty[0]).all()  # 0/0: nobody holds data
        run = _runs(_inputs(GIDS[1]))[0]
        x = torch.cat(run["xs"])
        dx = ref.sync_input_grad(
            torch.cat(run["dys"]),
            torch.cat(run["x_hats"]),
            run["invstd"],
            run["weight"],
            run["count"],
        )
        assert torch.allclose(
            dx, torch.cat(ex2.autograd_input_grads(run["xs"], run["dys"], run["weight"])), atol=1e-9
        )
        assert x.numel()
    finally:
        dist.destroy_process_group()


def test_traffic_is_recorded_once_per_call_and_the_collectives_restored():
    """In a one-process gloo group: every collective the student's code calls is recorded
    with the values it leaves on the rank, also under a name imported inside the block; a
    collective that calls another counts once; afterwards torch's own functions are back."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    if dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    before = (dist.all_reduce, c10d.all_reduce, dist.all_gather, c10d.all_gather_object)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        log: list = []
        with traffic.recorded(log):
            from torch.distributed import all_gather

            dist.all_reduce(torch.zeros(3, dtype=torch.float64))
            all_gather([torch.zeros(2)], torch.ones(2))
            dist.all_gather_object([None], {"a": 1})
            c10d.all_reduce(tensor=torch.zeros(4))
        assert log == [
            ["all_reduce", 3, 24],
            ["all_gather", 2, 8],
            ["all_gather_object", 0, 0],
            ["all_reduce", 4, 16],
        ]
        after = (dist.all_reduce, c10d.all_reduce, dist.all_gather, c10d.all_gather_object)
        assert after == before
    finally:
        dist.destroy_process_group()
    where = "sync_mean_var on rank 0"
    assert traffic.problem(where, 3, 2, [["all_reduce", 4, 16], ["all_reduce", 3, 12]]) is None
    assert "A gather" in traffic.problem(where, 3, 2, [["all_gather_into_tensor", 14, 56]])
    assert "allows dist.all_reduce only" in traffic.problem(where, 3, 2, [["broadcast", 3, 12]])


@pytest.mark.timeout(180)
def test_runs_over_two_ranks_see_a_world_of_two_in_a_three_rank_job(tmp_path):
    """per_run: in one 3-process job, a run over 2 ranks sees world size 2 and its
    collectives (without group=) reach ranks 0 and 1 only; rank 2 sits it out."""
    from _syncbn_workers import per_run_worker

    spawn_gloo(per_run_worker, 3, str(tmp_path))
    got = [torch.load(tmp_path / f"per-run-{r}.pt", weights_only=True) for r in range(3)]
    assert [g[0] for g in got] == [[3, 6.0], [3, 6.0], [3, 6.0]]  # ranks 1 + 2 + 3
    assert [g[1] for g in got] == [[2, 3.0], [2, 3.0], None]  # ranks 1 + 2 only
    assert [g[2] for g in got] == [[3, 6.0], [3, 6.0], [3, 6.0]]


# ------------------------------------------------------------------ visible checks


def test_visible_distributed_checks_defer_to_the_grader_under_autograde(monkeypatch, capsys):
    monkeypatch.setenv("NBGRADER_EXECUTION", "autograde")
    checks.sync_bn_function("no_such_folder/sync_bn.py")  # no job, no error: the grader decides
    assert "run by the grader" in capsys.readouterr().out


def test_visible_checks_ask_to_finish_the_stubs_without_starting(tmp_path):
    with pytest.raises(CheckFailed, match="not found"):
        checks.sync_mean_var(str(tmp_path / "sync_stats.py"))
    (tmp_path / "sync_stats.py").write_text(f"def sync_mean_var(x):\n    {STUB}\n")
    with pytest.raises(CheckFailed, match="finish this exercise first"):
        checks.sync_mean_var(str(tmp_path / "sync_stats.py"))
    solutions = solution_sources(LAB)
    _write(tmp_path, solutions["ex3_sync_bn_function"])
    with pytest.raises(CheckFailed, match=r"your sync_stats.py still holds the released stub"):
        checks.sync_bn_function(str(tmp_path / "sync_bn.py"))
    _write(tmp_path, solutions["ex1_sync_mean_var"])
    with pytest.raises(CheckFailed, match=r"your sync_grad.py \(exercise 2\), not found"):
        checks.sync_bn_function(str(tmp_path / "sync_bn.py"))
    _write(tmp_path, solutions["ex2_sync_input_grad"])
    assert checks.unfinished(tmp_path) is None


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_visible_distributed_checks_run_the_files_under_torchrun(tmp_path, capsys):
    solutions = solution_sources(LAB)
    for cell in ("ex1_sync_mean_var", "ex2_sync_input_grad", "ex3_sync_bn_function"):
        _write(tmp_path, solutions[cell])
    checks.sync_mean_var(str(tmp_path / "sync_stats.py"))
    assert "OK: sync_mean_var gives every rank the global mean, variance and count on 2" in (
        capsys.readouterr().out
    )
    checks.sync_bn_function(str(tmp_path / "sync_bn.py"))  # on the student's own pieces
    assert "OK: SyncBNFunction equals BatchNorm over the global batch on 2 ranks" in (
        capsys.readouterr().out
    )
    _write(tmp_path, _mistake("ex1_sync_mean_var"))  # averages the ranks' means
    with pytest.raises(CheckFailed, match=r"2 ranks holding .*the global mean: off by"):
        checks.sync_mean_var(str(tmp_path / "sync_stats.py"))
    _write(tmp_path, _mistake("ex1_sync_mean_var", "all_gather"))  # right numbers, gathered
    with pytest.raises(CheckFailed, match=r"computed with dist.all_gather \(14 values"):
        checks.sync_mean_var(str(tmp_path / "sync_stats.py"))
    _write(tmp_path, _mistake("ex2_sync_input_grad"))
    with pytest.raises(CheckFailed, match="each rank needs sums over the GLOBAL batch"):
        checks.sync_input_grad(str(tmp_path / "sync_grad.py"))


# ---------------------------------------------------------- through the real grader


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_exercise3_is_graded_on_the_reference_pieces():
    """Mistakes in exercises 1 and 2 do not cost exercise 3: the grader puts the reference
    sync_stats.py and sync_grad.py next to the student's sync_bn.py."""
    nb = notebook_with(
        LAB,
        {
            "ex1_sync_mean_var": _mistake("ex1_sync_mean_var"),
            "ex2_sync_input_grad": _mistake("ex2_sync_input_grad"),
        },
    )
    v = judge_notebook(nb, LAB, [GIDS[2]], seed=SEED)[GIDS[2]]
    assert v.passed, v


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_deadlocking_rank_is_stopped_and_leaves_no_process(tmp_path, monkeypatch):
    grade_id = GIDS[0]
    # the exercise's own timeout (60 s) shortened: the job is up and hanging well before
    # 25 s (a solution's whole run takes about 8 s), and the path that stops it is the same
    short = [
        dataclasses.replace(e, timeout=25) if e.grade_id == grade_id else e
        for e in checks.EXERCISES
    ]
    monkeypatch.setattr(checks, "EXERCISES", short)
    marker = own_tmpdir(monkeypatch, tmp_path)
    before = set(os.listdir("/proc"))
    v = judge_notebook(notebook_with(LAB, HANGS), LAB, [grade_id], seed=SEED)[grade_id]
    assert not v.passed and "did not finish within 25 s" in v.message, v
    leftovers = new_leftovers(before, marker)
    assert not leftovers, f"processes of the hanging job survived: {leftovers}"


def test_diagnoses_fire_only_on_wrong_answers():
    """A hidden diagnosis never names a mistake for outputs that the kit's judge accepts."""
    for gid, explain in (
        (GIDS[0], extra._explain_stats),
        (GIDS[1], extra._explain_grad),
        (GIDS[2], extra._explain_function),
    ):
        for seed in range(20):
            inputs = _inputs(gid, seed)
            assert explain(inputs, _outputs(gid, inputs)) is None, (gid, seed)
