"""Lab 4 (SyncBatchNorm): its checks pass the reference and fail every classic mistake.

The judges are tested directly on outputs built from the references (fast, no process), with
the grader's full judge (the kit's oracle judge plus ``ddp_lab.answers.lab04.HIDDEN``); the
visible checks through the real runner (torchrun on 2 ranks); and the grader itself
(``judge_notebook``) where only it can tell: a deadlock, and exercise 4 graded on the
reference pieces. Every mistake of ``ddp_lab/answers/lab04/mistakes.py`` is also fed to the
grader by ``tests/test_mistakes.py``.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _harness import assert_verdicts, new_leftovers, notebook_with, solution_sources

from ddp_lab.answers import full_judge, hidden
from ddp_lab.answers.lab04 import HANGS, MISTAKES
from ddp_lab.answers.lab04 import hidden as extra
from ddp_lab.answers.lab04 import references as ref
from ddp_lab.checks import lab04 as checks
from ddp_lab.checks.contract import exercises
from ddp_lab.checks.failure import CheckFailed
from ddp_lab.checks.lab04 import ex2_sync_mean_var, ex3_sync_input_grad, ex4_sync_bn_function
from ddp_lab.checks.lab04.common import EPS
from ddp_lab.checks.runner import split_magics
from ddp_lab.grading.verdict import judge_notebook

LAB = "lab04_syncbn"
SEED = 20240604
STEPS = ex4_sync_bn_function.STEPS
STUB = "raise NotImplementedError()"


def _exercise(grade_id: str):
    return exercises(LAB)[grade_id]


def _judge(grade_id: str):
    """The grader's judge: the kit's oracle judge, then the hidden checks and diagnoses."""
    ex = _exercise(grade_id)
    return full_judge(ex, hidden(LAB).get(ex.grade_id))


def _inputs(grade_id: str, seed: int = SEED) -> dict:
    return _exercise(grade_id).make_inputs(torch.Generator().manual_seed(seed))


def _mistake(cell: str, name: str = "typical") -> str:
    return next(m.source for m in MISTAKES if m.cell == cell and m.name == name)


def _write(folder: Path, source: str) -> None:
    """Do what a ``%%writefile`` cell does, in ``folder``."""
    for name, text in split_magics(source)[1].items():
        (folder / name).write_text(text)


# ----------------------------------------------------------------- inputs drawn at grading


def test_inputs_have_unequal_batch_sizes_and_an_empty_rank():
    for seed in range(20):
        stats = _inputs("test_ex2_sync_mean_var", seed)["cases"]
        assert [c["world_size"] for c in stats] == [3]
        for case in stats:
            assert len(set(case["sizes"])) > 1, case["sizes"]
            assert [len(x) for x in case["xs"]] == case["sizes"]
        assert 0 in stats[0]["sizes"], "the 3-rank case must hold an empty rank"
        visible = ex2_sync_mean_var.visible_inputs(torch.Generator().manual_seed(seed))
        assert 0 not in visible["cases"][0]["sizes"], (
            "the visible check must not deadlock on the hang student's code"
        )
        for gid in ("test_ex3_sync_input_grad", "test_ex4_sync_bn_function"):
            for case in _inputs(gid, seed)["cases"]:
                assert len(set(case["sizes"])) > 1 and min(case["sizes"]) >= 1
        shapes = [x.dim() for x in _inputs("test_ex1_local_moments", seed)["xs"]]
        assert shapes == [2, 3, 4, 4]  # reducing over dim 0 only must fail somewhere
    assert not torch.equal(
        _inputs("test_ex2_sync_mean_var", 1)["cases"][0]["xs"][0],
        _inputs("test_ex2_sync_mean_var", 2)["cases"][0]["xs"][0],
    )
    functions = [c["world_size"] for c in _inputs("test_ex4_sync_bn_function")["cases"]]
    assert functions == [2, 3]


# ---------------------------------------------------- simulated outputs (every rank, here)


def _summed(parts):
    return [sum(p) for p in zip(*parts, strict=True)]


def _moments_outputs(source: str, inputs: dict) -> dict:
    ns: dict = {}
    exec(split_magics(source)[0], ns)  # noqa: S102 - our own solution and mistakes
    return _exercise("test_ex1_local_moments").run(ns, inputs, Path("."))


def _stats_outputs(case: dict, mistake: str | None = None) -> list:
    """Every rank's (mean, var, count), as the solution computes them from all-reduced sums."""
    moments = [ref.local_moments(x) for x in case["xs"]]
    s, ss, n = _summed(moments)
    mean, var = ref.global_mean_var(s, ss, n)
    out = []
    for ls, lss, ln in moments:
        if mistake == "averaged":
            m, v = extra.averaged_per_rank(case["xs"])
            out.append([m, v, n.clone()])
        elif mistake == "unbiased":
            out.append([mean.clone(), var * n / (n - 1), n.clone()])
        elif mistake == "no all_reduce":
            lm = ls / ln
            out.append([lm, lss / ln - lm * lm, ln.clone()])
        elif mistake == "local count":
            out.append([mean.clone(), var.clone(), ln.clone()])
        else:
            out.append([mean.clone(), var.clone(), n.clone()])
    return out


