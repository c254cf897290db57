"""Pipeline stages with a fixed compute time, and the busy and idle time of a schedule.

A :class:`TimedStage` is a ``Linear`` layer (real math) whose forward takes ``forward_s``
seconds and whose backward ``backward_s`` (a sleep, recorded with wall-clock times): every
stage costs the same, whatever the machine and however many processes share its cores, so
the time a pipeline schedule leaves stages waiting, its *bubble*, can be measured on a
laptop and compared with GPipe's ``(p - 1) / (m + p - 1)``; and from the same records, how
many micro-batches' activations each stage holds at once (:func:`peak_held`: GPipe ``m``,
1F1B at most ``p - s`` on stage ``s``).

Example:
    >>> stage = TimedStage(4, forward_s=0.0, backward_s=0.0)
    >>> stage(torch.randn(2, 4)).sum().backward()
    >>> [e[0] for e in stage.events]
    ['F', 'B']
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import nn


class _Timed(torch.autograd.Function):
    """Identity that sleeps and records ``("F"|"B", start, end)`` on the stage."""

    @staticmethod
    def forward(ctx, x, stage):
        ctx.stage = stage
        start = time.time()
        time.sleep(stage.forward_s)
        stage.events.append(("F", start, time.time()))
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        stage = ctx.stage
        start = time.time()
        time.sleep(stage.backward_s)
        stage.events.append(("B", start, time.time()))
        return grad, None


class TimedStage(nn.Module):
    """``Linear(width, width)`` that takes ``forward_s`` / ``backward_s`` seconds.

    Attributes:
        events: ``(kind, start, end)`` per forward (``"F"``) and backward (``"B"``) pass,
            wall-clock seconds (``time.time()``: comparable between processes of a machine).
    """

    def __init__(self, width: int, forward_s: float = 0.02, backward_s: float = 0.04):
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.forward_s, self.backward_s = forward_s, backward_s
        self.events: list[tuple[str, float, float]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Timed.apply(self.linear(x), self)


def busy_and_span(events: Sequence[Sequence[tuple]]) -> tuple[list[float], float, float]:
    """Per stage the seconds spent computing, and the schedule's start and length.

    Args:
        events: per stage (rank), its ``(kind, start, end)`` records.

    Returns:
        ``(busy seconds per stage, first start, makespan)``.
    """
    starts = [e[1] for rank in events for e in rank]
    ends = [e[2] for rank in events for e in rank]
    t0 = min(starts)
    busy = [sum(e[2] - e[1] for e in rank) for rank in events]
    return busy, t0, max(ends) - t0


def bubble(events: Sequence[Sequence[tuple]]) -> float:
    """The share of the stages' time spent waiting: ``1 - busy / (stages x makespan)``.

    Example:
        >>> bubble([[("F", 0, 1), ("B", 3, 5)], [("F", 1, 2), ("B", 2, 4)]])
        0.4
    """
    busy, _, span = busy_and_span(events)
    return 1 - sum(busy) / (len(events) * span)


def held(events: Sequence[tuple]) -> list[tuple[float, int]]:
    """How many micro-batches' activations one stage holds over time: after each of its
    records in time order, ``(time, forwards done - backwards done)`` (a forward keeps its
    activations until the backward of the same micro-batch has used them).

    Example:
        >>> held([("F", 0, 1), ("F", 1, 2), ("B", 2, 4), ("B", 4, 6)])
        [(1, 1), (2, 2), (4, 1), (6, 0)]
    """
    count, out = 0, []
    for kind, _, end in sorted(events, key=lambda e: e[1]):
        count += 1 if kind == "F" else -1
        out.append((end, count))
    return out


def peak_held(events: Sequence[tuple]) -> int:
    """The most micro-batches' activations a stage held at once (:func:`held`).

    Example:
        >>> peak_held([("F", 0, 1), ("B", 1, 3), ("F", 3, 4), ("B", 4, 6)])
        1
    """
    return max((n for _, n in held(events)), default=0)


def gpipe_bubble(stages: int, micro_batches: int) -> float:
    """GPipe's bubble with equal stages: ``(p - 1) / (m + p - 1)``.

    Example:
        >>> gpipe_bubble(4, 8)
        0.2727272727272727
    """
    return (stages - 1) / (micro_batches + stages - 1)
