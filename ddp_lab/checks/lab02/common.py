"""What lab 2's distributed exercises share: their files, one torchrun job of 3 ranks that
grades both 2 and 3 ranks, a watchdog around every call, tolerances.

Every distributed exercise of the lab (the ring, the two parameter servers) is graded in
**one** torchrun job of :data:`JOB_RANKS` ranks. Its case holds several *runs*, each over
``ranks`` = 2 or 3 of them: in a 2-rank run, ranks 0 and 1 run the student's function while
rank 2 sits it out, and :func:`acting_world` makes ``dist.get_world_size()`` (and
``$WORLD_SIZE``) say 2 to the student's code. That is the checker's business: point-to-point
messages between ranks 0 and 1 need no process group of their own, so the student's code is
the same whatever the run. A barrier of the whole job separates the runs.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from ddp_lab.checks import guards

LAB = "lab02_collectives"
#: Files the notebook's distributed solution cells write (``%%writefile``).
RING_FILE, SERVER_FILE, STALE_FILE = "ring.py", "ps.py", "ps_stale.py"
#: Ranks of the one torchrun job that grades a distributed exercise (runs on 2 and 3 ranks).
JOB_RANKS = 3
#: Seconds one call of the student's function may take on a rank (small tensors: ms).
CALL_TIMEOUT_S = 15.0

_barrier = dist.barrier  # the checker's own (taken before any student code runs)
_real_world_size = dist.get_world_size
_acting: list[int | None] = [None]


def _world_size(group=None) -> int:
    if _acting[0] is not None and (group is None or group is dist.group.WORLD):
        return _acting[0]
    return _real_world_size(group)


@contextmanager
def acting_world(n: int) -> Iterator[None]:
    """While the block runs, the job looks like ``n`` ranks to the student's code.

    ``dist.get_world_size()`` (also when the student's file imported it by name, since
    :func:`each_run` installs the replacement before the file loads) and ``$WORLD_SIZE``
    say ``n``; everything else, ranks included, is the real job's.
    """
    saved, env = _acting[0], os.environ.get("WORLD_SIZE")
    _acting[0] = n
    os.environ["WORLD_SIZE"] = str(n)
    try:
        yield
    finally:
        _acting[0] = saved
        if env is None:
            os.environ.pop("WORLD_SIZE", None)
        else:
            os.environ["WORLD_SIZE"] = env


@contextmanager
def world_view() -> Iterator[None]:
    """Install the ``dist.get_world_size`` that :func:`acting_world` steers."""
    dist.get_world_size = _world_size
    try:
        yield
    finally:
        dist.get_world_size = _real_world_size


def each_run(case: dict, rank: int, one_run: Callable[[dict], object], load: Callable) -> list:
    """``one_run(run)`` on this rank for every run of ``case`` it takes part in.

    Args:
        case: ``{"world_size": 3, "runs": [{"ranks": 2 or 3, ...}, ...]}``.
        rank: this rank.
        one_run: the student's function on one run (called inside :func:`acting_world`).
        load: loads the student's file (called once, after the world view is installed).

    Returns:
        One entry per run: what ``one_run`` returned, or None where this rank sat it out.
    """
    out = []
    with world_view():
        load()
        for run in case["runs"]:
            if rank < run["ranks"]:
                with acting_world(run["ranks"]):
                    out.append(one_run(run))
            else:
                out.append(None)
            _barrier()  # the next run starts when every rank is done with this one
    return out


def watched(fn: Callable, what: str, hint: str) -> Callable:
    """``fn`` under a watchdog: a call that does not return within :data:`CALL_TIMEOUT_S`
    ends the rank with one line naming ``what`` hung and the likely cause (``hint``)."""

    def call(*args):
        def hung() -> str:
            where = f"rank {dist.get_rank()} of {dist.get_world_size()}"
            return (
                f"{fn.__name__}() did not return within {CALL_TIMEOUT_S:g} s on {where} "
                f"({what}): the ranks wait for each other. {hint}"
            )

        with guards.call_watchdog(CALL_TIMEOUT_S, hung):
            return fn(*args)

    return call


def student_function(file: str, name: str) -> Callable:
    """The function ``name`` of the student's ``file``, loaded with the collectives refused."""
    module = guards.load_student_file(file, forbid=guards.COLLECTIVES)
    fn = module.get(name)
    if not callable(fn):
        raise NameError(f"{file} defines no function {name}()")
    return fn


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """``(atol, rtol)`` for results computed in ``dtype``."""
    return (1e-9, 1e-9) if dtype == torch.float64 else (1e-5, 1e-5)


def numbers(items) -> str:
    """``"2 and 3"``, ``"1, 2 and 3"``."""
    items = [str(i) for i in items]
    return ", ".join(items[:-1]) + f" and {items[-1]}" if len(items) > 1 else items[0]


def worlds(inputs: dict) -> str:
    """The run sizes of a distributed exercise's inputs, in words (``"2 and 3"``)."""
    sizes = sorted({run["ranks"] for case in inputs["cases"] for run in case["runs"]})
    return numbers(sizes)
