"""Checks of lab 2 (processes and collectives): four exercises, 16 autograded points.

1. ``ring_all_reduce`` (5, file ``ring.py``, every rank): judged against the sum over the
   ranks, and by its traffic (recorded by the checker): only to the right neighbour,
   ``2(n - 1)/n`` of the tensor per rank;
2. ``parameter_server`` (4, file ``ps.py``, every rank): a synchronous server that holds the
   parameters and the optimizer; judged against one process's trajectory;
3. ``stale_parameter_server`` (3, file ``ps_stale.py``, every rank): the same with bounded
   staleness; judged against the trajectory of the staleness rule;
4. ``ring_time``, ``server_time``, ``fit_alpha_beta`` (4): properties of the alpha-beta
   models, the fit's units, recovery and least relative errors.

One file per exercise holds its contract. The functions below are the notebook's visible
checks: each runs its exercise on small fixed inputs through
:func:`ddp_lab.checks.runner.visible` (the distributed ones in one torchrun job of 3 ranks,
with runs on 2 and on 3 of them) and prints ``OK: ...`` or raises
:class:`~ddp_lab.checks.failure.CheckFailed`; under ``nbgrader autograde`` the distributed ones
only say that the grader runs them (outside the kernel).

Example:
    >>> from ddp_lab.checks import lab02 as checks
    >>> checks.ring_all_reduce("ring.py")  # doctest: +SKIP
    OK: ring_all_reduce() from ring.py on 2 and 3 ranks equals dist.all_reduce ...
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ddp_lab.checks import runner
from ddp_lab.checks.lab02 import (
    ex1_ring_all_reduce,
    ex2_parameter_server,
    ex3_stale_server,
    ex4_cost_model,
)
from ddp_lab.checks.lab02.common import LAB, RING_FILE, SERVER_FILE, STALE_FILE

__all__ = [
    "EXERCISES",
    "GRADING",
    "LAB",
    "cost_model",
    "parameter_server",
    "ready",
    "ring_all_reduce",
    "stale_parameter_server",
]

#: The exercises, in the order of the notebook's test cells.
EXERCISES = [
    ex1_ring_all_reduce.EXERCISE,
    ex2_parameter_server.EXERCISE,
    ex3_stale_server.EXERCISE,
    ex4_cost_model.EXERCISE,
]

#: True while ``nbgrader autograde`` runs the notebook: the notebook then skips its
#: demonstrations (the grader judges the exercises outside the kernel).
GRADING = runner.grading()

#: Which exercise writes which file (for "finish exercise N first").
EXERCISE_OF_FILE = {RING_FILE: 1, SERVER_FILE: 2, STALE_FILE: 3}


def ring_all_reduce(path: str = RING_FILE) -> None:
    """Visible check of exercise 1: the file on 3 processes (torchrun), runs on 2 and on 3
    ranks, tensors of 1, 2, 3, 7, 10 and 3x5 small integers; the sum on every rank, and only
    messages to the right neighbour, ``2(n - 1)/n`` of the tensor per rank."""
    runner.visible(LAB, "test_ex1_ring_all_reduce", folder=Path(path).parent)


def parameter_server(path: str = SERVER_FILE) -> None:
    """Visible check of exercise 2: the file on 3 processes (torchrun), 3 steps on 2 ranks
    and on 3; every gradient, every server step and every rank's final parameters."""
    runner.visible(LAB, "test_ex2_parameter_server", folder=Path(path).parent)


def stale_parameter_server(path: str = STALE_FILE) -> None:
    """Visible check of exercise 3: the file on 3 processes (torchrun), staleness 1 on 2 and
    on 3 ranks, staleness 2 on 3 ranks."""
    runner.visible(LAB, "test_ex3_stale_server", folder=Path(path).parent)


def cost_model(ring_time: Callable, server_time: Callable, fit_alpha_beta: Callable) -> None:
    """Visible check of exercise 4: both models' properties on fixed cases, then the fit on
    times made by your ``ring_time`` (exact on 4 ranks, with 2% noise on 4 and on 2)."""
    functions = {"ring_time": ring_time, "server_time": server_time}
    functions["fit_alpha_beta"] = fit_alpha_beta
    runner.visible(LAB, "test_ex4_cost_model", functions=functions)


def ready(*files: str, folder: str | Path = ".") -> bool:
    """True when the exercises that write ``files`` are done (the files exist and no longer
    hold the released stub); else print which exercise to finish first and return False.

    A demo cell that runs your files starts with it, so that an unfinished exercise is a
    one-line hint instead of a traceback from every rank.

    Example:
        >>> ready("ring.py", "ps.py", folder="/nowhere")
        finish exercises 1 and 2 first: ring.py was not written yet (run its %%writefile cell)
        False
    """
    todo = []
    for name in files:
        path = Path(folder) / name
        if not path.is_file():
            todo.append((name, "was not written yet (run its %%writefile cell)"))
        elif runner.STUB in path.read_text():
            todo.append((name, "still holds the stub"))
    if not todo:
        return True
    numbers = sorted({EXERCISE_OF_FILE.get(name, 0) for name, _ in todo})
    which = " and ".join(str(n) for n in numbers)
    name, why = todo[0]
    print(f"finish exercise{'s' * (len(numbers) > 1)} {which} first: {name} {why}")
    return False
