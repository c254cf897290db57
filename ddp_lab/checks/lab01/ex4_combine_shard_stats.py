"""Exercise 4, ``combine_shard_stats(means, variances, counts)``: the mean and biased variance
of a whole batch from its shards' means, biased variances and counts, numerically safe.

The oracle is the samples themselves: every case keeps its shards' samples, stored as a
reference point (a shard's centre) and each sample's offset from it (float64, exact), and
the answer is their mean and biased variance computed from the offsets, so the oracle loses
nothing to a large offset. The student gets the shard statistics in the case's dtype. The
tolerance is what a numerically safe computation in that dtype may lose: a few roundings of
numbers as large as the means (times the spread, for the variance), plus a small share of
the variance. A right answer also comes back in the dtype of ``means``, as the docstring
promises (upcasting to float64 and handing that back is caught here, and only here).

The fixed case set, random values inside: one shard (its own statistics); two shards of
unequal counts whose means lie at least 3 apart (the plain averages, and the average of the
variances alone, are wrong); three shards, one of a single sample (variance 0), float32;
four to six shards of float32 data far from 0 (means of 1e4 to 3e4: ``E[x^2] - mean^2``
loses the variance to rounding); three to five shards of float64 data very far from 0
(means of 1e8 to 1e9: the same in float64, so computing in float64 does not save it); and
shards where some replicas had no data (count 0, statistics NaN, as torch computes them for
an empty tensor). One feature in some cases, up to six in others.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ddp_lab.checks.contract import Exercise
from ddp_lab.checks.failure import CheckFailed, require
from ddp_lab.checks.lab01.common import DTYPES
from ddp_lab.checks.values import kind, plain, randint, uniform

#: dtype -> relative tolerance of the variance (and of the mean, in units of the spread).
RTOL = {"float32": 1e-4, "float64": 1e-6}
EPS = {"float32": torch.finfo(torch.float32).eps, "float64": torch.finfo(torch.float64).eps}


def _case(gen, counts: list[int], channels: int, dtype: str, offset: float, what: str) -> dict:
    """Shards of ``counts`` samples centred near ``offset``; shards 0 and 1 at least 3 apart.
    Shard 0 is never empty."""
    n = len(counts)
    centres = offset + 2 * torch.randn(n, channels, generator=gen, dtype=torch.float64)
    if n > 1:
        apart = 3 + torch.rand(channels, generator=gen, dtype=torch.float64)
        sign = torch.where(torch.rand(channels, generator=gen) < 0.5, -1.0, 1.0).double()
        centres[1] = centres[0] + sign * apart
    centres = centres.to(DTYPES[dtype]).double()  # representable: the given means are exact
    scale = 0.5 + 2 * torch.rand(channels, generator=gen, dtype=torch.float64)
    ref = centres[0]
    rel, means, variances = [], [], []
    for k, count in enumerate(counts):
        z = torch.randn(count, channels, generator=gen, dtype=torch.float64)
        dev = scale * (z - z.mean(0))  # mean 0: shard k's mean is centres[k]
        rel.append((centres[k] - ref) + dev)
        nan = torch.full((channels,), math.nan, dtype=torch.float64)  # torch's for no data
        means.append(centres[k] if count else nan)
        variances.append(dev.pow(2).mean(0) if count else nan)
    return {
        "what": what,
        "dtype": dtype,
        "means": torch.stack(means).to(DTYPES[dtype]),
        "variances": torch.stack(variances).to(DTYPES[dtype]),
        "counts": torch.tensor(counts),
        "ref": ref,
        "rel": torch.cat(rel),
    }


def _counts(gen, n: int, low: int = 1, high: int = 20) -> list[int]:
    while True:
        counts = [randint(gen, low, high) for _ in range(n)]
        if len(set(counts)) > 1:
            return counts


def make_inputs(gen: torch.Generator) -> dict:
    """Six cases: one shard; two; three with a single sample (float32); many far from 0
    (float32); several very far from 0 (float64); empty shards (float32)."""
    single = _counts(gen, 3, 2, 20)
    single[randint(gen, 1, 2)] = 1
    empty = _counts(gen, randint(gen, 2, 3)) + [0] * randint(gen, 1, 2)
    return {
        "cases": [
            _case(gen, [randint(gen, 2, 30)], randint(gen, 1, 3), "float64", 0.0, "one shard"),
            _case(gen, _counts(gen, 2), 1, "float64", 0.0, "two shards"),
            _case(gen, single, randint(gen, 3, 6), "float32", 0.0, "a shard of one sample"),
            _case(
                gen,
                _counts(gen, randint(gen, 4, 6), 5, 60),
                randint(gen, 1, 4),
                "float32",
                uniform(gen, 1e4, 3e4),
                "float32 data far from 0",
            ),
            _case(
                gen,
                _counts(gen, randint(gen, 3, 5), 5, 60),
                randint(gen, 1, 4),
                "float64",
                uniform(gen, 1e8, 1e9),
                "float64 data very far from 0",
            ),
            _case(gen, empty, randint(gen, 1, 3), "float32", 0.0, "replicas without data"),
        ]
    }


def visible_inputs(gen: torch.Generator) -> dict:
    """Shards of 6, 3 and 1 samples (float64), float32 shards of 40, 25 and 9 samples near
    20000, and shards of 5, 2 and 0 samples (float32)."""
    return {
        "cases": [
            _case(gen, [6, 3, 1], 2, "float64", 0.0, "three shards"),
            _case(gen, [40, 25, 9], 2, "float32", 2e4, "float32 data far from 0"),
            _case(gen, [5, 2, 0], 2, "float32", 0.0, "a replica without data"),
        ]
    }


def run(ns: dict, inputs: dict, workdir: Path | None) -> dict:
    """Call the student's function on copies of each case's shard statistics."""
    out = []
    for case in inputs["cases"]:
        got = ns["combine_shard_stats"](
            case["means"].clone(), case["variances"].clone(), case["counts"].clone()
        )
        if not isinstance(got, (list, tuple)) or len(got) != 2:
            out.append({"mean": plain(got), "var": "<not a (mean, var) pair>"})
        else:
            out.append({"mean": plain(got[0]), "var": plain(got[1])})
    return {"cases": out}


def truth(case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The samples' mean and biased variance (from their offsets to the reference point)."""
    rel = case["rel"]
    return case["ref"] + rel.mean(0), rel.var(0, unbiased=False)


