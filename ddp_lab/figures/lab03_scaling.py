"""The scaling figure of ``make lab3`` (and of the lab 3 notebook): throughput against the
number of processes, with the ideal line and the efficiency, and beside them what each run
learned (test accuracy, with its learning rate)."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt


def plot_scaling(
    processes: Sequence[int],
    samples_per_s: Sequence[float],
    title: str = "DDP scaling",
    path: str | None = None,
    accuracy: Sequence[float] | None = None,
    lrs: Sequence[float] | None = None,
):
    """Throughput against the number of processes, with the ideal line and the efficiency.

    Args:
        processes: process counts, e.g. ``[1, 2, 4]``.
        samples_per_s: measured global throughput for each count.
        title: figure title (say what hardware it was measured on).
        path: where to save the PNG, if anywhere.
        accuracy: each run's test accuracy, for a third panel (a faster run that learned
            less is no win).
        lrs: each run's learning rate, written under its accuracy.

    Returns:
        The figure, with two panels: throughput and scaling efficiency (speed-up / N), and
        a third with the test accuracy when ``accuracy`` is given.

    Example:
        >>> fig = plot_scaling([1, 2], [100.0, 180.0])
        >>> len(fig.axes)
        2
        >>> len(plot_scaling([1, 2], [100.0, 180.0], accuracy=[0.7, 0.69]).axes)
        3
    """
    base = samples_per_s[0] / processes[0]
    ideal = [base * n for n in processes]
    efficiency = [s / i for s, i in zip(samples_per_s, ideal, strict=True)]
    panels = 2 if accuracy is None else 3
    fig, axes = plt.subplots(1, panels, figsize=(4.5 * panels, 3.5))
    ax1, ax2 = axes[0], axes[1]
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
    if accuracy is not None:
        ax3 = axes[2]
        labels = [str(n) for n in processes]
        if lrs is not None:
            labels = [f"{n}\nlr {lr:g}" for n, lr in zip(processes, lrs, strict=True)]
        ax3.bar(labels, accuracy, color="tab:green")
        ax3.set_xlabel("processes")
        ax3.set_ylabel("test accuracy")
        ax3.set_ylim(0, 1.05)
        for i, a in enumerate(accuracy):
            ax3.text(i, a, f"{a:.3f}", ha="center", va="bottom")
    fig.suptitle(title)
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=100)
    return fig
