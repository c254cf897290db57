"""The figure of ``make lab5``: loss curves and step times of the precision and
accumulation runs (``results/lab5/lab5.png``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from ddp_lab.figures.style import COLORS
from ddp_lab.figures.style import done as _done


def lab5_runs(
    curves: Mapping[str, tuple[Sequence[int], Sequence[float]]],
    step_ms: Mapping[str, float],
    title: str,
) -> Figure:
    """Training loss per run, and each run's time per optimizer step.

    Args:
        curves: ``label -> (steps, losses)`` from each run's ``metrics.jsonl``.
        step_ms: ``label -> milliseconds per optimizer step`` (same labels).
        title: what ran where (model, processes, device).

    Returns:
        The figure, two panels; the bars are annotated with the ratio to the first run.

    Example:
        >>> fig = lab5_runs({"fp32": ([1, 2], [2.3, 2.0])}, {"fp32": 10.0}, "t")
        >>> len(fig.axes)
        2
    """
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6), gridspec_kw={"width_ratios": [2, 1]})
    for i, (label, (steps, losses)) in enumerate(curves.items()):
        style = ("-", "--", ":", "-.")[i % 4]  # the curves nearly coincide: tell them apart
        ax1.plot(steps, losses, style, color=COLORS[i % len(COLORS)], label=label, lw=1.5)
    ax1.set_xlabel("optimizer step")
    ax1.set_ylabel("training loss")
    ax1.legend(fontsize=8)
    labels = list(step_ms)
    base = step_ms[labels[0]]
    ax2.bar(range(len(labels)), [step_ms[k] for k in labels], color=COLORS[: len(labels)])
    for i, k in enumerate(labels):
        ax2.text(i, step_ms[k], f"{step_ms[k] / base:.2f}x", ha="center", va="bottom", fontsize=8)
    ax2.set_xticks(range(len(labels)), labels, rotation=20, fontsize=8)
    ax2.set_ylabel("ms per optimizer step")
    fig.suptitle(title, fontsize=10)
    return _done(fig)
