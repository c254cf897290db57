"""The grader's self-test "lab": two tiny exercises that ``tests/test_verdicts.py`` feeds
with correct, wrong, hanging, crashing and cheating student code. Also the smallest
example of a checks module for lab authors (see docs/AUTHORING.md)."""

from __future__ import annotations

from pathlib import Path

import torch

from ddp_lab.checks import CheckFailed, assert_close, make_verdict
from ddp_lab.grading.exercise import Exercise

LAB = "lab00_selftest"
verdict = make_verdict(LAB)


def _add_inputs(gen: torch.Generator) -> dict:
    n = int(torch.randint(3, 50, (1,), generator=gen))
    return {
        "a": torch.randn(n, generator=gen, dtype=torch.float64),
        "b": torch.randn(n, generator=gen, dtype=torch.float64),
    }


def _add_run(ns: dict, inputs: dict, workdir: Path) -> dict:
    return {"sum": ns["add"](inputs["a"], inputs["b"])}


def _add_judge(inputs: dict, outputs: dict) -> str:
    assert_close(outputs["sum"], inputs["a"] + inputs["b"], "add(a, b)", atol=1e-12)
    return f"add is right on {inputs['a'].numel()} random pairs"


def _sum_inputs(gen: torch.Generator) -> dict:
    cases = []
    for world in (2, 3):
        n = int(torch.randint(1, 9, (1,), generator=gen))
        cases.append(
            {
                "world_size": world,
                "tensors": [
                    torch.randn(n, generator=gen, dtype=torch.float64) for _ in range(world)
                ],
            }
        )
    return {"cases": cases}


def _sum_run_rank(ns: dict, inputs: dict, case: dict, rank: int, world: int):
    from ddp_lab.grading.student import load_module_file

    mod = load_module_file("rank_sum.py")
    t = case["tensors"][rank].clone()
    mod["rank_sum"](t)
    return t


def _sum_judge(inputs: dict, outputs: dict) -> str:
    for case, got in zip(inputs["cases"], outputs["cases"], strict=True):
        expected = torch.stack(case["tensors"]).sum(0)
        if len(got) != case["world_size"]:
            raise CheckFailed(f"expected {case['world_size']} ranks' results, got {len(got)}")
        for rank, t in enumerate(got):
            assert_close(t, expected, f"rank {rank} of {case['world_size']}", atol=1e-12)
    return "rank_sum equals the sum over 2 and 3 ranks"


EXERCISES = [
    Exercise(
        "test_add", ("add",), "add two tensors", _add_inputs, _add_judge, run=_add_run, timeout=30
    ),
    Exercise(
        "test_rank_sum",
        ("rank_sum",),
        "sum over ranks with send/recv",
        _sum_inputs,
        _sum_judge,
        run_rank=_sum_run_rank,
        forbid=("all_reduce", "reduce"),
        timeout=60,
    ),
]
