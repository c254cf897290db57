"""Checks of lab 4 (SyncBatchNorm): visible checks for the test cells and the ``EXERCISES``.

Four exercises, independent of each other (each runs only its own solution cell):

1. ``local_moments(x)`` (a function in the notebook): per-channel sum, sum of squares and
   count of one rank's batch;
2. ``sync_mean_var(s, ss, n)`` (file ``sync_stats.py``, every rank): the global mean and
   biased variance from all-reduced moments, ranks holding different batch sizes;
3. ``sync_input_grad(dy, x_hat, invstd, weight, count)`` (file ``sync_grad.py``, every
   rank): BatchNorm's input gradient from all-reduced gradient sums;
4. ``SyncBNFunction`` (file ``sync_bn.py``, every rank): the whole autograd Function, equal
   to ``nn.BatchNorm`` over the concatenated global batch (outputs, input, weight and bias
   gradients, running statistics).

Judges compare with float64 references computed from the global batch (``torch.var_mean``,
autograd through ``F.batch_norm``); they never use the student's numbers as a reference.
The visible checks of the distributed exercises run the student's file under ``torchrun``
(2 ranks, fixed inputs) with the grader's own rank worker and judge, so what they print is
what the grader would say on those inputs.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from ddp_lab.checks import CheckFailed, assert_close, make_verdict, passed
from ddp_lab.grading.exercise import Exercise

LAB = "lab04_syncbn"
verdict = make_verdict(LAB)

#: Files the notebook's distributed solution cells write (``%%writefile``).
STATS_FILE, GRAD_FILE, FUNCTION_FILE = "sync_stats.py", "sync_grad.py", "sync_bn.py"
#: Seed of the fixed inputs the visible checks use (the grader draws fresh ones).
VISIBLE_SEED = 4
#: Seconds a visible check's torchrun job may take (a few normally; a deadlock is cut here).
VISIBLE_TIMEOUT_S = 45
#: True while ``nbgrader autograde`` runs the notebook (the grader, not a student). The
#: notebook then skips its torchrun demonstrations and the visible checks skip their torchrun
#: jobs: they teach, the grader's verdicts decide, and each would cost seconds of every
#: student's grading time.
GRADING = os.environ.get("NBGRADER_EXECUTION") == "autograde"
#: How far apart the ranks' data are (per rank, in units of the noise): shards that are not
#: identically distributed make averaging per-rank statistics visibly wrong.
RANK_SHIFT = 1.5
EPS = 1e-5


# ------------------------------------------------------------------------------- helpers


def _int(gen: torch.Generator, lo: int, hi: int) -> int:
    """A random integer in ``[lo, hi]``."""
    return int(torch.randint(lo, hi + 1, (1,), generator=gen))


def _sizes(gen: torch.Generator, world: int, lo: int, hi: int, empty: bool = False) -> list[int]:
    """Per-rank batch sizes in ``[lo, hi]``; one rank empty with ``empty``; the non-empty
    ranks' sizes not all equal (else averaging the ranks' statistics would be right)."""
    while True:
        sizes = [_int(gen, lo, hi) for _ in range(world)]
        if empty:
            sizes[_int(gen, 0, world - 1)] = 0
        if len({s for s in sizes if s}) > 1:
            return sizes


def _rank_batches(
    gen: torch.Generator, sizes: list[int], channels: int, tail: tuple[int, ...]
) -> list[torch.Tensor]:
    """float64 batches ``(n_r, C, *tail)``, one per rank; rank r's data shifted by r * SHIFT."""
    offsets = torch.randn(channels, generator=gen, dtype=torch.float64) * 2
    view = (1, channels, *([1] * len(tail)))
    return [
        (1 + torch.rand(1, generator=gen, dtype=torch.float64))
        * torch.randn(n, channels, *tail, generator=gen, dtype=torch.float64)
        + offsets.reshape(view)
        + RANK_SHIFT * r
        for r, n in enumerate(sizes)
    ]


def _dims(x: torch.Tensor) -> list[int]:
    return [0, *range(2, x.dim())]


def _view(t: torch.Tensor, ndim: int) -> torch.Tensor:
    return t.reshape(1, -1, *([1] * (ndim - 2)))