def _grad_outputs(case: dict, mistake: str | None = None) -> list:
    """Every rank's input gradient, as the solution computes it from all-reduced sums."""
    local = [ref.local_grad_sums(d, h) for d, h in zip(case["dys"], case["x_hats"], strict=True)]
    sums = _summed(local)
    out = []
    for dy, x_hat, own in zip(case["dys"], case["x_hats"], local, strict=True):
        count = case["count"]
        used = sums
        if mistake == "local sums":
            used = own
        elif mistake == "local count":
            count = dy.numel() / case["weight"].numel()
        out.append(
            ref.batchnorm_input_grad(dy, x_hat, case["invstd"], case["weight"], *used, count)
        )
    return out


def _function_outputs(case: dict, mistake: str | None = None) -> list[dict]:
    """Every rank's outputs of the solution's Function, steps and ranks simulated in order."""
    w, m = case["world_size"], case["momentum"]
    running_mean, running_var = case["running_mean"].clone(), case["running_var"].clone()
    outs = [{"y": [], "grad_x": [], "grad_weight": [], "grad_bias": []} for _ in range(w)]
    for xs, dys in zip(case["xs"], case["dys"], strict=True):
        s, ss, n = _summed([ref.local_moments(x) for x in xs])
        mean, var = ref.global_mean_var(s, ss, n)
        count = n.item()
        running_mean = (1 - m) * running_mean + m * mean
        tracked = var if mistake == "biased running var" else var * count / (count - 1)
        running_var = (1 - m) * running_var + m * tracked
        invstd = (var + EPS).rsqrt()
        view = (1, -1, *([1] * (xs[0].dim() - 2)))
        x_hats = [(x - mean.reshape(view)) * invstd.reshape(view) for x in xs]
        local = [ref.local_grad_sums(d, h) for d, h in zip(dys, x_hats, strict=True)]
        g_dy, g_dyh = _summed(local)
        for r in range(w):
            sums = local[r] if mistake == "local backward" else (g_dy, g_dyh)
            dx = ref.batchnorm_input_grad(dys[r], x_hats[r], invstd, case["weight"], *sums, count)
            d_w, d_b = (g_dyh, g_dy) if mistake == "reduced param grads" else local[r][::-1]
            outs[r]["y"].append(
                x_hats[r] * case["weight"].reshape(view) + case["bias"].reshape(view)
            )
            outs[r]["grad_x"].append(dx)
            outs[r]["grad_weight"].append(d_w.clone())
            outs[r]["grad_bias"].append(d_b.clone())
    for o in outs:
        o["running_mean"], o["running_var"] = running_mean.clone(), running_var.clone()
    return outs


def _outputs(outputs_of, inputs: dict, mistake: str | None = None) -> dict:
    return {"cases": [outputs_of(c, mistake) for c in inputs["cases"]]}


