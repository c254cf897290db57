"""Exercise 1: ``sync_mean_var(x)`` in ``sync_stats.py``, the global batch's statistics.

Every rank of a torchrun job receives its own slice ``x`` of a batch (``(N, C)`` or
``(N, C, *spatial)``; the slices' sizes differ, a rank may hold none) and must return the
per-channel mean, the biased variance and the count of the *global* batch, the same on
every rank. What travels and how it is combined is the student's to derive; it must be
numerically safe (the data may sit far from 0), and its traffic must not grow with the world
size: all-reduces only, at most 3 of at most ``3C + 3`` values each, the same on 2 ranks as
on 3 (:mod:`~ddp_lab.checks.lab04.traffic` records every collective the student's code
calls, and the values it brings to the rank). The all-gather of every rank's
``(count, mean, variance)``, right as its numbers are, fails.

The judge's oracle is ``torch.var_mean`` of the concatenated global batch (float64), and its
size. Tolerances follow the data's dtype and magnitude: ``16 eps(dtype) |x|max`` for the
mean, that times ``(std + 1)`` for the variance; what any sum of ``x**2`` loses far from 0
is thousands of times more. The numbers are judged first, then the traffic of every run, then
its growth: the runs over 2 and over 3 ranks come in pairs with the same number of channels
(the first and the last; the two with one channel), whose all-reduces must have the same
sizes.

Case set, in one job of 3 ranks (:func:`~ddp_lab.checks.lab04.common.per_run`), in this
order:

- 2 ranks (a group of ranks 0 and 1), float64 near 0, ``(N, C, L)`` with 3 to 5 channels
  (first: statistics over the batch dimension only have the wrong shape here; ``C`` is the
  last run's);
- 3 ranks, float64 near ``1e8`` (where even float64 loses ``E[x^2] - mean^2``), ``(N, 1)``,
  one rank holding a single sample (its own variance is 0);
- 2 ranks, float32 near ``1e4``, ``(N, 1, H, W)``, one rank without samples;
- 3 ranks, float32 near ``1e4``, images ``(N, C, H, W)`` with the first run's channels, one
  rank without samples.

The first run with an empty rank is a run over 2 ranks: a rank that skips the collective
leaves its partner waiting in that group's collective, a deadlock the grader stops with its
timeout and says so. (Were it a run over all 3 ranks, the skipping rank's next call would
pair with the others' pending one and gloo would fail on the sizes, a message that does not
tell the student what happened.)
"""

from __future__ import annotations

import math

import torch

from ddp_lab.checks.contract import Exercise
from ddp_lab.checks.failure import CheckFailed, require
from ddp_lab.checks.lab04 import traffic
from ddp_lab.checks.lab04.common import (
    RUNTIME,
    STATS_FILE,
    eps_of,
    global_count,
    load_file,
    per_run,
    rank_batches,
    run_text,
    runs_of,
    sizes,
    triple,
    var_mean,
    worlds_text,
)
from ddp_lab.checks.values import kind, number, plain, randint

#: How far from 0 the "far" runs' channels sit, by dtype.
FAR = {"float32": 1e4, "float64": 1e8}
#: Tolerance factor, in units of ``eps(dtype) * max|x|``.
ULPS = 16


def make_run(
    gen: torch.Generator,
    ranks: int,
    dtype: str,
    tail: tuple[int, ...],
    channels: int,
    far: bool,
    empty: bool = False,
    single: bool = False,
) -> dict:
    """One call on every rank of a group of ``ranks``: each rank's slice of one batch."""
    batch_sizes = sizes(gen, ranks, 1, 6, empty=empty, single=single)
    offset = FAR[dtype] if far else 0.0
    return {
        "ranks": ranks,
        "sizes": batch_sizes,
        "channels": channels,
        "tail": list(tail),
        "dtype": dtype,
        "far": far,
        "xs": rank_batches(gen, batch_sizes, channels, tail, dtype, offset),
    }


def make_inputs(gen: torch.Generator) -> dict:
    """One job of 3 ranks: two runs over all 3, two over ranks 0 and 1 (see the module)."""
    image = (randint(gen, 2, 4), randint(gen, 2, 4))
    channels = randint(gen, 3, 5)  # the first and the last run: their traffic must be equal
    return {
        "cases": [
            {
                "world_size": 3,
                "runs": [
                    make_run(gen, 2, "float64", (randint(gen, 2, 4),), channels, False),
                    make_run(gen, 3, "float64", (), 1, True, single=True),
                    make_run(gen, 2, "float32", image, 1, True, empty=True),  # first empty rank
                    make_run(gen, 3, "float32", image, channels, True, empty=True),
                ],
            }
        ]
    }


def visible_inputs(gen: torch.Generator) -> dict:
    """One job of 2 ranks: float32 images far from 0, and float64 ``(N, 1)`` with one rank
    empty (a rank that skips the collective makes the other wait: the check times out)."""
    return {
        "cases": [
            {
                "world_size": 2,
                "runs": [
                    make_run(gen, 2, "float32", (3, 3), 3, True),
                    make_run(gen, 2, "float64", (), 1, False, empty=True),
                ],
            }
        ]
    }


