"""What exercise 1's collectives move: every collective the student's code calls, recorded in
the checker's rank process, and the rule its traffic must follow.

:func:`recorded` wraps every collective of :data:`ddp_lab.checks.guards.COLLECTIVES` in
``torch.distributed`` and in ``distributed_c10d`` before the student's file is loaded (so a
name imported early, ``from torch.distributed import all_gather``, is the wrapper too). Each
call runs as it would, and is recorded once (a collective that calls another, such as
``all_gather_object``, counts as itself only) as ``[name, values, bytes]``: the values the
call leaves on this rank, the tensor(s) it fills (``all_reduce``: the tensor; ``all_gather``:
the whole list, one tensor per rank).

:func:`problem` and :func:`growth_problem` are the rule: only ``all_reduce`` (any op), at
most :data:`MAX_CALLS` per call of ``sync_mean_var``, none larger than
:func:`max_values` for ``C`` channels, and the same sizes on 2 ranks as on 3 for the same
``C``. Then what a rank sends and receives does not depend on the world size: an all-reduce
leaves one tensor the size of its input on every rank (the ring of lab 2 sends
``2(n - 1)/n`` of it per rank, less than twice), where an all-gather leaves ``n`` of them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from ddp_lab.checks import guards

#: All-reduces allowed in one call of ``sync_mean_var`` (two suffice).
MAX_CALLS = 3
#: The one collective exercise 1 may use.
ALLOWED = "all_reduce"


def max_values(channels: int) -> int:
    """The largest all-reduce allowed for ``channels`` channels: ``3C + 3`` values, however
    many ranks there are (a tensor with a slot per rank is larger from 2 ranks on)."""
    return 3 * channels + 3


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _filled(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensor(s) a collective fills: its first argument (positional or by keyword)."""
    if args:
        return _tensors(args[0])
    for value in kwargs.values():
        if found := _tensors(value):
            return found
    return []


@contextmanager
def recorded(log: list) -> Iterator[None]:
    """While the block runs, every collective call is appended to ``log`` as
    ``[name, values, bytes]`` (see the module), and then runs as it would.

    Example:
        >>> log = []
        >>> with recorded(log):  # doctest: +SKIP
        ...     dist.all_reduce(torch.zeros(3))
        >>> log  # doctest: +SKIP
        [['all_reduce', 3, 12]]
    """
    import torch.distributed.distributed_c10d as c10d

    depth = [0]
    wrappers: dict[int, object] = {}

    def wrap(name: str, fn):
        def collective(*args, **kwargs):
            if depth[0] == 0:
                filled = _filled(args, kwargs)
                values = sum(t.numel() for t in filled)
                log.append([name, values, sum(t.numel() * t.element_size() for t in filled)])
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1

        return collective

    saved = []
    for name in guards.COLLECTIVES:
        for module in (dist, c10d):
            fn = getattr(module, name, None)
            if fn is None:
                continue
            saved.append((module, name, fn))
            if id(fn) not in wrappers:
                wrappers[id(fn)] = wrap(name, fn)
            setattr(module, name, wrappers[id(fn)])
    try:
        yield
    finally:
        for module, name, fn in reversed(saved):
            setattr(module, name, fn)


def _said(call: list) -> str:
    name, values, size = call
    return f"dist.{name}" + (
        f" ({values} values, {size} bytes, arrived on this rank)" if values else ""
    )


def problem(where: str, channels: int, ranks: int, calls: list) -> str | None:
    """What breaks the traffic rule in one rank's calls of one run, or None."""
    others = [c for c in calls if c[0] != ALLOWED]
    if others:
        why = (
            f"A gather brings every rank's tensor to every rank: on {ranks} ranks each rank "
            f"receives {ranks} times what it sends, n times on n ranks, in every forward of "
            "every BatchNorm layer: traffic that grows with the world size. "
            if "gather" in others[0][0]
            else ""
        )
        return (
            f"{where}: your statistics are computed with {_said(others[0])}. {why}This "
            "exercise allows dist.all_reduce only, whose result is one tensor the size of "
            "yours whatever the number of ranks: work out which per-channel SUMS give the "
            "global statistics"
        )
    if len(calls) > MAX_CALLS:
        return (
            f"{where}: {len(calls)} all-reduces in one call of sync_mean_var; at most "
            f"{MAX_CALLS} (two suffice): each collective pays the network's latency, and a "
            "number of calls that grows with the ranks is traffic that grows with them"
        )
    limit = max_values(channels)
    for _, values, size in calls:
        if values > limit:
            return (
                f"{where}: an all-reduce of {values} values ({size} bytes) for {channels} "
                f"channel(s); at most 3C + 3 = {limit}, whatever the number of ranks: a tensor "
                "with a slot for every rank's numbers is an all-gather in disguise, and grows "
                "with the world size"
            )
    return None


def growth_problem(pairs: list[tuple[dict, list, dict, list]]) -> str | None:
    """Whether the all-reduces' sizes differ between a run on 2 ranks and one on 3 with the
    same number of channels: ``pairs`` of ``(run, rank 0's calls, run, rank 0's calls)``."""
    for small, small_calls, big, big_calls in pairs:
        a = [c[1] for c in small_calls]
        b = [c[1] for c in big_calls]
        if a != b:
            return (
                f"with {small['channels']} channel(s), your all-reduces moved {a} values on "
                f"{small['ranks']} ranks but {b} on {big['ranks']} ranks: the traffic grows with "
                "the world size. What a rank contributes must not depend on how many ranks "
                "there are: per-channel sums, added up by the all-reduce"
            )
    return None
