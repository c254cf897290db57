"""Exercise 4, ``combine_shard_stats(means, variances, counts)``: BatchNorm's batch mean and
biased variance from per-shard means, biased variances and counts.

The oracle is the samples themselves: the inputs keep the shards' samples, and the answer
is their concatenation's ``mean(0)`` and ``var(0, unbiased=False)``. The case set draws
unequal counts (so the plain average of the shard means is wrong) and shards whose means
lie apart: shards 0 and 1 are centred at least 3 apart in every feature (so leaving out the
spread of the shard means is wrong).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ddp_lab.checks.contract import Exercise
from ddp_lab.checks.failure import CheckFailed, assert_close, is_close, require
from ddp_lab.checks.lab01.common import ATOL, RTOL
from ddp_lab.checks.values import kind, plain, randint


def _case(gen: torch.Generator, counts: list[int], channels: int) -> dict:
    centres = 2 * torch.randn(len(counts), channels, generator=gen, dtype=torch.float64)
    apart = 3 + torch.rand(channels, generator=gen, dtype=torch.float64)
    sign = torch.where(torch.rand(channels, generator=gen) < 0.5, -1.0, 1.0).double()
    centres[1] = centres[0] + sign * apart
    scale = 0.5 + torch.rand(channels, generator=gen, dtype=torch.float64)
    shards = []
    for k, count in enumerate(counts):
        z = torch.randn(count, channels, generator=gen, dtype=torch.float64)
        shards.append(centres[k] + scale * (z - z.mean(0)))  # shard k's mean: centres[k]
    return {
        "means": torch.stack([s.mean(0) for s in shards]),
        "variances": torch.stack([s.var(0, unbiased=False) for s in shards]),
        "counts": torch.tensor(counts),
        "samples": torch.cat(shards),
    }


def _far(wrong: torch.Tensor, right: torch.Tensor) -> bool:
    return bool(((wrong - right).abs() > 1e-3 * (1 + right.abs())).any())


def _mistakes_far(inputs: dict) -> bool:
    """Whether the plain averages and the unbiased variance are far from the answer in some
    feature (equal counts make the plain average of the shard means right, for example)."""
    samples = inputs["samples"]
    mean, var = samples.mean(0), samples.var(0, unbiased=False)
    return (
        _far(inputs["means"].mean(0), mean)
        and _far(inputs["variances"].mean(0), var)
        and _far(samples.var(0, unbiased=True), var)
    )


def make_inputs(gen: torch.Generator) -> dict:
    """2 to 5 shards of 1 to 35 samples (never all the same count), 1 to 6 features."""
    while True:
        n = randint(gen, 2, 5)
        counts = [randint(gen, 1, 20) for _ in range(n)]
        counts[randint(gen, 0, n - 1)] += randint(gen, 5, 15)
        inputs = _case(gen, counts, randint(gen, 1, 6))
        if len(set(counts)) > 1 and _mistakes_far(inputs):
            return inputs


def visible_inputs(gen: torch.Generator) -> dict:
    """3 shards of 6, 3 and 1 samples, 2 features."""
    return _case(gen, [6, 3, 1], 2)


def run(ns: dict, inputs: dict, workdir: Path | None) -> dict:
    """Call the student's function on copies of the shard statistics."""
    out = ns["combine_shard_stats"](
        inputs["means"].clone(), inputs["variances"].clone(), inputs["counts"].clone()
    )
    if not isinstance(out, (list, tuple)) or len(out) != 2:
        return {"mean": plain(out), "var": "<not a (mean, var) pair>"}
    return {"mean": plain(out[0]), "var": plain(out[1])}


def describe(inputs: dict) -> str:
    """How the feedback names a case."""
    return f"combine_shard_stats for shards of {[int(c) for c in inputs['counts']]} samples"


def judge(inputs: dict, outputs: dict) -> str:
    """Compare with the samples' mean and biased variance; name the plain averages and the
    unbiased variance."""
    counts = [int(c) for c in inputs["counts"]]
    samples, means, variances = inputs["samples"], inputs["means"], inputs["variances"]
    mean, var = samples.mean(0), samples.var(0, unbiased=False)
    what = describe(inputs)
    got_mean, got_var = outputs["mean"], outputs["var"]
    if not isinstance(got_var, torch.Tensor) or not isinstance(got_mean, torch.Tensor):
        raise CheckFailed(
            f"{what}: expected a pair (mean, var) of tensors of shape {tuple(mean.shape)}, got "
            f"{kind(got_mean)} and {kind(got_var)}"
        )
    tol = {"atol": ATOL, "rtol": RTOL}
    if not is_close(got_mean, mean, **tol):
        require(
            not is_close(got_mean, means.mean(0), **tol),
            f"{what}: your mean is the plain average of the shard means; a shard of "
            f"{max(counts)} samples must count more than one of {min(counts)}: weight each "
            "shard mean by its count",
        )
    assert_close(got_mean, mean, f"{what}: the mean of the whole batch", **tol)
    if not is_close(got_var, var, **tol):
        require(
            not is_close(got_var, variances.mean(0), **tol),
            f"{what}: your variance averages the shard variances and leaves out how far the "
            "shard means lie from the batch mean (and a shard of one sample counts as much "
            "as a big one)",
        )
        require(
            not is_close(got_var, samples.var(0, unbiased=True), **tol),
            f"{what}: that is the unbiased variance (divided by B - 1); BatchNorm normalises "
            "with the biased one (divided by B)",
        )
    assert_close(got_var, var, f"{what}: the (biased) variance of the whole batch", **tol)
    return f"batch mean and variance recovered from {len(counts)} shards of {counts} samples"


EXERCISE = Exercise(
    "test_ex4_combine_shard_stats",
    ("ex4_combine_shard_stats",),
    "batch statistics from shard statistics",
    make_inputs,
    judge,
    run=run,
    visible_inputs=visible_inputs,
)