# -------------------------------------------------------- judges on hand-built outputs


def test_stats_judge_accepts_the_reference_and_names_the_averaging_mistake():
    inputs = _inputs("test_ex2_sync_mean_var")
    judge = _judge("test_ex2_sync_mean_var")
    assert "global mean and variance on 3 ranks" in judge(inputs, _outputs(_stats_outputs, inputs))
    averaged = _outputs(_stats_outputs, inputs, "averaged")
    with pytest.raises(CheckFailed, match="averaged the ranks' means"):
        judge(inputs, averaged)
    # the kit's judge says what is wrong without computing the mistake (that is hidden)
    with pytest.raises(CheckFailed, match="the global mean") as kit:
        _exercise("test_ex2_sync_mean_var").judge(inputs, averaged)
    assert "averaged" not in str(kit.value)
    bad = _outputs(_stats_outputs, inputs)
    bad["cases"][0][2][2] = torch.tensor(1.0)  # a wrong global count on one rank
    with pytest.raises(CheckFailed, match="global count should be"):
        judge(inputs, bad)


def test_grad_judge_accepts_autograd_and_names_the_local_sums_mistake():
    inputs = _inputs("test_ex3_sync_input_grad")
    judge = _judge("test_ex3_sync_input_grad")
    good = {
        "cases": [
            ex3_sync_input_grad.autograd_input_grads(c["xs"], c["dys"], c["weight"])
            for c in inputs["cases"]
        ]
    }
    assert "input gradient" in judge(inputs, good)
    local = _outputs(_grad_outputs, inputs, "local sums")
    with pytest.raises(CheckFailed, match="must be all-reduced"):
        judge(inputs, local)
    # the kit's judge: a property of every right answer, broken (no near-answer computed)
    with pytest.raises(CheckFailed, match="GLOBAL sums and count"):
        _exercise("test_ex3_sync_input_grad").judge(inputs, local)


def _oracle_outputs(inputs: dict) -> dict:
    cases = []
    for case in inputs["cases"]:
        oracle = ex4_sync_bn_function.batchnorm_oracle(case)
        cases.append(
            [
                {
                    **{
                        key: [oracle[key][s][r] for s in range(STEPS)]
                        for key in ("y", "grad_x", "grad_weight", "grad_bias")
                    },
                    "running_mean": oracle["running_mean"].clone(),
                    "running_var": oracle["running_var"].clone(),
                }
                for r in range(case["world_size"])
            ]
        )
    return {"cases": cases}


def test_function_oracle_equals_batchnorm_modules():
    """The kit's oracle is nn.BatchNorm1d/2d on the concatenated batch; the ranks' own weight
    and bias shares add up to the module's gradients."""
    for case in _inputs("test_ex4_sync_bn_function")["cases"]:
        oracle = ex4_sync_bn_function.batchnorm_oracle(case)
        nd = case["xs"][0][0].dim()
        bn = (torch.nn.BatchNorm1d if nd < 4 else torch.nn.BatchNorm2d)(
            len(case["weight"]), momentum=case["momentum"]
        ).double()
        with torch.no_grad():
            for key in ("weight", "bias", "running_mean", "running_var"):
                getattr(bn, key).copy_(case[key])
        for step, (xs, dys) in enumerate(zip(case["xs"], case["dys"], strict=True)):
            x = torch.cat(xs).requires_grad_(True)
            y = bn(x)
            (y * torch.cat(dys)).sum().backward()
            assert torch.allclose(y, torch.cat(oracle["y"][step]), atol=1e-12)
            assert torch.allclose(x.grad, torch.cat(oracle["grad_x"][step]), atol=1e-12)
            assert torch.allclose(bn.weight.grad, sum(oracle["grad_weight"][step]), atol=1e-12)
            assert torch.allclose(bn.bias.grad, sum(oracle["grad_bias"][step]), atol=1e-12)
            bn.zero_grad()
        assert torch.allclose(bn.running_mean, oracle["running_mean"], atol=1e-12)
        assert torch.allclose(bn.running_var, oracle["running_var"], atol=1e-12)


