"""Checks of lab 2 (processes and collectives): one visible check per test cell.

========================================  ============================================
test cell                                 visible check (in the student's kernel)
========================================  ============================================
``test_ex1_ring_all_reduce``              ``ring_all_reduce("ring.py")``: 3 ranks
``test_ex2_parameter_server``             ``parameter_server_average("ps.py")``: 3 ranks
``test_ex3_ring_time``                    ``ring_time(ring_time)``: properties
``test_ex4_fit_alpha_beta``               ``fit_alpha_beta(fit_alpha_beta, ring_time)``
========================================  ============================================

Each runs its exercise's contract (``ex1_ring_all_reduce.py`` ... ``ex4_fit_alpha_beta.py``)
through :func:`ddp_lab.checks.runner.visible`: the same run and the same judge as the grader,
on small fixed inputs. The distributed ones start a torchrun job whose ranks are
:mod:`ddp_lab.checks.rank_worker`; under ``nbgrader autograde`` they only say that the grader
runs them (outside the kernel).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from ddp_lab.checks import runner
from ddp_lab.checks.failure import CheckFailed
from ddp_lab.checks.lab02 import (
    common,
    ex1_ring_all_reduce,
    ex2_parameter_server,
    ex3_ring_time,
    ex4_fit_alpha_beta,
)

LAB = "lab02_collectives"
EXERCISES = [
    ex1_ring_all_reduce.EXERCISE,
    ex2_parameter_server.EXERCISE,
    ex3_ring_time.EXERCISE,
    ex4_fit_alpha_beta.EXERCISE,
]


def ring_all_reduce(path: str = "ring.py", world_size: int = common.VISIBLE_WORLD_SIZE) -> None:
    """Run ``ring_all_reduce`` from ``path`` on ``world_size`` ranks; compare with the sum.

    Tensors of 1, 2, 3, 7, 10 and 3x5 elements (fewer than the ranks, not divisible by them,
    2-D). The built-in collectives raise while your function runs.

    Raises:
        CheckFailed: naming the rank, the tensor and the wrong chunks; or the error your code
            raised; or that a call deadlocked (stopped after 15 s) or the job hung.

    Example:
        >>> ring_all_reduce("ring.py")  # doctest: +SKIP
        OK: ring_all_reduce() from ring.py on 3 ranks equals dist.all_reduce (the sum ...
    """
    runner.visible(
        LAB,
        "test_ex1_ring_all_reduce",
        folder=Path(path).parent,
        inputs=common.visible_cases(world_size),
    )


def parameter_server_average(
    path: str = "ps.py", world_size: int = common.VISIBLE_WORLD_SIZE
) -> None:
    """Run ``parameter_server_average`` from ``path`` on ``world_size`` ranks.

    Every rank must end with ``dist.all_reduce(tensor) / world_size``.

    Raises:
        CheckFailed: naming the rank, the tensor and what differs (e.g. the sum instead of
            the average, workers that never got the average back).
    """
    runner.visible(
        LAB,
        "test_ex2_parameter_server",
        folder=Path(path).parent,
        inputs=common.visible_cases(world_size),
    )


def ring_time(fn: Callable) -> None:
    """Check ``ring_time(size_bytes, world_size, alpha, bandwidth)`` for the properties of a
    ring's cost (see :mod:`ddp_lab.checks.lab02.ex3_ring_time`).

    Raises:
        CheckFailed: the property that does not hold, with the numbers.
    """
    runner.visible(LAB, "test_ex3_ring_time", functions={"ring_time": fn})


def fit_alpha_beta(fn: Callable, ring_time: Callable) -> None:
    """Check ``fit_alpha_beta(sizes, seconds, world_size)`` on times made by your
    ``ring_time``: exact ones must give back their alpha and B, noisy ones the pair that
    minimises the relative errors.

    Raises:
        CheckFailed: what the fit returned and what was expected; or that ``ring_time`` must
            be finished first (the times are made with it).
    """
    try:
        outputs = ex3_ring_time.run(
            {"ring_time": ring_time}, ex3_ring_time.visible_inputs(torch.Generator()), Path(".")
        )
        ex3_ring_time.judge(ex3_ring_time.visible_inputs(torch.Generator()), outputs)
    except NotImplementedError:
        raise CheckFailed(
            "this check makes its times with your ring_time, which still raises "
            "NotImplementedError: finish exercise 3 first"
        ) from None
    except CheckFailed as err:
        raise CheckFailed(
            f"this check makes its times with your ring_time, which fails its own check "
            f"({err}): fix exercise 3 first"
        ) from None
    except Exception as err:  # noqa: BLE001 - the student's error, said in one line
        raise CheckFailed(
            f"this check makes its times with your ring_time, which raised "
            f"{type(err).__name__}: {err}: fix exercise 3 first"
        ) from None
    runner.visible(
        LAB,
        "test_ex4_fit_alpha_beta",
        functions={"fit_alpha_beta": fn},
        inputs=ex4_fit_alpha_beta.inputs_from_model(ring_time),
    )


__all__ = [
    "EXERCISES",
    "LAB",
    "fit_alpha_beta",
    "parameter_server_average",
    "ring_all_reduce",
    "ring_time",
]
