"""Exercise 2: ``sync_mean_var(s, ss, n)`` in ``sync_stats.py``, on every rank.

Every rank of a torchrun job receives its own moments (from its own batch; batch sizes
differ between ranks and one rank holds no sample in the grader's case) and must return the
global mean, biased variance and count. The judge's oracle is ``torch.var_mean`` of the
concatenated global batch, and its size.
"""

from __future__ import annotations

import torch

from ddp_lab.checks.contract import Exercise
from ddp_lab.checks.failure import CheckFailed, assert_close
from ddp_lab.checks.lab04.common import (
    RUNTIME,
    STATS_FILE,
    global_stats,
    load_file,
    moments,
    rank_batches,
    sizes,
    sizes_text,
    triple,
    values_per_channel,
    worlds_text,
)
from ddp_lab.checks.values import kind, number, plain, randint

#: Said with a wrong mean or variance: what every right answer does.
HINT = (
    " (the statistics of the global batch count every sample once, whatever rank holds it: "
    "all-reduce the sums and the count, then divide; BatchNorm normalises with the biased "
    "variance, sumsq / n - mean^2)"
)


def _case(gen: torch.Generator, world: int, tail: tuple[int, ...], empty: bool) -> dict:
    batch_sizes = sizes(gen, world, 1, 8, empty=empty)
    xs = rank_batches(gen, batch_sizes, randint(gen, 2, 5), tail)
    return {"world_size": world, "sizes": batch_sizes, "xs": xs}


def make_inputs(gen: torch.Generator) -> dict:
    """One job of 3 ranks (every torchrun job costs seconds): different batch sizes, one
    rank holding no sample at all, images of a random size."""
    return {"cases": [_case(gen, 3, (randint(gen, 1, 3), randint(gen, 1, 3)), empty=True)]}


def visible_inputs(gen: torch.Generator) -> dict:
    """2 ranks of different batch sizes, ``(N, C)`` inputs, no empty rank."""
    return {"cases": [_case(gen, 2, (), empty=False)]}


def run_rank(ns: dict, inputs: dict, case: dict, rank: int, world: int):
    """The student's ``sync_mean_var`` on this rank's moments."""
    fn = load_file(STATS_FILE)["sync_mean_var"]
    s, ss, n = moments(case["xs"][rank])
    return plain(fn(s, ss, n))


def judge(inputs: dict, outputs: dict) -> str:
    """Every rank's result against ``torch.var_mean`` of the concatenated global batch."""
    for case, got in zip(inputs["cases"], outputs["cases"], strict=True):
        mean, var, _ = global_stats(case["xs"])
        count = float(sum(values_per_channel(x) for x in case["xs"]))
        for rank, result in enumerate(got):
            what = f"sync_mean_var on rank {rank} ({sizes_text(case)})"
            m, v, n = triple(result, what)
            if isinstance(m, torch.Tensor) and not bool(torch.isfinite(m).all()):
                raise CheckFailed(
                    f"{what}: the mean contains NaN or inf (a rank with 0 samples has no "
                    "mean of its own: all-reduce sums and counts, not means)"
                )
            try:
                assert_close(m, mean, f"{what}: the global mean", atol=1e-9, rtol=1e-9)
                assert_close(v, var, f"{what}: the global (biased) variance", atol=1e-9, rtol=1e-9)
            except CheckFailed as err:
                raise CheckFailed(f"{err}{HINT}") from None
            got_n = number(n)
            if got_n != count:
                raise CheckFailed(
                    f"{what}: the global count should be {count:g} (values per channel over "
                    f"all ranks), got {kind(n) if got_n != got_n else f'{got_n:g}'}"
                )
    return (
        "sync_mean_var gives every rank the global mean and variance on "
        f"{worlds_text(inputs)} ranks"
    )


EXERCISE = Exercise(
    "test_ex2_sync_mean_var",
    ("ex2_sync_mean_var",),
    "global mean and variance from all-reduced moments, unequal batch sizes",
    make_inputs,
    judge,
    run_rank=run_rank,
    forbid_modules=RUNTIME,
    timeout=60,
    visible_inputs=visible_inputs,
    files=(STATS_FILE,),
)