def test_function_judge_names_biased_running_var_and_reduced_param_grads():
    inputs = _inputs("test_ex4_sync_bn_function")
    judge = _judge("test_ex4_sync_bn_function")
    good = _oracle_outputs(inputs)
    assert "equals BatchNorm over the global batch on 2 and 3 ranks" in judge(inputs, good)
    assert "equals BatchNorm" in judge(inputs, _outputs(_function_outputs, inputs))

    biased = copy.deepcopy(good)
    for case, ranks in zip(inputs["cases"], biased["cases"], strict=True):
        for out in ranks:
            out["running_var"] = extra.biased_running_var(case)
    with pytest.raises(CheckFailed, match="biased variance"):
        judge(inputs, biased)
    with pytest.raises(CheckFailed, match="running_var after 2 steps"):
        _exercise("test_ex4_sync_bn_function").judge(inputs, biased)

    reduced = copy.deepcopy(good)
    for ranks in reduced["cases"]:
        for step in range(STEPS):
            total = sum(out["grad_weight"][step] for out in ranks)
            for out in ranks:
                out["grad_weight"][step] = total.clone()
    with pytest.raises(CheckFailed, match="counts them twice"):
        judge(inputs, reduced)

    no_grad = copy.deepcopy(good)
    no_grad["cases"][0][1]["grad_x"][0] = None
    with pytest.raises(CheckFailed, match="x got no gradient"):
        judge(inputs, no_grad)


# ----------------------------------------------------- the references (instructor only)


@pytest.mark.parametrize("world_size", [2, 3])
def test_summed_local_moments_give_global_mean_and_biased_var(world_size):
    gen = torch.Generator().manual_seed(world_size)
    case = ex2_sync_mean_var._case(gen, world_size, (4, 4), empty=world_size == 3)
    x = torch.cat(case["xs"])
    moments = [ref.local_moments(s) for s in case["xs"]]
    total = _summed(moments)  # what the all_reduce computes
    mean, var = ref.global_mean_var(*total)
    ref_var, ref_mean = torch.var_mean(x, dim=(0, 2, 3), correction=0)
    assert total[2].item() == x.numel() // x.size(1)
    assert torch.allclose(mean, ref_mean, atol=1e-12) and torch.allclose(var, ref_var, atol=1e-12)


@pytest.mark.parametrize("world_size", [2, 3])
def test_input_grad_from_summed_local_grad_sums_matches_autograd(world_size):
    case = _inputs("test_ex3_sync_input_grad", world_size)["cases"][0]
    expected = ex3_sync_input_grad.autograd_input_grads(case["xs"], case["dys"], case["weight"])
    assert all(
        torch.allclose(g, e, atol=1e-12) for g, e in zip(_grad_outputs(case), expected, strict=True)
    )


def test_all_reduce_packed_is_identity_without_process_group():
    if torch.distributed.is_initialized():
        pytest.skip("a process group is initialised in this process")
    a, b = torch.arange(6.0).reshape(2, 3), torch.tensor(7.0)
    ra, rb = ref.all_reduce_packed([a, b])
    assert torch.equal(ra, a) and torch.equal(rb, b)


@pytest.mark.parametrize("training", [True, False])
def test_reference_function_gradcheck_single_process(training):
    torch.manual_seed(0)
    x = torch.randn(5, 3, 2, 2, dtype=torch.float64, requires_grad=True)
    w = (1 + 0.3 * torch.randn(3, dtype=torch.float64)).requires_grad_(True)
    b = torch.randn(3, dtype=torch.float64, requires_grad=True)
    rm, rv = torch.randn(3, dtype=torch.float64), 1 + torch.rand(3, dtype=torch.float64)

    def fn(x, w, b):
        # momentum 0: running stats stay put, so repeated calls see the same function
        return ref.SyncBatchNormFunction.apply(x, w, b, rm, rv, 1e-5, 0.0, None, training)

    assert torch.autograd.gradcheck(fn, (x, w, b))
    expected = F.batch_norm(x, rm.clone(), rv.clone(), w, b, training=training, momentum=0.0)
    assert torch.allclose(fn(x, w, b), expected, atol=1e-12)