def _plain(obj):
    """What a student function returned, made saveable with ``weights_only=True``."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, (list, tuple)):
        return [_plain(o) for o in obj]
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if hasattr(obj, "tolist"):  # numpy arrays and scalars
        return torch.as_tensor(obj.tolist(), dtype=torch.float64)
    return f"<a {type(obj).__name__}>"


def _triple(got, what: str) -> list:
    if not isinstance(got, (list, tuple)) or len(got) != 3:
        kind = f"{len(got)} values" if isinstance(got, (list, tuple)) else repr(got)[:60]
        raise CheckFailed(f"{what} should return 3 values, got {kind}")
    return list(got)


def _number(value, what: str) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.reshape(()).item())
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise CheckFailed(f"{what}: expected a number (or a one-element tensor), got {value!r:.60}")


def _global_stats(xs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean, biased variance and ``invstd`` of the concatenated global batch (float64)."""
    x = torch.cat(xs)
    var, mean = torch.var_mean(x, dim=_dims(x), correction=0)
    return mean, var, (var + EPS).rsqrt()


def _close(a, b, atol: float) -> bool:
    return (
        isinstance(a, torch.Tensor)
        and a.shape == b.shape
        and bool(torch.isfinite(a).all())
        and bool(((a.double() - b.double()).abs() <= atol + 1e-6 * b.double().abs()).all())
    )


def _sizes_text(case: dict) -> str:
    return f"{case['world_size']} ranks holding {case['sizes']} samples"


# --------------------------------------------------------------- exercise 1: local moments


