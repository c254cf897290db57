"""Figures of lab 4 (SyncBatchNorm), one function per concept.

Every function returns a matplotlib Figure that is already closed for pyplot, so a
notebook cell that ends with the call shows it exactly once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import FancyBboxPatch

from ddp_lab.figures.style import COLORS, GREY, box
from ddp_lab.figures.style import arrow as _arrow
from ddp_lab.figures.style import done as _done


def _box(*args, fontsize=8.5, **kwargs):
    box(*args, fontsize=fontsize, **kwargs)


def statistics_noise(batch_sizes: Sequence[int], errors: Mapping[str, Sequence[float]]) -> Figure:
    """How far a batch's BatchNorm statistics stray from the data set's, against batch size.

    Args:
        batch_sizes: the batch sizes ``b`` measured.
        errors: ``label -> typical error for each b`` (e.g. the root mean square error of
            the batch mean in units of the feature's standard deviation).

    Returns:
        The figure (log-log), with the ``1 / sqrt(b)`` law through the first curve's start.

    Example:
        >>> fig = statistics_noise([1, 4], {"mean": [0.5, 0.25]})
        >>> len(fig.axes)
        1
    """
    b = [float(v) for v in batch_sizes]
    fig, ax = plt.subplots(figsize=(6.5, 3.3))
    markers = "os^v"
    for i, (label, values) in enumerate(errors.items()):
        ax.loglog(
            b, [float(v) for v in values], marker=markers[i % 4], color=COLORS[i], label=label
        )
    first = [float(v) for v in next(iter(errors.values()))]
    ax.loglog(
        b,
        [first[0] * (b[0] / v) ** 0.5 for v in b],
        "--",
        color=GREY,
        label=r"$\propto 1/\sqrt{b}$",
    )
    ax.set_xticks(b, [f"{int(v)}" for v in b])
    ax.minorticks_off()
    ax.set_xlabel("samples per batch b (what one device sees)")
    ax.set_ylabel("typical error (in feature std)")
    ax.set_title("BatchNorm statistics of a small batch are noisy", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(True, which="major", alpha=0.3)
    return _done(fig)


def rank_statistics(
    rank_means: Sequence[Sequence[float]],
    global_mean: Sequence[float],
    sizes: Sequence[int] | None = None,
    ylabel: str = "mean BatchNorm subtracts",
) -> Figure:
    """Per-rank means of a few channels next to the mean of the global batch.

    Args:
        rank_means: ``(ranks, channels)`` the means each rank's BatchNorm would subtract.
        global_mean: ``(channels,)`` the mean over the global batch.
        sizes: the ranks' batch sizes, for the legend.
        ylabel: the y axis label.

    Returns:
        The figure: a group of bars per channel (a bar per rank), a black line at the
        global mean.

    Example:
        >>> fig = rank_statistics([[0.0, 1.0], [1.0, 0.0]], [0.5, 0.5])
        >>> len(fig.axes)
        1
    """
    means = [[float(v) for v in row] for row in rank_means]
    overall = [float(v) for v in global_mean]
    n, c = len(means), len(overall)
    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    w = 0.8 / n
    for k in range(n):
        label = f"rank {k}" + (f" ({sizes[k]} samples)" if sizes is not None else "")
        ax.bar(
            [j - 0.4 + (k + 0.5) * w for j in range(c)],
            means[k],
            width=w,
            color=COLORS[k % len(COLORS)],
            alpha=0.85,
            label=label,
        )
    for j in range(c):
        ax.hlines(
            overall[j],
            j - 0.45,
            j + 0.45,
            color="black",
            lw=2,
            label="global batch" if j == 0 else None,
        )
    ax.axhline(0, color=GREY, lw=0.5)
    ax.set_xticks(range(c), [f"channel {j}" for j in range(c)])
    ax.set_ylabel(ylabel)
    ax.set_title(
        "Plain BatchNorm under DDP: every rank normalises with its own statistics", fontsize=10
    )
    ax.legend(fontsize=8, ncol=n + 1, loc="upper center", bbox_to_anchor=(0.5, -0.13))
    return _done(fig)


def buffer_broadcast(curves: Mapping[str, Sequence[float]], channel: int = 0) -> Figure:
    """One channel's ``running_mean`` step by step, for several runs of the same batches.

    Args:
        curves: ``label -> running_mean after each step``. Labels containing "rank 1" are
            drawn dashed with markers, labels containing "reference" grey or black.
        channel: the channel shown (for the axis label).

    Returns:
        The figure.

    Example:
        >>> fig = buffer_broadcast({"a": [0.0, 0.1], "reference b": [0.0, 0.2]})
        >>> len(fig.axes)
        1
    """
    fig, ax = plt.subplots(figsize=(7, 3.4))
    styles = {"lw": 1.8}
    for i, (label, values) in enumerate(curves.items()):
        steps = list(range(1, len(values) + 1))
        kw = dict(styles, color=COLORS[i % len(COLORS)], marker="o", ms=4)
        if "rank 1" in label:
            kw.update(ls="--", marker="x", ms=6)
        if "reference" in label:
            kw.update(color="black" if "global" in label else GREY, marker=None, lw=3, alpha=0.45)
        ax.plot(steps, [float(v) for v in values], label=label, **kw)
    ax.set_xlabel("training step")
    ax.set_ylabel(f"running_mean[{channel}] after the step")
    ax.set_title(
        "Whose statistics survive? DDP copies rank 0's buffers at every forward", fontsize=10
    )
    ax.legend(fontsize=7.5, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.grid(True, alpha=0.3)
    return _done(fig)


def syncbn_flow(sizes: Sequence[int] = (3, 5, 0)) -> Figure:
    """Synchronised BatchNorm, forward and backward: what each rank computes and exchanges.

    Args:
        sizes: the ranks' batch sizes (they may differ, and be 0).

    Returns:
        The figure: one row per rank; forward as ``nn.SyncBatchNorm`` does it: this rank's
        per-channel statistics -> all-gather -> the same global mean and variance on every
        rank (exercise 1 gets them from all-reduces instead) -> normalise its own slice;
        backward: two per-channel sums -> all-reduce -> its own ``dx`` (exercise 2).

    Example:
        >>> fig = syncbn_flow((2, 3))
        >>> len(fig.axes)
        1
    """
    n = len(sizes)
    fig, ax = plt.subplots(figsize=(10, 1.3 + 0.85 * n))
    ax.set_xlim(-0.1, 10.4)
    ax.set_ylim(-0.85 * (n - 1) - 0.4, 1.05)
    ax.axis("off")
    cols = [
        (0.0, 1.3, "this rank's\nslice"),
        (1.6, 1.9, "forward: statistics\nof its own slice"),
        (5.4, 1.8, "global mean, var\n(same on every rank)"),
        (7.5, 2.8, "backward: two per-channel\nsums -> all_reduce -> dx"),
    ]
    for x, w, title in cols:
        ax.text(x + w / 2, 0.78, title, ha="center", va="center", fontsize=8.5, fontweight="bold")
    ax.text(4.55, 0.78, "all_gather", ha="center", va="center", fontsize=8.5, fontweight="bold")
    rows = [-0.85 * k for k in range(n)]
    mid = (rows[0] + rows[-1]) / 2
    for k, (y, size) in enumerate(zip(rows, sizes, strict=True)):
        color = COLORS[k % len(COLORS)]
        _box(ax, 0.0, y - 0.28, 1.3, 0.56, f"rank {k}\n{size} samples", color, alpha=0.35)
        said = "  (weighs 0)" if size == 0 else ""
        _box(ax, 1.6, y - 0.28, 1.9, 0.56, f"n{k}, mean{k}, var{k}{said}", color)
        _arrow(ax, (1.32, y), (1.58, y))
        _arrow(ax, (3.52, y), (4.1, mid))
        _arrow(ax, (5.0, mid), (5.38, y))
        _box(ax, 5.4, y - 0.28, 1.8, 0.56, "combine the table\n(nn.SyncBatchNorm)", GREY, alpha=0.2)
        _arrow(ax, (7.22, y), (7.48, y))
        _box(
            ax,
            7.5,
            y - 0.28,
            2.8,
            0.56,
            f"dx of rank {k}'s slice\n(global sums, global n; exercise 2)",
            color,
            alpha=0.15,
        )
    top, bottom = rows[0] + 0.3, rows[-1] - 0.3
    ax.add_patch(
        FancyBboxPatch(
            (4.1, bottom),
            0.9,
            top - bottom,
            boxstyle="round,pad=0.02",
            facecolor="black",
            alpha=0.08,
            edgecolor="black",
        )
    )
    table = "\n".join(f"n{k} m{k} v{k}" for k in range(n))
    ax.text(4.55, mid, table, ha="center", va="center", fontsize=8)
    ax.set_title(
        "Synchronised BatchNorm: every rank gets every rank's statistics (never an average of "
        "means), then normalises its own slice",
        fontsize=10,
    )
    return _done(fig)


def averaging_error(
    shares: Sequence[float],
    mean_error: Sequence[float],
    var_error: Sequence[float],
) -> Figure:
    """The error of averaging per-rank means and variances, against how unequal the ranks are.

    Args:
        shares: rank 0's share of the global batch for each point (0.5 = equal halves).
        mean_error: ``|average of rank means - global mean|`` for each share.
        var_error: ``|average of rank variances - global variance|`` for each share.

    Returns:
        The figure.

    Example:
        >>> fig = averaging_error([0.25, 0.5], [0.3, 0.0], [0.6, 0.4])
        >>> len(fig.axes)
        1
    """
    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    ax.plot(shares, mean_error, "o-", color=COLORS[3], label="mean: average of rank means")
    ax.plot(shares, var_error, "s-", color=COLORS[4], label="variance: average of rank variances")
    ax.axhline(0, color=COLORS[2], lw=2, label="the global batch's statistics (exact)")
    ax.axvline(0.5, color=GREY, ls="--", lw=1)
    ax.set_xlabel("rank 0's share of the global batch (2 ranks)")
    ax.set_ylabel("abs. error vs the global batch")
    ax.set_title("Averaging per-rank statistics is wrong as soon as the ranks differ", fontsize=10)
    ax.legend(fontsize=8)
    return _done(fig)


def training_runs(
    losses: Mapping[str, Sequence[float]], accuracy: Mapping[str, float], smooth: int = 10
) -> Figure:
    """Training loss (moving average) and final test accuracy of a few trainer runs.

    Args:
        losses: ``label -> training loss per step``.
        accuracy: ``label -> final test accuracy`` (same labels).
        smooth: window of the moving average.

    Returns:
        The figure, two panels.

    Example:
        >>> fig = training_runs({"a": [2.0, 1.0, 0.5]}, {"a": 0.6}, smooth=2)
        >>> len(fig.axes)
        2
    """
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9.5, 3.3), gridspec_kw={"width_ratios": [2.2, 1]})
    for i, (label, values) in enumerate(losses.items()):
        v = [float(x) for x in values]
        k = max(1, min(smooth, len(v)))
        avg = [sum(v[j - k + 1 : j + 1]) / k for j in range(k - 1, len(v))]
        ls = "--" if i == 2 else "-"
        ax1.plot(
            range(k, len(v) + 1),
            avg,
            ls,
            color=COLORS[i % len(COLORS)],
            label=label,
            lw=2.2 if i == 2 else 1.5,
        )
    ax1.set_xlabel("step")
    ax1.set_ylabel(f"training loss (mean of {smooth} steps)")
    ax1.legend(fontsize=8)
    labels = list(accuracy)
    ax2.bar(
        range(len(labels)),
        [100 * accuracy[k] for k in labels],
        color=[COLORS[i % len(COLORS)] for i in range(len(labels))],
        alpha=0.85,
    )
    for i, k in enumerate(labels):
        ax2.text(
            i, 100 * accuracy[k], f"{100 * accuracy[k]:.1f}", ha="center", va="bottom", fontsize=8
        )
    ax2.set_xticks(range(len(labels)), [k.replace(", ", "\n") for k in labels], fontsize=7.5)
    ax2.set_ylabel("test accuracy (%)")
    fig.suptitle("The trainer at a tiny per-process batch, with and without --sync-bn", fontsize=10)
    return _done(fig)


def drift(steps: Sequence[int], curves: Mapping[str, Sequence[float]]) -> Figure:
    """How far apart runs that are equal in exact arithmetic end up, step by step.

    Args:
        steps: the optimizer steps compared.
        curves: ``label -> largest absolute difference of the weights at each step``.

    Returns:
        The figure (log scale), with float32's rounding of a weight near 1 marked.

    Example:
        >>> fig = drift([2, 4], {"a vs b": [1e-8, 1e-5]})
        >>> len(fig.axes)
        1
    """
    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    markers = "os^v"
    for i, (label, values) in enumerate(curves.items()):
        shown = [max(float(v), 1e-9) for v in values]
        ax.semilogy(list(steps), shown, marker=markers[i % 4], color=COLORS[i], label=label)
    ax.axhline(6e-8, color=GREY, ls="--", lw=1, label="float32 rounding near 1")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("max |weight difference|")
    ax.set_title("Equal in exact arithmetic, apart after a few steps", fontsize=10)
    ax.legend(fontsize=8)
    return _done(fig)
