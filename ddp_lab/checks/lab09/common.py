"""What lab 9's exercises share: the lab's name, its files, and counting collectives."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch

from ddp_lab.checks.failure import CheckFailed, is_close
from ddp_lab.checks.lab07.common import DTYPES, WATCHDOG_S, randn

__all__ = [
    "DTYPES",
    "FSDP_FILE",
    "LAB",
    "MESH_FILE",
    "PLAN_FILE",
    "WATCHDOG_S",
    "collectives",
    "gathered",
    "judge_ranks",
    "randn",
    "weights_problem",
    "whole",
]

LAB = "lab09_fsdp_dtensor"

#: Files the notebook's distributed solution cells write (``%%writefile``).
FSDP_FILE, PLAN_FILE, MESH_FILE = "fsdp.py", "tp_plan.py", "mesh2d.py"


def collectives(mode) -> dict[str, int]:
    """The collectives a ``CommDebugMode`` saw, by name (``all_reduce``, ``all_gather``,
    ``reduce_scatter``, ...): DTensor's functional collectives and ``torch.distributed``'s
    (``allreduce_``, ``_allgather_base_``, ``_reduce_scatter_base_``) added up together."""
    out: Counter = Counter()
    for op, n in mode.get_comm_counts().items():
        name = str(op).split(".")[-1].strip("_").replace("_base", "")
        for short in ("all_reduce", "all_gather", "reduce_scatter"):
            if name.replace("_", "").startswith(short.replace("_", "")):
                name = short
        out[name] += n
    return dict(out)


def whole(t: torch.Tensor) -> torch.Tensor:
    """A tensor as it is, a DTensor gathered (every rank must call it on a DTensor)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def gathered(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of ``model``, whole (a collective for DTensor parameters)."""
    return {n: whole(p).detach().clone() for n, p in model.named_parameters()}


def weights_problem(what: str, got: dict, want: dict, tol: tuple, steps: int) -> str | None:
    """The first weight of ``got`` that differs from ``want`` (``atol, rtol = tol``) after
    ``steps`` steps, said; None when all agree."""
    atol, rtol = tol
    for name, expected in want.items():
        value = got.get(name)
        if not isinstance(value, torch.Tensor) or value.shape != expected.shape:
            return f"{what}: no weight {name!r} of shape {tuple(expected.shape)} after training"
        if not is_close(value, expected, atol, rtol):
            diff = (value.double() - expected.double()).abs().max().item()
            return (
                f"{what}: after {steps} steps {name} differs from one process trained on the "
                f"whole batch (what DDP trains; largest difference {diff:.2e})"
            )
    return None


def judge_ranks(inputs: dict, outputs: dict, oracle: Callable, rank_problem: Callable) -> None:
    """The judge of an exercise run as one job per case: every rank's result against
    ``oracle(case)``; raises ``CheckFailed`` with ``rank_problem(case, rank, got, want)`` of
    the first wrong rank."""
    cases = outputs.get("cases")
    if not isinstance(cases, list) or len(cases) != len(inputs["cases"]):
        raise CheckFailed("expected one result per case")
    for case, ranks in zip(inputs["cases"], cases, strict=True):
        want = oracle(case)
        for rank, got in enumerate(ranks):
            if why := rank_problem(case, rank, got, want):
                raise CheckFailed(why)
