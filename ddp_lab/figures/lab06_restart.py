"""The figure of ``make lab6``: the restart timeline of a run with an injected fault, from
the failure to the first step after the restart (``results/lab6/timeline.png``)."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from ddp_lab.figures.style import COLORS
from ddp_lab.figures.style import done as _done


def restart_timeline(phases: Sequence[tuple[str, float, float]], title: str) -> Figure:
    """One bar per phase of a restart, on a time axis starting at the failure.

    Args:
        phases: ``(name, start_s, end_s)`` in seconds after the failure, in order, e.g.
            ``("detection", 0.0, 0.4)``.
        title: what failed, where.

    Returns:
        The figure: a Gantt-like row per phase with its duration, and the total.

    Example:
        >>> fig = restart_timeline([("detection", 0.0, 0.5), ("first step", 0.5, 2.0)], "t")
        >>> len(fig.axes)
        1
    """
    fig, ax = plt.subplots(figsize=(9, 0.6 + 0.5 * len(phases)))
    for i, (_, start, end) in enumerate(phases):
        y = len(phases) - 1 - i
        ax.barh(y, end - start, left=start, color=COLORS[i % len(COLORS)], alpha=0.85)
        ax.text(end, y, f" {end - start:.2f} s", va="center", fontsize=8)
    ax.set_yticks(range(len(phases)), [p[0] for p in reversed(phases)], fontsize=8)
    total = phases[-1][2] if phases else 0.0
    ax.set_xlabel(f"seconds after the failure (total {total:.2f} s to the first step)")
    ax.set_xlim(0, max(total * 1.15, 0.1))
    ax.set_title(title, fontsize=10)
    return _done(fig)
