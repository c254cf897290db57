"""Checks of lab 1 (data parallelism in one process). PILOT - being extended."""

from __future__ import annotations

from pathlib import Path

import torch

from ddp_lab.checks import CheckFailed, assert_close, make_verdict, passed
from ddp_lab.grading.exercise import Exercise

LAB = "lab01_data_parallel"
verdict = make_verdict(LAB)


def reference_average_gradients(grads: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    return [torch.stack(g).mean(0) for g in zip(*grads, strict=True)]


def average_gradients(fn) -> None:
    grads = [[torch.full((2,), float(r)), torch.full((3, 1), 2.0 * r)] for r in range(4)]
    got = fn(grads)
    if not isinstance(got, (list, tuple)) or len(got) != 2:
        raise CheckFailed("average_gradients should return one tensor per parameter (2 here)")
    for i, (g, e) in enumerate(zip(got, reference_average_gradients(grads), strict=True)):
        assert_close(g, e, f"parameter {i}'s averaged gradient")
    passed("average_gradients averages each parameter's gradient over the replicas")


def _avg_inputs(gen: torch.Generator) -> dict:
    n = int(torch.randint(2, 6, (1,), generator=gen))
    shapes = [(3,), (2, 5), (4, 1, 2)]
    return {
        "grads": [
            [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes] for _ in range(n)
        ]
    }


def _avg_run(ns: dict, inputs: dict, workdir: Path) -> dict:
    return {"averaged": list(ns["average_gradients"](inputs["grads"]))}


def _avg_judge(inputs: dict, outputs: dict) -> str:
    expected = reference_average_gradients(inputs["grads"])
    got = outputs["averaged"]
    if len(got) != len(expected):
        raise CheckFailed(f"expected {len(expected)} averaged gradients, got {len(got)}")
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert_close(g, e, f"parameter {i}'s averaged gradient", atol=1e-9)
    return f"averaged {len(inputs['grads'])} replicas' gradients correctly"


EXERCISES = [
    Exercise(
        "test_ex1_average_gradients",
        ("ex1_average_gradients",),
        "average gradients over replicas",
        _avg_inputs,
        _avg_judge,
        run=_avg_run,
    ),
]
