"""Figures of lab 1 (data parallelism in one process), one function per concept.

Every function returns a matplotlib Figure that is already closed for pyplot, so a
notebook cell that ends with the call shows it exactly once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import FancyBboxPatch

from ddp_lab.figures.style import COLORS, GREY
from ddp_lab.figures.style import arrow as _arrow
from ddp_lab.figures.style import box as _box
from ddp_lab.figures.style import done as _done


def data_parallel_step(sizes: Sequence[int] = (4, 4, 3)) -> Figure:
    """One data-parallel step: a batch cut into shards, one replica per shard, gradients combined.

    Args:
        sizes: the shard sizes ``B_k`` (their sum is the batch size ``B``).

    Returns:
        The figure: the batch as a row of samples coloured by shard, a replica per shard
        computing the shard's mean-loss gradient ``g_k``, and their combination into the
        full-batch gradient (the weights are exercise 2's question, not drawn).

    Example:
        >>> fig = data_parallel_step((2, 2))
        >>> len(fig.axes)
        1
    """
    n, total = len(sizes), sum(sizes)
    fig, ax = plt.subplots(figsize=(9, 0.9 + 0.9 * n))
    height = 0.9 * n
    ax.set_xlim(0, 10)
    ax.set_ylim(-0.2, height + 0.45)
    ax.axis("off")
    ax.text(0.9, height + 0.25, f"batch of B = {total} samples", ha="center", fontsize=10)
    cell = height / total
    row_y = []
    start = 0
    for k, size in enumerate(sizes):
        color = COLORS[k % len(COLORS)]
        for i in range(size):
            y = height - (start + i + 1) * cell
            ax.add_patch(
                FancyBboxPatch(
                    (0.6, y + 0.1 * cell),
                    0.6,
                    0.8 * cell,
                    boxstyle="square,pad=0",
                    facecolor=color,
                    edgecolor="white",
                    alpha=0.8,
                )
            )
        mid = height - (start + size / 2) * cell
        start += size
        y = height - (k + 0.5) * (height / n)
        row_y.append(y)
        _arrow(ax, (1.25, mid), (2.4, y), color=color)
        _box(
            ax,
            2.45,
            y - 0.3,
            3.1,
            0.6,
            f"replica {k}: same weights\nloss on its {size} samples -> $g_{k}$",
            color,
        )
        _arrow(ax, (5.6, y), (6.7, height / 2), color=color)
    parts = ", ".join(f"$g_{k}$" for k in range(n))
    _box(
        ax,
        6.75,
        height / 2 - 0.45,
        3.2,
        0.9,
        f"combine {parts}\ninto the full-batch gradient $g$\n(which weights? exercise 2)",
        GREY,
        alpha=0.2,
    )
    ax.set_title(
        "Data parallelism: split the batch, run a replica per shard, combine gradients", fontsize=10
    )
    return _done(fig)


def dataparallel_timeline(n: int = 3) -> Figure:
    """What ``nn.DataParallel`` does in one training step, device by device, in time order.

    Args:
        n: number of devices (rows); device 0 holds the model and the batch.

    Returns:
        The figure: one row per device and one column per phase (replicate, scatter,
        parallel_apply, gather + loss, backward, reduce gradients). Replicate and reduce
        are chain transfers (``broadcast_coalesced`` / ``reduce_add_coalesced``: NCCL passes
        chunks from device to device, every link busy at once); scatter and gather go
        through device 0, one device after another.

    Example:
        >>> fig = dataparallel_timeline(2)
        >>> len(fig.axes)
        1
    """
    phases = [
        ("replicate", "weights along the chain\n(broadcast_coalesced)", "down"),
        ("scatter", "cut the batch,\nsend the chunks", "out"),
        ("parallel_apply", "forward, one\nPython thread each", "all"),
        ("gather", "outputs to device 0,\nloss there", "in"),
        ("backward", "output grads out,\nbackward per replica", "all"),
        ("reduce", "gradients summed along\nthe chain (reduce_add)", "up"),
    ]
    width, gap = 1.6, 0.25
    fig, ax = plt.subplots(figsize=(10, 1.4 + 0.7 * n))
    ax.set_xlim(-1.0, len(phases) * (width + gap))
    ax.set_ylim(-0.8 * (n - 1) - 0.35, 1.3)
    ax.axis("off")

    def row(d):
        return -0.8 * d

    for d in range(n):
        ax.text(
            -0.95,
            row(d),
            f"device {d}",
            va="center",
            fontsize=9,
            fontweight="bold" if d == 0 else None,
        )
    slot = width / max(1, n - 1)
    for p, (name, what, kind) in enumerate(phases):
        x0 = p * (width + gap)
        color = COLORS[p % len(COLORS)]
        ax.text(x0 + width / 2, 1.0, name, ha="center", fontsize=9, fontweight="bold")
        ax.text(x0 + width / 2, 0.52, what, ha="center", va="center", fontsize=7.5)
        if kind == "all":
            for d in range(n):
                _box(ax, x0, row(d) - 0.25, width, 0.5, "", color)
            continue
        if kind in ("down", "up"):  # a pipelined chain: every device busy the whole phase
            for d in range(n):
                _box(ax, x0, row(d) - 0.25, width, 0.5, "chunks" if d == 0 else "", color)
            for d in range(n - 1):
                mid = x0 + width * (0.3 + 0.4 * d / max(1, n - 2))
                top, bottom = row(d) - 0.25, row(d + 1) + 0.25
                start, end = ((mid, top), (mid, bottom))
                if kind == "up":
                    start, end = end, start
                _arrow(ax, start, end)
            continue
        # through device 0: busy for the whole phase, device d only for its turn
        label = {"out": f"sends {n - 1}x", "in": f"receives {n - 1}x"}[kind]
        if name == "gather":
            label += ", loss"
        _box(ax, x0, row(0) - 0.25, width, 0.5, label, color, alpha=0.45, fontsize=8)
        for d in range(1, n):
            xs = x0 + (d - 1) * slot
            _box(ax, xs + 0.03, row(d) - 0.25, slot - 0.06, 0.5, "", color)
            top, bottom = (row(0) - 0.25, row(d) + 0.25)
            mid = xs + slot / 2
            if kind == "out":
                _arrow(ax, (mid, top), (mid, bottom))
            else:
                _arrow(ax, (mid, bottom), (mid, top))
    ax.set_title(
        "nn.DataParallel, one training step: chains for the weights and gradients, device 0 "
        "for the data",
        fontsize=10,
    )
    return _done(fig)


def chain_pipeline(n: int = 4, chunks: int = 5) -> Figure:
    """A pipelined transfer along a chain of devices: which link carries which chunk when.

    Args:
        n: devices in the chain ``0 -> 1 -> ... -> n-1`` (``n - 1`` links).
        chunks: the message, cut into this many equal chunks.

    Returns:
        The figure: one row per link, time in units of one chunk's transfer over one link;
        chunk ``j`` crosses link ``h`` in slot ``j + h``.

    Example:
        >>> fig = chain_pipeline(3, 2)
        >>> len(fig.axes)
        1
    """
    links = max(1, n - 1)
    fig, ax = plt.subplots(figsize=(8, 0.9 + 0.55 * links))
    for h in range(links):
        for j in range(chunks):
            ax.add_patch(
                FancyBboxPatch(
                    (j + h + 0.04, links - 1 - h + 0.12),
                    0.92,
                    0.76,
                    boxstyle="square,pad=0",
                    facecolor=COLORS[j % len(COLORS)],
                    alpha=0.8,
                )
            )
            ax.text(j + h + 0.5, links - 1 - h + 0.5, f"c{j}", ha="center", va="center", fontsize=8)
    ax.set_xlim(0, chunks + links - 1 + 0.2)
    ax.set_ylim(0, links)
    ax.set_yticks([links - 1 - h + 0.5 for h in range(links)])
    ax.set_yticklabels([f"link {h} -> {h + 1}" for h in range(links)], fontsize=8)
    ax.set_xticks(range(chunks + links))
    ax.set_xlabel("time, in units of one chunk over one link (chunk_bytes / bandwidth)")
    ax.set_title(
        f"A pipelined broadcast: {chunks} chunks, {n} devices; every link busy at once",
        fontsize=10,
    )
    return _done(fig)


def imbalance_error(
    small_sizes: Sequence[int],
    plain: Sequence[float],
    weighted: Sequence[float],
    batch: int,
) -> Figure:
    """Relative gradient error of two shards, against how unequal they are.

    Args:
        small_sizes: the size of the smaller shard for each point (the other holds
            ``batch - small``).
        plain: relative error of the plain average of the two shard gradients.
        weighted: relative error of the student's combination (``data_parallel_step``).
        batch: the batch size ``B``.

    Returns:
        The figure (log-scale y; errors of 0 are drawn at machine precision).

    Example:
        >>> fig = imbalance_error([1, 2], [0.5, 0.3], [1e-17, 2e-17], batch=4)
        >>> len(fig.axes)
        1
    """
    floor = 1e-17
    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    ax.semilogy(
        small_sizes,
        [max(e, floor) for e in plain],
        "o-",
        color=COLORS[3],
        label="plain average  (g_0 + g_1) / 2",
    )
    ax.semilogy(
        small_sizes,
        [max(e, floor) for e in weighted],
        "s-",
        color=COLORS[2],
        label="your data_parallel_step",
    )
    ax.axvline(batch / 2, color=GREY, ls="--", lw=1)
    ax.text(
        batch / 2, ax.get_ylim()[1], "equal shards ", ha="right", va="top", fontsize=8, color=GREY
    )
    ax.set_xlabel(f"size of the smaller shard (batch B = {batch})")
    ax.set_ylabel("|g_combined - g_full| / |g_full|")
    ax.set_title("Unequal shards: the plain average is biased, yours is exact", fontsize=10)
    ax.legend(fontsize=8, loc="center right")
    return _done(fig)


def shard_statistics(shard_means, global_mean, feature_names: Sequence[str] | None = None):
    """Per-shard means of a few features next to the mean over the whole batch.

    Args:
        shard_means: ``(n_shards, n_features)`` means each replica's BatchNorm would use.
        global_mean: ``(n_features,)`` mean over the whole batch.
        feature_names: labels of the features (default ``feature 0`` ...).

    Returns:
        The figure: one group of bars per feature (a bar per shard) and a black line at
        the batch mean.

    Example:
        >>> import torch
        >>> fig = shard_statistics(torch.zeros(2, 3), torch.zeros(3))
        >>> len(fig.axes)
        1
    """
    means = [[float(v) for v in row] for row in shard_means]
    overall = [float(v) for v in global_mean]
    n, c = len(means), len(overall)
    names = list(feature_names or [f"feature {j}" for j in range(c)])
    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    w = 0.8 / n
    for k in range(n):
        ax.bar(
            [j - 0.4 + (k + 0.5) * w for j in range(c)],
            means[k],
            width=w,
            color=COLORS[k % len(COLORS)],
            alpha=0.85,
            label=f"shard {k}",
        )
    for j in range(c):
        ax.hlines(
            overall[j],
            j - 0.45,
            j + 0.45,
            color="black",
            lw=2,
            label="whole batch" if j == 0 else None,
        )
    ax.axhline(0, color=GREY, lw=0.5)
    ax.set_xticks(range(c), names)
    ax.set_ylabel("mean BatchNorm would subtract")
    ax.set_title("Each replica normalises with its own shard's statistics", fontsize=10)
    ax.legend(fontsize=8, ncol=n + 1, loc="upper center", bbox_to_anchor=(0.5, -0.15))
    return _done(fig)


def step_time_curves(
    devices: Sequence[int],
    times: Mapping[str, Sequence[float]],
    ideal: Sequence[float] | None = None,
) -> Figure:
    """Predicted step time and speed-up against the number of devices.

    Args:
        devices: device counts ``n`` (the first one is the baseline of the speed-up).
        times: ``label -> step time (s) for each n``, e.g. ``{"nn.DataParallel": [...],
            "DDP": [...]}``.
        ideal: optional perfectly parallel times (``compute / n``), drawn dashed.

    Returns:
        The figure, with two panels: step time (s) and speed-up over the first count.

    Example:
        >>> fig = step_time_curves([1, 2], {"a": [1.0, 0.6]}, ideal=[1.0, 0.5])
        >>> len(fig.axes)
        2
    """
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.2))
    if ideal is not None:
        ax1.plot(devices, ideal, "--", color=GREY, label="ideal (compute / n)")
        ax2.plot(devices, [ideal[0] / t for t in ideal], "--", color=GREY, label="ideal")
    for i, (label, ts) in enumerate(times.items()):
        ax1.plot(devices, ts, "o-", color=COLORS[i % len(COLORS)], label=label)
        ax2.plot(devices, [ts[0] / t for t in ts], "o-", color=COLORS[i % len(COLORS)], label=label)
    ax1.set_xlabel("devices n")
    ax1.set_ylabel("seconds per step")
    ax1.set_ylim(bottom=0)
    ax2.set_xlabel("devices n")
    ax2.set_ylabel("speed-up over n = 1")
    for ax in (ax1, ax2):
        ax.set_xticks(list(devices))
        ax.legend(fontsize=8)
    fig.suptitle("Cost model: where nn.DataParallel stops scaling", fontsize=10)
    return _done(fig)
