"""The scaling figure of ``make lab3`` (and of the lab 3 notebook): throughput against the
number of processes, with the ideal line and the efficiency."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt


def plot_scaling(
    processes: Sequence[int],
    samples_per_s: Sequence[float],
    title: str = "DDP scaling",
    path: str | None = None,
):
    """Throughput against the number of processes, with the ideal line and the efficiency.

    Args:
        processes: process counts, e.g. ``[1, 2, 4]``.
        samples_per_s: measured global throughput for each count.
        title: figure title (say what hardware it was measured on).
        path: where to save the PNG, if anywhere.

    Returns:
        The figure, with two panels: throughput and scaling efficiency (speed-up / N).

    Example:
        >>> fig = plot_scaling([1, 2], [100.0, 180.0])
        >>> len(fig.axes)
        2
    """
    base = samples_per_s[0] / processes[0]
    ideal = [base * n for n in processes]
    efficiency = [s / i for s, i in zip(samples_per_s, ideal, strict=True)]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.5))
    ax1.plot(processes, ideal, "--", color="grey", label="ideal (linear)")
    ax1.plot(processes, samples_per_s, "o-", label="measured")
    ax1.set_xlabel("processes")
    ax1.set_ylabel("samples / s")
    ax1.set_xticks(list(processes))
    ax1.legend()
    ax2.bar([str(n) for n in processes], efficiency)
    ax2.axhline(1.0, color="grey", linestyle="--")
    ax2.set_xlabel("processes")
    ax2.set_ylabel("efficiency (speed-up / N)")
    ax2.set_ylim(0, max(1.1, max(efficiency) * 1.1))
    for i, e in enumerate(efficiency):
        ax2.text(i, e, f"{e:.0%}", ha="center", va="bottom")
    fig.suptitle(title)
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=100)
    return fig