def _scales(case: dict) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Per feature: how large the numbers are, how far they spread; and the shard count."""
    rel = case["rel"]
    big = case["ref"].abs() + rel.abs().max(0).values
    spread = (rel - rel.mean(0)).abs().max(0).values
    return big, spread, len(case["counts"])


def mean_tolerance(case: dict) -> torch.Tensor:
    """Per feature: a few roundings of numbers as large as the means, plus a share of the
    spread (a plain average of the means misses by about the spread)."""
    big, spread, n = _scales(case)
    return 4 * n * EPS[case["dtype"]] * big + RTOL[case["dtype"]] * spread


def var_tolerance(case: dict) -> torch.Tensor:
    """Per feature: a few roundings of numbers as large as the means, times the spread
    (merging shards one after another loses up to about a quarter of one such rounding;
    deviations from one mean lose less), plus a share of the variance. A formula that
    subtracts two large numbers (``E[x^2] - mean^2``) misses by about ``eps * mean^2``: over
    60 times more on this case set's data far from 0."""
    big, spread, _ = _scales(case)
    return 4 * EPS[case["dtype"]] * big * spread + RTOL[case["dtype"]] * truth(case)[1]


def within(got, expected: torch.Tensor, tol: torch.Tensor) -> bool:
    """``got`` is a finite tensor of ``expected``'s shape within ``tol``, feature by feature."""
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(expected.shape):
        return False
    g = got.detach().double()
    return bool(torch.isfinite(g).all()) and bool(((g - expected).abs() <= tol).all())


def describe(case: dict) -> str:
    """``combine_shard_stats for shards of [6, 3, 1] samples (float64)``."""
    counts = [int(c) for c in case["counts"]]
    return f"combine_shard_stats for shards of {counts} samples ({case['what']}, {case['dtype']})"