def reference_local_moments(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Per-channel sum, sum of squares (float64) and element count per channel."""
    x64 = x.double()
    return x64.sum(_dims(x)), (x64 * x64).sum(_dims(x)), float(x.numel() // x.size(1))


def _judge_moments(xs: list[torch.Tensor], got: list) -> str:
    if not isinstance(got, list) or len(got) != len(xs):
        raise CheckFailed(f"expected one result per input ({len(xs)}), got {got!r:.80}")
    for x, result in zip(xs, got, strict=True):
        what = f"local_moments(x) for x of shape {tuple(x.shape)}"
        s, ss, n = _triple(result, what)
        exp_s, exp_ss, exp_n = reference_local_moments(x)
        hint = ""
        if isinstance(s, torch.Tensor) and s.shape != exp_s.shape:
            hint = (
                f" (one value per channel: sum over every dimension except the channel "
                f"dimension 1, i.e. dims {_dims(x)})"
            )
        try:
            assert_close(s, exp_s, f"{what}: the sum", atol=1e-9, rtol=1e-9)
            assert_close(ss, exp_ss, f"{what}: the sum of squares", atol=1e-9, rtol=1e-9)
        except CheckFailed as err:
            raise CheckFailed(f"{err}{hint}") from None
        count = _number(n, f"{what}: the count")
        if count != exp_n:
            per = " x ".join(str(d) for d in (x.size(0), *x.shape[2:]))
            raise CheckFailed(
                f"{what}: the count should be the number of values per channel, "
                f"{per} = {exp_n:g}; got {count:g}"
            )
    shapes = ", ".join(str(tuple(x.shape)) for x in xs)
    return f"local_moments is right for inputs of shapes {shapes}"


def local_moments(fn) -> None:
    """Visible check of exercise 1: ``fn`` on a few fixed inputs, one of them empty."""
    xs = _moments_inputs(torch.Generator().manual_seed(VISIBLE_SEED))["xs"]
    passed(_judge_moments(xs, [_plain(fn(x.clone())) for x in xs]))


def _moments_inputs(gen: torch.Generator) -> dict:
    c = _int(gen, 2, 5)
    shapes = [
        (_int(gen, 2, 8), c),
        (_int(gen, 1, 6), c, _int(gen, 2, 5)),
        (_int(gen, 1, 6), c, _int(gen, 2, 4), _int(gen, 2, 4)),
        (0, c, _int(gen, 1, 3), _int(gen, 1, 3)),  # a rank may hold no sample at all
    ]
    return {
        "xs": [
            2 * torch.randn(*shape, generator=gen, dtype=torch.float64) + _int(gen, -2, 2)
            for shape in shapes
        ]
    }


def _moments_run(ns: dict, inputs: dict, workdir: Path) -> dict:
    fn = ns["local_moments"]
    return {"results": [_plain(fn(x.clone())) for x in inputs["xs"]]}


def _moments_judge(inputs: dict, outputs: dict) -> str:
    return _judge_moments(inputs["xs"], outputs["results"])


# -------------------------------------------------- exercise 2: global mean and variance


def _stats_case(gen: torch.Generator, world: int, tail: tuple[int, ...], empty: bool) -> dict:
    sizes = _sizes(gen, world, 1, 8, empty=empty)
    xs = _rank_batches(gen, sizes, _int(gen, 2, 5), tail)
    return {"world_size": world, "sizes": sizes, "xs": xs}


def _stats_inputs(gen: torch.Generator) -> dict:
    # One job of 3 ranks (every torchrun job costs seconds): different batch sizes, one
    # rank holding no sample at all.
    return {"cases": [_stats_case(gen, 3, (_int(gen, 1, 3), _int(gen, 1, 3)), empty=True)]}


def _stats_visible_inputs(gen: torch.Generator) -> dict:
    return {"cases": [_stats_case(gen, 2, (), empty=False)]}


def _stats_run_rank(ns: dict, inputs: dict, case: dict, rank: int, world: int):
    from ddp_lab.grading.student import load_module_file
    from ddp_lab.syncbn import local_moments as moments

    fn = load_module_file(STATS_FILE)["sync_mean_var"]
    s, ss, n = moments(case["xs"][rank])
    return _plain(fn(s.clone(), ss.clone(), n.clone()))


def _averaged_per_rank(xs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The classic mistake: the plain average of the (non-empty) ranks' means and variances."""
    pairs = [torch.var_mean(x, dim=_dims(x), correction=0) for x in xs if len(x)]
    var = torch.stack([v for v, _ in pairs]).mean(0)
    mean = torch.stack([m for _, m in pairs]).mean(0)
    return mean, var


def _stats_judge(inputs: dict, outputs: dict) -> str:
    for case, got in zip(inputs["cases"], outputs["cases"], strict=True):
        xs = case["xs"]
        mean, var, _ = _global_stats(xs)
        count = float(sum(x.numel() // x.size(1) for x in xs))
        wrong_mean, wrong_var = _averaged_per_rank(xs)
        for rank, result in enumerate(got):
            what = f"sync_mean_var on rank {rank} ({_sizes_text(case)})"
            m, v, n = _triple(result, what)
            right = _close(m, mean, 1e-9) and _close(v, var, 1e-9)
            if not right and (_close(m, wrong_mean, 1e-9) or _close(v, wrong_var, 1e-9)):
                raise CheckFailed(
                    f"{what}: you averaged the ranks' means or variances; that is wrong when "
                    "ranks hold different numbers of samples (or data that differ). "
                    "All-reduce the sums and the count, then divide."
                )
            if isinstance(m, torch.Tensor) and not bool(torch.isfinite(m).all()):
                raise CheckFailed(
                    f"{what}: the mean contains NaN or inf (a rank with 0 samples has no "
                    "mean of its own: all-reduce sums and counts, not means)"
                )
            assert_close(m, mean, f"{what}: the global mean", atol=1e-9, rtol=1e-9)
            assert_close(v, var, f"{what}: the global (biased) variance", atol=1e-9, rtol=1e-9)
            got_n = _number(n, f"{what}: the global count")
            if got_n != count:
                raise CheckFailed(f"{what}: the global count should be {count:g}, got {got_n:g}")
    worlds = " and ".join(str(c["world_size"]) for c in inputs["cases"])
    return f"sync_mean_var gives every rank the global mean and variance on {worlds} ranks"


def sync_mean_var(path: str = STATS_FILE) -> None:
    """Visible check of exercise 2: run ``path`` on 2 ranks (torchrun) with fixed inputs."""
    _visible("test_ex2_sync_mean_var", path, _stats_visible_inputs)


# ----------------------------------------------------------- exercise 3: input gradient


def _grad_case(gen: torch.Generator, world: int, tail: tuple[int, ...]) -> dict:
    c = _int(gen, 2, 4)
    sizes = _sizes(gen, world, 1, 6)
    xs = _rank_batches(gen, sizes, c, tail)
    mean, _, invstd = _global_stats(xs)
    nd = xs[0].dim()
    return {
        "world_size": world,
        "sizes": sizes,
        "xs": xs,
        "dys": [torch.randn(x.shape, generator=gen, dtype=torch.float64) for x in xs],
        "x_hats": [(x - _view(mean, nd)) * _view(invstd, nd) for x in xs],
        "invstd": invstd,
        "weight": 0.5 + torch.rand(c, generator=gen, dtype=torch.float64),
        "count": float(sum(x.numel() // c for x in xs)),
    }


def _grad_inputs(gen: torch.Generator) -> dict:
    # One job of 3 ranks with different batch sizes (every torchrun job costs seconds).
    return {"cases": [_grad_case(gen, 3, (_int(gen, 1, 3), _int(gen, 1, 3)))]}


def _grad_visible_inputs(gen: torch.Generator) -> dict:
    return {"cases": [_grad_case(gen, 2, (_int(gen, 1, 3),))]}


def _grad_run_rank(ns: dict, inputs: dict, case: dict, rank: int, world: int):
    from ddp_lab.grading.student import load_module_file

    fn = load_module_file(GRAD_FILE)["sync_input_grad"]
    out = fn(
        case["dys"][rank].clone(),
        case["x_hats"][rank].clone(),
        case["invstd"].clone(),
        case["weight"].clone(),
        case["count"],
    )
    return _plain(out)


def reference_input_grads(
    xs: list[torch.Tensor], dys: list[torch.Tensor], weight: torch.Tensor
) -> list[torch.Tensor]:
    """BatchNorm's input gradient over the concatenated batch, by autograd, split by rank."""
    x = torch.cat(xs).double().requires_grad_(True)
    y = F.batch_norm(x, None, None, weight.double(), None, training=True, eps=EPS)
    (y * torch.cat(dys).double()).sum().backward()
    return list(x.grad.split([len(t) for t in xs]))


def _local_input_grad(dy, x_hat, invstd, weight, count):
    """The mistake of exercise 3: this rank's sums instead of the global ones."""
    dims, nd = _dims(dy), dy.dim()
    mean_dy = _view(dy.sum(dims) / count, nd)
    mean_dy_xhat = _view((dy * x_hat).sum(dims) / count, nd)
    return _view(weight * invstd, nd) * (dy - mean_dy - x_hat * mean_dy_xhat)


def _grad_judge(inputs: dict, outputs: dict) -> str:
    for case, got in zip(inputs["cases"], outputs["cases"], strict=True):
        expected = reference_input_grads(case["xs"], case["dys"], case["weight"])
        for rank, dx in enumerate(got):
            what = f"sync_input_grad on rank {rank} ({_sizes_text(case)})"
            local_n = case["dys"][rank].numel() / case["weight"].numel()
            args = (case["dys"][rank], case["x_hats"][rank], case["invstd"], case["weight"])
            if not _close(dx, expected[rank], 1e-9):
                if _close(dx, _local_input_grad(*args, case["count"]), 1e-9) or _close(
                    dx, _local_input_grad(*args, local_n), 1e-9
                ):
                    raise CheckFailed(
                        f"{what}: you used this rank's sum(dy) and sum(dy * x_hat); every "
                        "sample of the global batch moves the mean and the variance, so "
                        "both sums must be all-reduced over the ranks"
                    )
            assert_close(dx, expected[rank], f"{what}: the input gradient", atol=1e-9, rtol=1e-7)
    worlds = " and ".join(str(c["world_size"]) for c in inputs["cases"])
    return (
        f"sync_input_grad equals BatchNorm's input gradient over the global batch ({worlds} ranks)"
    )


def sync_input_grad(path: str = GRAD_FILE) -> None:
    """Visible check of exercise 3: run ``path`` on 2 ranks (torchrun) with fixed inputs."""
    _visible("test_ex3_sync_input_grad", path, _grad_visible_inputs)


# -------------------------------------------------------- exercise 4: the whole Function

STEPS = 2


def _function_case(gen: torch.Generator, world: int, tail: tuple[int, ...]) -> dict:
    c = _int(gen, 2, 4)
    sizes = _sizes(gen, world, 1, 5)
    return {
        "world_size": world,
        "sizes": sizes,
        "xs": [_rank_batches(gen, sizes, c, tail) for _ in range(STEPS)],
        "dys": [
            [torch.randn(n, c, *tail, generator=gen, dtype=torch.float64) for n in sizes]
            for _ in range(STEPS)
        ],
        "weight": 0.5 + torch.rand(c, generator=gen, dtype=torch.float64),
        "bias": torch.randn(c, generator=gen, dtype=torch.float64),
        "running_mean": 0.2 * torch.randn(c, generator=gen, dtype=torch.float64),
        "running_var": 1 + torch.rand(c, generator=gen, dtype=torch.float64),
        "momentum": [0.1, 0.2, 0.3][_int(gen, 0, 2)],
    }


def _function_inputs(gen: torch.Generator) -> dict:
    return {
        "cases": [
            _function_case(gen, 2, (_int(gen, 1, 3), _int(gen, 1, 3))),
            _function_case(gen, 3, ()),
        ]
    }


def _refuse(what: str):
    def refuse(*args, **kwargs):
        raise RuntimeError(
            f"{what} is the finished reference and is not allowed in this exercise: assemble "
            "the Function from the pieces (local_moments, all_reduce_packed, ...)"
        )

    return refuse


def _disable_finished_reference() -> None:
    """Make ``ddp_lab.syncbn``'s complete Function and module raise (student process only).

    Exercise 4 may use the pieces of ``ddp_lab.syncbn`` but not the finished answer.
    """
    from ddp_lab import syncbn

    syncbn.SyncBatchNormFunction.forward = staticmethod(_refuse("SyncBatchNormFunction"))
    syncbn.SyncBatchNormFunction.backward = staticmethod(_refuse("SyncBatchNormFunction"))
    syncbn.SyncBatchNorm.forward = _refuse("ddp_lab.syncbn.SyncBatchNorm")


def _function_visible_inputs(gen: torch.Generator) -> dict:
    return {"cases": _function_inputs(gen)["cases"][:1]}


def _function_run_rank(ns: dict, inputs: dict, case: dict, rank: int, world: int):
    from ddp_lab.grading.student import load_module_file

    _disable_finished_reference()
    fn = load_module_file(FUNCTION_FILE)["SyncBNFunction"]
    weight = case["weight"].clone().requires_grad_(True)
    bias = case["bias"].clone().requires_grad_(True)
    running_mean, running_var = case["running_mean"].clone(), case["running_var"].clone()
    out: dict = {"y": [], "grad_x": [], "grad_weight": [], "grad_bias": []}
    for xs, dys in zip(case["xs"], case["dys"], strict=True):
        x = xs[rank].clone().requires_grad_(True)
        y = fn.apply(x, weight, bias, running_mean, running_var, case["momentum"], EPS)
        out["y"].append(_plain(y))
        if isinstance(y, torch.Tensor) and y.requires_grad and y.shape == dys[rank].shape:
            (y * dys[rank]).sum().backward()
        out["grad_x"].append(_plain(x.grad))
        out["grad_weight"].append(_plain(weight.grad))
        out["grad_bias"].append(_plain(bias.grad))
        weight.grad = bias.grad = None
    out["running_mean"], out["running_var"] = _plain(running_mean), _plain(running_var)
    return out


def reference_batchnorm(case: dict) -> dict:
    """``nn.BatchNorm`` (functional, float64) over the concatenated global batch, step by step.

    Returns per step the output and input gradient split by rank, the *local* weight and
    bias gradients of every rank (the sums over its own slice: what the Function returns,
    since DDP all-reduces parameter gradients itself), and the final running statistics.
    """
    running_mean, running_var = case["running_mean"].clone(), case["running_var"].clone()
    sizes = case["sizes"]
    ref: dict = {"y": [], "grad_x": [], "grad_weight": [], "grad_bias": []}
    for xs, dys in zip(case["xs"], case["dys"], strict=True):
        x = torch.cat(xs).requires_grad_(True)
        weight = case["weight"].clone().requires_grad_(True)
        bias = case["bias"].clone().requires_grad_(True)
        y = F.batch_norm(x, running_mean, running_var, weight, bias, True, case["momentum"], EPS)
        dy = torch.cat(dys)
        (y * dy).sum().backward()
        var, mean = torch.var_mean(x.detach(), dim=_dims(x), correction=0)
        x_hat = (x.detach() - _view(mean, x.dim())) * _view((var + EPS).rsqrt(), x.dim())
        ref["y"].append(list(y.detach().split(sizes)))
        ref["grad_x"].append(list(x.grad.split(sizes)))
        ref["grad_weight"].append(
            [
                (d * h).sum(_dims(d))
                for d, h in zip(dy.split(sizes), x_hat.split(sizes), strict=True)
            ]
        )
        ref["grad_bias"].append([d.sum(_dims(d)) for d in dy.split(sizes)])
        # the classic mistake's running variance, for the message: biased instead of unbiased
        ref.setdefault("biased_var", []).append(var)
    ref["running_mean"], ref["running_var"] = running_mean, running_var
    return ref


def _biased_running_var(case: dict, ref: dict) -> torch.Tensor:
    r = case["running_var"].clone()
    for var in ref["biased_var"]:
        r = (1 - case["momentum"]) * r + case["momentum"] * var
    return r


def _function_judge(inputs: dict, outputs: dict) -> str:
    worst = 0.0
    tol = {"atol": 1e-6, "rtol": 1e-6}
    for case, got in zip(inputs["cases"], outputs["cases"], strict=True):
        ref = reference_batchnorm(case)
        for rank, out in enumerate(got):
            if not isinstance(out, dict):
                raise CheckFailed(f"rank {rank}: unexpected result {out!r:.80}")
            where = f"rank {rank} ({_sizes_text(case)})"
            for step in range(STEPS):
                at = f"{where}, step {step + 1}"
                assert_close(out["y"][step], ref["y"][step][rank], f"{at}: the output", **tol)
                if out["grad_x"][step] is None:
                    raise CheckFailed(
                        f"{at}: x got no gradient; backward must return the input gradient "
                        "first (and forward's output must depend on x through autograd's "
                        "Function, not through a detached copy)"
                    )
                assert_close(
                    out["grad_x"][step],
                    ref["grad_x"][step][rank],
                    f"{at}: the input gradient",
                    **tol,
                )
                for name in ("grad_weight", "grad_bias"):
                    g, e = out[name][step], ref[name][step][rank]
                    total = sum(ref[name][step])
                    if _close(g, total, 1e-6) and not _close(g, e, 1e-6):
                        raise CheckFailed(
                            f"{at}: {name} is the sum over ALL ranks; return this rank's own "
                            "sum (DistributedDataParallel all-reduces parameter gradients "
                            "itself, so reducing them here counts them twice)"
                        )
                    if g is None:
                        raise CheckFailed(f"{at}: {name.replace('grad_', '')} got no gradient")
                    assert_close(g, e, f"{at}: {name} (this rank's local sum)", **tol)
                    worst = max(worst, float((g - e).abs().max()))
                worst = max(
                    worst,
                    float((out["y"][step] - ref["y"][step][rank]).abs().max()),
                    float((out["grad_x"][step] - ref["grad_x"][step][rank]).abs().max()),
                )
            assert_close(
                out["running_mean"],
                ref["running_mean"],
                f"{where}: running_mean after {STEPS} steps",
                **tol,
            )
            if not _close(out["running_var"], ref["running_var"], 1e-6) and _close(
                out["running_var"], _biased_running_var(case, ref), 1e-9
            ):
                raise CheckFailed(
                    f"{where}: running_var was updated with the biased variance; BatchNorm "
                    "normalises with the biased one but tracks the UNBIASED one, var * n / "
                    f"(n - 1) with n the global count (momentum {case['momentum']})"
                )
            assert_close(
                out["running_var"],
                ref["running_var"],
                f"{where}: running_var after {STEPS} steps",
                **tol,
            )
            for key in ("running_mean", "running_var"):
                worst = max(worst, float((out[key] - ref[key]).abs().max()))
    return (
        "SyncBNFunction equals BatchNorm over the global batch on 2 and 3 ranks (outputs, "
        f"input/weight/bias gradients, running stats; max abs difference {worst:.1e})"
    )


def sync_bn_function(path: str = FUNCTION_FILE) -> None:
    """Visible check of exercise 4: run ``path`` on 2 ranks (torchrun) with fixed inputs."""
    _visible("test_ex4_sync_bn_function", path, _function_visible_inputs)


# --------------------------------------------------------------- visible distributed checks


def _visible(grade_id: str, path: str, make_inputs) -> None:
    """Run a distributed exercise's rank worker on the student's file, on fixed inputs.

    The grader's own worker (``ddp_lab.grading.student --rank-worker``) runs under
    ``torchrun`` in the current folder, where the notebook's ``%%writefile`` cell put
    ``path``, on one small case (2 ranks) of ``make_inputs``; the exercise's judge then
    compares the outputs. The grader runs more ranks on fresh inputs.
    """
    from ddp_lab.launch import LaunchError, torchrun

    if os.environ.get("NBGRADER_EXECUTION") == "autograde":  # the verdict below decides
        print(f"{path}: run by the grader outside this kernel (see its verdict below)")
        return
    ex = next(e for e in EXERCISES if e.grade_id == grade_id)
    if not Path(path).is_file():
        raise CheckFailed(f"{path} not found in {os.getcwd()}: run the %%writefile cell first")
    inputs = make_inputs(torch.Generator().manual_seed(VISIBLE_SEED))
    world_size = inputs["cases"][0]["world_size"]
    with tempfile.TemporaryDirectory(prefix="ddp_lab-check-") as tmp:
        work = Path(tmp)
        torch.save(inputs, work / "inputs.pt")
        (work / "cells.json").write_text(json.dumps(dict.fromkeys(ex.cells, "")))
        try:
            torchrun(
                "ddp_lab.grading.student",
                ["--rank-worker", LAB, grade_id, str(work), "0"],
                nproc=world_size,
                module=True,
                timeout=VISIBLE_TIMEOUT_S,
                stream=False,
            )
        except LaunchError as err:
            lines = [ln for ln in str(err).splitlines() if ln.strip()]
            errors = [ln for ln in lines if "Error" in ln or "error" in ln]
            raise CheckFailed(
                f"running {path} on {world_size} ranks failed: " + "\n".join((errors or lines)[-3:])
            ) from None
        outputs = {
            "cases": [
                [
                    torch.load(work / f"case0-rank{r}.pt", weights_only=True)
                    for r in range(world_size)
                ]
            ]
        }
    passed(ex.judge(inputs, outputs).replace("on 2 and 3 ranks", f"on {world_size} ranks"))


EXERCISES = [
    Exercise(
        "test_ex1_local_moments",
        ("ex1_local_moments",),
        "per-channel sum, sum of squares and count of one rank's batch",
        _moments_inputs,
        _moments_judge,
        run=_moments_run,
        forbid_modules=("ddp_lab.syncbn",),
        timeout=60,
    ),
    Exercise(
        "test_ex2_sync_mean_var",
        ("ex2_sync_mean_var",),
        "global mean and variance from all-reduced moments, unequal batch sizes",
        _stats_inputs,
        _stats_judge,
        run_rank=_stats_run_rank,
        forbid_modules=("ddp_lab.syncbn",),
        timeout=60,
    ),
    Exercise(
        "test_ex3_sync_input_grad",
        ("ex3_sync_input_grad",),
        "BatchNorm's input gradient from all-reduced gradient sums",
        _grad_inputs,
        _grad_judge,
        run_rank=_grad_run_rank,
        forbid_modules=("ddp_lab.syncbn",),
        timeout=60,
    ),
    Exercise(
        "test_ex4_sync_bn_function",
        ("ex4_sync_bn_function",),
        "synchronised BatchNorm as an autograd Function equals BatchNorm on the global batch",
        _function_inputs,
        _function_judge,
        run_rank=_function_run_rank,
        timeout=90,
    ),
]

__all__ = [
    "LAB",
    "EXERCISES",
    "verdict",
    "local_moments",
    "sync_mean_var",
    "sync_input_grad",
    "sync_bn_function",
    "reference_local_moments",
    "reference_input_grads",
    "reference_batchnorm",
]