def test_hidden_files_are_the_notebooks_pieces_and_work():
    """The files the grader puts next to a student's sync_bn.py define what it imports, and
    compute the right thing (in a world of one process)."""
    import torch.distributed as dist

    files = hidden(LAB)["test_ex4_sync_bn_function"].files()
    assert set(files) == {"sync_stats.py", "sync_grad.py"}
    ns: dict = {}
    for text in files.values():
        exec(text, ns)  # noqa: S102 - the course's reference
    if dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        case = _inputs("test_ex3_sync_input_grad")["cases"][0]
        x = torch.cat(case["xs"])
        mean, var, count = ns["sync_mean_var"](*ref.local_moments(x))
        assert torch.allclose(var, torch.var_mean(x, dim=(0, 2, 3), correction=0)[0])
        assert float(count) == x.numel() // x.size(1)
        dx = ns["sync_input_grad"](
            torch.cat(case["dys"]), torch.cat(case["x_hats"]), case["invstd"], case["weight"],
            case["count"],
        )  # fmt: skip
        expected = ex3_sync_input_grad.autograd_input_grads(case["xs"], case["dys"], case["weight"])
        assert torch.allclose(dx, torch.cat(expected), atol=1e-9)
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------ visible checks


def test_visible_local_moments_check_passes_fails_and_asks_to_finish(capsys):
    ns: dict = {}
    exec(solution_sources(LAB)["ex1_local_moments"], ns)  # noqa: S102 - our own solution
    checks.local_moments(ns["local_moments"])
    assert "OK: local_moments is right" in capsys.readouterr().out
    exec(_mistake("ex1_local_moments"), ns)  # noqa: S102
    with pytest.raises(CheckFailed, match="every dimension except the channel dimension 1"):
        checks.local_moments(ns["local_moments"])

    def stub(x):
        raise NotImplementedError()

    with pytest.raises(CheckFailed, match="finish this exercise first"):
        checks.local_moments(stub)


def test_visible_distributed_checks_defer_to_the_grader_under_autograde(monkeypatch, capsys):
    monkeypatch.setenv("NBGRADER_EXECUTION", "autograde")
    checks.sync_bn_function("no_such_folder/sync_bn.py")  # no job, no error: the grader decides
    assert "run by the grader" in capsys.readouterr().out


def test_visible_checks_ask_to_finish_the_stubs_without_starting(tmp_path):
    with pytest.raises(CheckFailed, match="not found"):
        checks.sync_mean_var(str(tmp_path / "sync_stats.py"))
    (tmp_path / "sync_stats.py").write_text(f"def sync_mean_var(s, ss, n):\n    {STUB}\n")
    with pytest.raises(CheckFailed, match="finish this exercise first"):
        checks.sync_mean_var(str(tmp_path / "sync_stats.py"))
    solutions = solution_sources(LAB)
    _write(tmp_path, solutions["ex4_sync_bn_function"])
    with pytest.raises(CheckFailed, match=r"your sync_stats.py, which still holds the released"):
        checks.sync_bn_function(str(tmp_path / "sync_bn.py"))
    _write(tmp_path, solutions["ex2_sync_mean_var"])
    with pytest.raises(CheckFailed, match=r"your sync_grad.py \(exercise 3\), not found"):
        checks.sync_bn_function(str(tmp_path / "sync_bn.py"))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_visible_distributed_checks_run_the_files_under_torchrun(tmp_path, capsys):
    solutions = solution_sources(LAB)
    for cell in ("ex2_sync_mean_var", "ex3_sync_input_grad", "ex4_sync_bn_function"):
        _write(tmp_path, solutions[cell])
    checks.sync_mean_var(str(tmp_path / "sync_stats.py"))
    assert "OK: sync_mean_var gives every rank the global mean and variance on 2 ranks" in (
        capsys.readouterr().out
    )
    checks.sync_bn_function(str(tmp_path / "sync_bn.py"))  # on the student's own pieces
    assert "OK: SyncBNFunction equals BatchNorm over the global batch on 2 ranks" in (
        capsys.readouterr().out
    )
    _write(tmp_path, _mistake("ex2_sync_mean_var"))
    with pytest.raises(CheckFailed, match="the global mean: max abs difference"):
        checks.sync_mean_var(str(tmp_path / "sync_stats.py"))
    _write(tmp_path, _mistake("ex3_sync_input_grad"))
    with pytest.raises(CheckFailed, match="each rank needs the GLOBAL sums and count"):
        checks.sync_input_grad(str(tmp_path / "sync_grad.py"))