def _diagnose(case: dict, got_mean, got_var, mean, var) -> None:
    """Name the typical wrong answers (only called on a wrong answer)."""
    what, counts = describe(case), [int(c) for c in case["counts"]]
    full = [k for k, c in enumerate(counts) if c]
    means, variances = case["means"].double()[full], case["variances"].double()[full]
    empty = [k for k, c in enumerate(counts) if c == 0]
    for name, value in (("mean", got_mean), ("variance", got_var)):
        if isinstance(value, torch.Tensor) and not bool(torch.isfinite(value.double()).all()):
            require(
                not empty,
                f"{what}: your {name} holds NaN. Shard(s) {empty} are empty (a replica with no "
                "data): their mean and variance are NaN (0/0), and NaN times a weight of 0 is "
                "still NaN. Leave such shards out",
            )
    if not within(got_mean, mean, mean_tolerance(case)):
        require(
            not within(got_mean, means.mean(0), mean_tolerance(case)),
            f"{what}: your mean is the plain average of the shard means; a shard of "
            f"{max(counts)} samples must count more than one of {min(c for c in counts if c)}",
        )
        require(
            float(case["ref"].abs().max()) < 1e3,
            f"{what}: your mean is off by {float((got_mean.double() - mean).abs().max()):.3g} "
            f"on data far from 0 (|mean| about {float(case['ref'].abs().max()):.3g}): there "
            "every rounding shows; keep the counts, weights and sums in the dtype of means "
            "(counts.float() rounds float64 weights to float32)",
        )
        return
    tol = var_tolerance(case)
    require(
        not within(got_var, variances.mean(0), tol),
        f"{what}: your variance is the plain average of the shard variances: it leaves out "
        "how far the shard means lie from the batch mean (and a shard of one sample counts "
        "as much as a big one)",
    )
    total = sum(counts)
    require(
        not within(got_var, var * total / (total - 1), tol),
        f"{what}: that is the unbiased variance (divided by B - 1); BatchNorm normalises with "
        "the biased one (divided by B)",
    )
    far = float(case["ref"].abs().max())
    require(
        far < 1e3,
        f"{what}: your mean is right but your variance is off by "
        f"{float((got_var.double() - var).abs().max()):.3g} on data far from 0 (|mean| about "
        f"{far:.3g}, variance about {float(var.max()):.3g}): a formula that subtracts two "
        "large numbers (like E[x^2] - mean^2) loses the variance to rounding. Work with "
        "deviations from a mean instead",
    )


def _check_case(case: dict, got: dict) -> None:
    what = describe(case)
    mean, var = truth(case)
    got_mean, got_var = got.get("mean"), got.get("var")
    if not isinstance(got_mean, torch.Tensor) or not isinstance(got_var, torch.Tensor):
        raise CheckFailed(
            f"{what}: expected a pair (mean, var) of tensors of shape {tuple(mean.shape)}, got "
            f"{kind(got_mean)} and {kind(got_var)}"
        )
    for name, value in (("mean", got_mean), ("variance", got_var)):
        require(
            tuple(value.shape) == tuple(mean.shape),
            f"{what}: your {name} has shape {tuple(value.shape)}; expected one value per "
            f"feature, {tuple(mean.shape)}",
        )
    ok_mean = within(got_mean, mean, mean_tolerance(case))
    if ok_mean and within(got_var, var, var_tolerance(case)):
        dtype = case["means"].dtype
        require(
            got_mean.dtype == dtype and got_var.dtype == dtype,
            f"{what}: your mean and variance are {got_mean.dtype} and {got_var.dtype}; the "
            f"docstring promises them in the dtype of means ({dtype}), as BatchNorm needs them",
        )
        return
    _diagnose(case, got_mean, got_var, mean, var)
    name, want, value, tol = (
        ("mean", mean, got_mean, mean_tolerance(case))
        if not ok_mean
        else ("(biased) variance", var, got_var, var_tolerance(case))
    )
    diff = (value.double() - want).abs()
    i = int(torch.argmax(diff - tol))
    raise CheckFailed(
        f"{what}: the {name} of the whole batch: feature {i} expected {float(want[i]):.9g}, "
        f"got {float(value.double()[i]):.9g} (allowed difference {float(tol[i]):.3g})"
    )


def judge(inputs: dict, outputs: dict) -> str:
    """Every case against the samples' own statistics, in the case set's order."""
    cases, got = inputs["cases"], outputs.get("cases")
    require(isinstance(got, list) and len(got) == len(cases), "expected one result per case")
    for case, result in zip(cases, got, strict=True):
        require(isinstance(result, dict), f"{describe(case)}: no result")
        _check_case(case, result)
    shown = "; ".join(str([int(c) for c in case["counts"]]) for case in cases)
    return (
        f"the whole batch's mean and variance from shard statistics ({shown}), also far from "
        "0 in float32 and float64 and with empty shards"
    )


EXERCISE = Exercise(
    "test_ex4_combine_shard_stats",
    ("ex4_combine_shard_stats",),
    "batch statistics from shard statistics, numerically safe",
    make_inputs,
    judge,
    run=run,
    visible_inputs=visible_inputs,
)
