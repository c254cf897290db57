"""Exercise 1: ``local_moments(x)``, one rank's per-channel sum, sum of squares and count.

The student's function runs in one process on inputs of 2, 3 and 4 dimensions (reducing
over the batch dimension only must fail somewhere), one of them holding no sample at all.
The judge's oracle is ``torch.var_mean`` over every dimension but the channel dimension:
``sum = mean * n``, ``sumsq = (var + mean^2) * n``, with the count ``n`` read off the shape.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ddp_lab.checks.contract import Exercise
from ddp_lab.checks.failure import CheckFailed, assert_close
from ddp_lab.checks.lab04.common import RUNTIME, channel_dims, moments, triple
from ddp_lab.checks.values import kind, number, plain, randint


def make_inputs(gen: torch.Generator) -> dict:
    """Four batches sharing ``C`` channels: ``(N, C)``, ``(N, C, L)``, ``(N, C, H, W)`` and
    an empty ``(0, C, H, W)`` (a rank may run out of samples)."""
    c = randint(gen, 2, 5)
    shapes = [
        (randint(gen, 2, 8), c),
        (randint(gen, 1, 6), c, randint(gen, 2, 5)),
        (randint(gen, 1, 6), c, randint(gen, 2, 4), randint(gen, 2, 4)),
        (0, c, randint(gen, 1, 3), randint(gen, 1, 3)),
    ]
    return {
        "xs": [
            2 * torch.randn(*shape, generator=gen, dtype=torch.float64) + randint(gen, -2, 2)
            for shape in shapes
        ]
    }


def run(ns: dict, inputs: dict, workdir: Path) -> dict:
    """The student's ``local_moments`` on a copy of every input."""
    fn = ns["local_moments"]
    return {"results": [plain(fn(x.clone())) for x in inputs["xs"]]}


def _per_channel(got, x: torch.Tensor, what: str) -> None:
    """One value per channel, or a message that says which dimensions to sum over."""
    c = x.size(1)
    if isinstance(got, torch.Tensor) and tuple(got.shape) == (c,):
        return
    raise CheckFailed(
        f"{what}: expected shape ({c},), one value per channel, got {kind(got)}: sum over "
        f"every dimension except the channel dimension 1, i.e. dims {list(channel_dims(x))}"
    )


def judge(inputs: dict, outputs: dict) -> str:
    """Each result against ``torch.var_mean`` of the input and the count by its shape."""
    xs, got = inputs["xs"], outputs["results"]
    if not isinstance(got, list) or len(got) != len(xs):
        raise CheckFailed(f"expected one result per input ({len(xs)}), got {kind(got)}")
    for x, result in zip(xs, got, strict=True):
        what = f"local_moments(x) for x of shape {tuple(x.shape)}"
        s, ss, n = triple(result, what)
        exp_s, exp_ss, exp_n = moments(x)
        _per_channel(s, x, f"{what}: the sum")
        _per_channel(ss, x, f"{what}: the sum of squares")
        assert_close(s, exp_s, f"{what}: the sum (mean x count)", atol=1e-9, rtol=1e-9)
        assert_close(
            ss, exp_ss, f"{what}: the sum of squares ((var + mean^2) x count)", atol=1e-9, rtol=1e-9
        )
        count = number(n)
        if count != float(exp_n):
            per = " x ".join(str(d) for d in (x.size(0), *x.shape[2:]))
            said = kind(n) if math.isnan(count) else f"{count:g}"
            raise CheckFailed(
                f"{what}: the count should be the number of values per channel, "
                f"{per} = {float(exp_n):g}; got {said}"
            )
    shapes = ", ".join(str(tuple(x.shape)) for x in xs)
    return f"local_moments is right for inputs of shapes {shapes}"


EXERCISE = Exercise(
    "test_ex1_local_moments",
    ("ex1_local_moments",),
    "per-channel sum, sum of squares and count of one rank's batch",
    make_inputs,
    judge,
    run=run,
    forbid_modules=RUNTIME,
    timeout=60,
)