# ---------------------------------------------------------- through the real grader


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_exercise4_is_graded_on_the_reference_pieces():
    """Mistakes in exercises 2 and 3 do not cost exercise 4: the grader puts the reference
    sync_stats.py and sync_grad.py next to the student's sync_bn.py."""
    nb = notebook_with(
        LAB,
        {
            "ex2_sync_mean_var": _mistake("ex2_sync_mean_var"),
            "ex3_sync_input_grad": _mistake("ex3_sync_input_grad"),
        },
    )
    gid = "test_ex4_sync_bn_function"
    v = judge_notebook(nb, LAB, [gid], seed=SEED)[gid]
    assert v.passed, v


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_deadlocking_rank_is_stopped_and_leaves_no_process():
    grade_id = "test_ex2_sync_mean_var"
    before = set(os.listdir("/proc"))
    v = judge_notebook(notebook_with(LAB, HANGS), LAB, [grade_id], seed=SEED)[grade_id]
    assert not v.passed and "did not finish" in v.message, v
    leftovers = new_leftovers(before, f"{LAB} {grade_id}")
    assert not leftovers, f"processes of the hanging job survived: {leftovers}"


# ------------------------------------------------------------ property: any draw, any seed

PROPERTY_SEEDS = range(200)


def _typical_and_more(cell: str) -> dict[str, str]:
    return {m.name: m.source for m in MISTAKES if m.cell == cell}


def test_property_moments_verdict_does_not_depend_on_the_draw():
    gid = "test_ex1_local_moments"
    right = solution_sources(LAB)["ex1_local_moments"]
    wrongs = _typical_and_more("ex1_local_moments")
    assert len(wrongs) >= 2
    judge = _judge(gid)
    for seed in PROPERTY_SEEDS:
        inputs = _inputs(gid, seed)
        assert_verdicts(
            judge,
            seed,
            inputs,
            _moments_outputs(right, inputs),
            {k: _moments_outputs(src, inputs) for k, src in wrongs.items()},
        )


#: grade id -> (outputs of one case, the mistakes it can build)
DISTRIBUTED_OUTPUTS = {
    "test_ex2_sync_mean_var": (
        _stats_outputs,
        ["averaged", "unbiased", "no all_reduce", "local count"],
    ),
    "test_ex3_sync_input_grad": (_grad_outputs, ["local sums", "local count"]),
    "test_ex4_sync_bn_function": (
        _function_outputs,
        ["biased running var", "reduced param grads", "local backward"],
    ),
}


@pytest.mark.parametrize("grade_id", list(DISTRIBUTED_OUTPUTS))
def test_property_distributed_verdicts_do_not_depend_on_the_draw(grade_id):
    """200 draws: every rank's right outputs (simulated in this process) pass the grader's
    full judge; each typical mistake fails it."""
    outputs_of, mistaken = DISTRIBUTED_OUTPUTS[grade_id]
    judge = _judge(grade_id)
    for seed in PROPERTY_SEEDS:
        inputs = _inputs(grade_id, seed)
        assert_verdicts(
            judge,
            seed,
            inputs,
            _outputs(outputs_of, inputs),
            {k: _outputs(outputs_of, inputs, k) for k in mistaken},
        )
