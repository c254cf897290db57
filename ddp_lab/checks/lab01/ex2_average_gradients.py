"""Exercise 2, ``average_gradients(grads_per_replica)``: the mean over replicas, per parameter.

The inputs are built so that the answer is known without averaging anything: parameter
``i`` has a mean gradient ``m_i``, and replica ``r`` holds ``m_i + d_ri`` where the
deviations ``d_ri`` of the replicas add up to zero (``d_0i = -(d_1i + ... + d_(n-1)i)``). So
the mean is ``m_i``, the sum is ``n * m_i``, and replica 0's gradient is ``m_i + d_0i``:
the two typical mistakes are named from the construction.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ddp_lab.checks.contract import Exercise
from ddp_lab.checks.failure import CheckFailed, all_close, assert_close, require
from ddp_lab.checks.lab01.common import ATOL, RTOL
from ddp_lab.checks.values import kind, plain, randint


def _case(gen: torch.Generator, n: int, shapes: list[tuple[int, ...]]) -> dict:
    means = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    deviations = [
        [0.5 * torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
        for _ in range(n - 1)
    ]
    first = [
        -sum((d[i] for d in deviations), torch.zeros(s, dtype=torch.float64))
        for i, s in enumerate(shapes)
    ]
    deviations.insert(0, first)
    grads = [[m + d for m, d in zip(means, dev, strict=True)] for dev in deviations]
    return {"grads": grads, "means": means}


def make_inputs(gen: torch.Generator) -> dict:
    """2 to 6 replicas, 2 or 3 parameters of random shapes."""
    n = randint(gen, 2, 6)
    shapes = [tuple(randint(gen, 1, 5) for _ in range(randint(gen, 1, 3))) for _ in range(3)]
    return _case(gen, n, shapes[: randint(gen, 2, 3)])


def visible_inputs(gen: torch.Generator) -> dict:
    """4 replicas, a bias of 2 and a weight of 3 x 1."""
    return _case(gen, 4, [(2,), (3, 1)])


def run(ns: dict, inputs: dict, workdir: Path | None) -> dict:
    """Call the student's ``average_gradients`` on copies of the replicas' gradients."""
    grads = [[g.clone() for g in replica] for replica in inputs["grads"]]
    return {"averaged": plain(ns["average_gradients"](grads))}


def judge(inputs: dict, outputs: dict) -> str:
    """Compare with the mean known by construction; name the sum and replica 0's gradients."""
    grads, expected = inputs["grads"], inputs["means"]
    n = len(grads)
    got = outputs["averaged"]
    what = f"average_gradients over {n} replicas"
    if not isinstance(got, list):
        raise CheckFailed(
            f"{what}: expected a list with one tensor per parameter ({len(expected)}), "
            f"got {kind(got)}"
        )
    require(
        len(got) == len(expected),
        f"{what}: expected one averaged gradient per parameter ({len(expected)}), got "
        f"{len(got)} (grads_per_replica[r][i] is replica r's gradient of parameter i)",
    )
    if not all_close(got, expected, ATOL, RTOL):
        # the deviations add up to zero, so the replicas' sum is n times the mean
        require(
            not all_close(got, [n * m for m in expected], ATOL, RTOL),
            f"{what}: you returned the sum of the replicas' gradients, {n} times the mean "
            "(the gradient of n times the loss): divide by the number of replicas",
        )
        require(
            not all_close(got, list(grads[0]), ATOL, RTOL),
            f"{what}: you returned replica 0's gradients; average over all {n} replicas",
        )
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert_close(g, e, f"{what}: parameter {i}'s averaged gradient", atol=ATOL, rtol=RTOL)
    return f"averaged {n} replicas' gradients of {len(expected)} parameters"


EXERCISE = Exercise(
    "test_ex2_average_gradients",
    ("ex2_average_gradients",),
    "average gradients over replicas",
    make_inputs,
    judge,
    run=run,
    visible_inputs=visible_inputs,
)