def run_rank(ns: dict, inputs: dict, case: dict, rank: int, world: int) -> list:
    """The student's ``sync_mean_var`` on this rank's slice, once per run it takes part in:
    ``{"stats": its result, "calls": the collectives it called}`` (recorded from before the
    file loads)."""
    log: list = []

    def one(run: dict, r: int) -> dict:
        start = len(log)
        stats = plain(fn(run["xs"][r].clone()))
        return {"stats": stats, "calls": [list(c) for c in log[start:]]}

    with traffic.recorded(log):
        fn = load_file(STATS_FILE)["sync_mean_var"]
        return per_run(case, rank, world, one)


def stats_runs(inputs: dict, outputs: dict):
    """``(run, [rank 0's (mean, var, count), ...])`` for every run (the numbers only)."""
    for run, got in runs_of(inputs, outputs):
        yield run, [o.get("stats") if isinstance(o, dict) else o for o in got]


def calls_of(got: list) -> list:
    """Every rank's recorded collectives of one run (``[]`` where none came back)."""
    return [o.get("calls") or [] if isinstance(o, dict) else [] for o in got]


def traffic_problem(inputs: dict, outputs: dict) -> str | None:
    """The first run whose collectives break the traffic rule, then whether the traffic grows
    from 2 ranks to 3 (see :mod:`~ddp_lab.checks.lab04.traffic`)."""
    runs = list(runs_of(inputs, outputs))
    for run, got in runs:
        for rank, calls in enumerate(calls_of(got)):
            where = f"sync_mean_var on rank {rank} ({run_text(run)})"
            if why := traffic.problem(where, run["channels"], run["ranks"], calls):
                return why
    pairs = [
        (a, calls_of(ga)[0], b, calls_of(gb)[0])
        for a, ga in runs
        for b, gb in runs
        if a["ranks"] < b["ranks"] and a["channels"] == b["channels"]
    ]
    return traffic.growth_problem(pairs)


def tolerances(run: dict) -> tuple[float, float]:
    """``(mean, variance)`` absolute tolerances of a run (its dtype and magnitude)."""
    scale = max(float(x.double().abs().max()) for x in run["xs"] if x.numel())
    var, _ = var_mean(torch.cat(run["xs"]))
    unit = ULPS * eps_of(run["dtype"]) * scale
    return unit, unit * (float(var.max().sqrt()) + 1)


def _per_channel(got, c: int, what: str) -> None:
    if isinstance(got, torch.Tensor) and tuple(got.shape) == (c,):
        return
    raise CheckFailed(
        f"{what}: expected shape ({c},), one value per channel, got {kind(got)}: the "
        "statistics of a channel run over every dimension but the channel dimension 1"
    )


def _close(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> None:
    g = got.detach().double()
    if not bool(torch.isfinite(g).all()):
        raise CheckFailed(
            f"{what} contains NaN or inf (a rank without samples has no mean of its own: "
            "it must take part with statistics that weigh nothing)"
        )
    diff = (g - want).abs()
    if bool((diff > tol).any()):
        i = int(diff.argmax())
        raise CheckFailed(
            f"{what}: off by {diff.max().item():.3g} (allowed {tol:.2g}); e.g. channel {i}: "
            f"expected {want[i].item():.10g}, got {g[i].item():.10g}"
        )


def check_run(run: dict, got: list) -> None:
    """Every rank's ``(mean, var, count)`` against the concatenated global batch."""
    var, mean = var_mean(torch.cat(run["xs"]))
    count = global_count(run["xs"])
    tol_mean, tol_var = tolerances(run)
    for rank, result in enumerate(got):
        what = f"sync_mean_var on rank {rank} ({run_text(run)})"
        m, v, n = triple(result, what)
        _per_channel(m, run["channels"], f"{what}: the mean")
        _per_channel(v, run["channels"], f"{what}: the variance")
        got_n = number(n)
        require(
            got_n == count,
            f"{what}: the global count should be {count:g} (values per channel over all "
            f"ranks), got {kind(n) if math.isnan(got_n) else f'{got_n:g}'}",
        )
        _close(m, mean, tol_mean, f"{what}: the global mean")
        _close(v, var, tol_var, f"{what}: the global biased variance")


def judge(inputs: dict, outputs: dict) -> str:
    """Every rank's result against ``torch.var_mean`` of the concatenated global batch, then
    the traffic (all-reduces only, a fixed number of a fixed size, equal on 2 and 3 ranks)."""
    for run, got in stats_runs(inputs, outputs):
        check_run(run, got)
    if why := traffic_problem(inputs, outputs):
        raise CheckFailed(why)
    run, got = next(runs_of(inputs, outputs))
    sizes_said = [c[1] for c in calls_of(got)[0]]
    return (
        f"sync_mean_var gives every rank the global mean, variance and count on "
        f"{worlds_text(inputs)} ranks (unequal and empty slices, float32 and float64, far "
        f"from 0), with all-reduces only ({sizes_said} values for {run['channels']} channels)"
    )


EXERCISE = Exercise(
    "test_ex1_sync_mean_var",
    ("ex1_sync_mean_var",),
    "the global batch's mean and variance on every rank, numerically safe, with all-reduces",
    make_inputs,
    judge,
    run_rank=run_rank,
    forbid_modules=RUNTIME,
    timeout=60,
    visible_inputs=visible_inputs,
    files=(STATS_FILE,),
)
