"""Checks of the self-test lab: the smallest example of a lab's checks (docs/AUTHORING.md).

Two exercises: ``add`` (one process) and ``rank_sum`` (every rank of a torchrun job, from
``%%writefile rank_sum.py``, with ``all_reduce`` and ``reduce`` refused). Both judges use
independent oracles (``a + b``; ``torch.stack(...).sum(0)`` over the ranks' tensors).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ddp_lab.checks import guards, runner
from ddp_lab.checks.contract import Exercise
from ddp_lab.checks.failure import CheckFailed, assert_close
from ddp_lab.checks.values import randint

LAB = "lab00_selftest"


def _add_inputs(gen: torch.Generator) -> dict:
    n = randint(gen, 3, 49)
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
        n = randint(gen, 1, 8)
        tensors = [torch.randn(n, generator=gen, dtype=torch.float64) for _ in range(world)]
        cases.append({"world_size": world, "tensors": tensors})
    return {"cases": cases}


def _sum_run_rank(ns: dict, inputs: dict, case: dict, rank: int, world: int):
    mod = guards.load_student_file("rank_sum.py", forbid=("all_reduce", "reduce"))
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
        files=("rank_sum.py",),
    ),
]


def add(fn) -> None:
    """Visible check of ``add``."""
    runner.visible(LAB, "test_add", functions={"add": fn})


def rank_sum(path: str = "rank_sum.py") -> None:
    """Visible check of ``rank_sum``: the file on 2 and 3 ranks."""
    runner.visible(LAB, "test_rank_sum", folder=Path(path).parent)
