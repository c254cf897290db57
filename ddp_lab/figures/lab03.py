"""Figures of lab 3 (DistributedDataParallel), one function per concept.

Every function returns a matplotlib Figure that is already closed for pyplot, so a notebook
cell that ends with the call shows it exactly once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from torch.utils.data import DistributedSampler

from ddp_lab.figures.style import COLORS, GREY
from ddp_lab.figures.style import arrow as _arrow
from ddp_lab.figures.style import box as _box
from ddp_lab.figures.style import done as _done

LIGHT = "#E5E5E5"


def ddp_step(world_size: int = 2) -> Figure:
    """One DDP training step: N processes, each a replica on its shard, one all-reduce.

    Args:
        world_size: number of processes (rows).

    Returns:
        The figure: per process, its shard of the global batch, forward and backward on its
        replica, the gradient all-reduce (average) shared by all, and the identical step.

    Example:
        >>> len(ddp_step(2).axes)
        1
    """
    n = world_size
    fig, ax = plt.subplots(figsize=(10, 1.0 + 1.0 * n))
    ax.set_xlim(0, 10.2)
    ax.set_ylim(-0.5, n + 0.35)
    ax.axis("off")
    phases = [
        (0.0, 1.6, "shard {r} of\nthe global batch"),
        (1.9, 1.9, "forward + backward\non replica {r}\n-> local gradient $g_{r}$"),
        (6.3, 1.6, "optimizer step\n(same on every rank)"),
        (8.2, 1.9, "replica {r}: identical\nweights, no copy sent"),
    ]
    for r in range(n):
        y = n - 1 - r
        color = COLORS[r % len(COLORS)]
        ax.text(-0.05, y + 0.35, f"rank {r}", ha="right", va="center", fontsize=9, weight="bold")
        for x, w, text in phases:
            _box(ax, x, y, w, 0.7, text.format(r=r), color, fontsize=8)
        _arrow(ax, (1.6, y + 0.35), (1.9, y + 0.35))
        _arrow(ax, (3.8, y + 0.35), (4.25, y + 0.35))
        _arrow(ax, (5.95, y + 0.35), (6.3, y + 0.35))
        _arrow(ax, (7.9, y + 0.35), (8.2, y + 0.35))
    terms = " + ".join(f"$g_{r}$" for r in range(n))
    reduce = f"all-reduce\n(during backward)\n\ng = ({terms}) / {n}"
    _box(ax, 4.25, -0.05, 1.7, n - 0.2, reduce, GREY, alpha=0.2, fontsize=8)
    ax.set_title(
        f"DDP with {n} processes: each computes on its own shard, they only exchange gradients",
        fontsize=10,
    )
    return _done(fig)


def sampler_shards(
    n: int = 22, world_size: int = 3, epochs: int = 2, seed: int = 0, set_epoch: bool = True
) -> Figure:
    """Which rank reads which sample, epoch by epoch, under ``DistributedSampler``.

    Args:
        n: data set size.
        world_size: number of ranks.
        epochs: rows to draw.
        seed: the sampler's seed.
        set_epoch: whether ``sampler.set_epoch(epoch)`` is called (False: every epoch uses
            the permutation of epoch 0).

    Returns:
        The figure: one row per epoch, one cell per sample index coloured by the rank that
        reads it (grey: dropped by ``drop_last=True``); the number in a cell is the step (the
        position in that rank's shard).

    Example:
        >>> len(sampler_shards(8, 2, epochs=1).axes)
        1
    """
    fig, ax = plt.subplots(figsize=(min(11, 0.42 * n + 1.6), 0.75 * epochs + 1.0))
    samplers = [
        DistributedSampler(
            range(n), num_replicas=world_size, rank=r, shuffle=True, seed=seed, drop_last=True
        )
        for r in range(world_size)
    ]
    for e in range(epochs):
        step_of = {}  # sample index -> (rank, step)
        for r, sampler in enumerate(samplers):
            sampler.set_epoch(e if set_epoch else 0)
            step_of.update({i: (r, k) for k, i in enumerate(sampler)})
        y = epochs - 1 - e
        for i in range(n):
            color, label = LIGHT, ""
            if i in step_of:
                r, k = step_of[i]
                color, label = COLORS[r], str(k)
            ax.add_patch(Rectangle((i, y + 0.1), 0.92, 0.8, facecolor=color, alpha=0.85))
            ax.text(i + 0.46, y + 0.5, label, ha="center", va="center", fontsize=7, color="white")
        ax.text(-0.3, y + 0.5, f"epoch {e}", ha="right", va="center", fontsize=9)
    for r in range(world_size):
        ax.add_patch(Rectangle((0, 0), 0, 0, facecolor=COLORS[r], label=f"rank {r}"))
    ax.add_patch(Rectangle((0, 0), 0, 0, facecolor=LIGHT, label="dropped"))
    ax.set_xlim(-2.2, n + 0.2)
    ax.set_ylim(-0.1, epochs + 0.1)
    ax.set_xticks([i + 0.46 for i in range(n)], [str(i) for i in range(n)], fontsize=7)
    ax.set_yticks([])
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.set_xlabel("sample index (in a cell: its position in its rank's shard)")
    what = "with set_epoch(epoch)" if set_epoch else "WITHOUT set_epoch: every epoch is epoch 0"
    ax.set_title(f"DistributedSampler, {n} samples on {world_size} ranks, {what}", fontsize=10)
    ax.legend(
        fontsize=8,
        ncol=world_size + 1,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.32),
        frameon=False,
    )
    return _done(fig)


def equivalence(diffs: Mapping[str, Mapping[str, float]], floor: float = 1e-10) -> Figure:
    """Largest weight difference per parameter tensor, for a few comparisons (log scale).

    Args:
        diffs: ``label -> {parameter name -> max abs difference}``.
        floor: where zero differences are drawn.

    Returns:
        The figure: one group of bars per parameter tensor, one bar per comparison.

    Example:
        >>> len(equivalence({"a": {"w": 1e-7, "b": 0.0}}).axes)
        1
    """
    labels = list(diffs)
    names = list(next(iter(diffs.values())))
    fig, ax = plt.subplots(figsize=(8, 3.2))
    width = 0.8 / len(labels)
    for k, label in enumerate(labels):
        xs = [i - 0.4 + (k + 0.5) * width for i in range(len(names))]
        ax.bar(
            xs,
            [max(diffs[label][p], floor) for p in names],
            width=width,
            color=COLORS[k % len(COLORS)],
            label=label,
        )
    ax.axhline(1.2e-7, color=GREY, ls="--", lw=1)
    ax.text(
        -0.45,
        1.4e-7,
        "float32 epsilon",
        ha="left",
        va="bottom",
        fontsize=8,
        color=GREY,
        bbox={"facecolor": "white", "edgecolor": "none", "pad": 1},
    )
    ax.set_yscale("log")
    ax.set_xticks(range(len(names)), names, fontsize=8, rotation=15)
    ax.set_ylabel("max |w - w_reference|")
    ax.set_title("Weights after training: the DDP run against single-process runs", fontsize=10)
    ax.legend(
        fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=len(labels), frameon=False
    )
    return _done(fig)


def eval_shards(n: int = 11, world_size: int = 3) -> Figure:
    """Evaluation shards: ``DistributedSampler`` pads with repeats; an exact split does not.

    Args:
        n: test set size (not a multiple of ``world_size`` to see the difference).
        world_size: number of ranks.

    Returns:
        The figure, two panels: each rank's shard under ``DistributedSampler(shuffle=False)``
        (repeated samples in red) and under ``range(rank, n, world_size)``.

    Example:
        >>> len(eval_shards(5, 2).axes)
        2
    """
    per = -(-n // world_size)
    padded = list(range(n)) + list(range(per * world_size - n))
    layouts = {
        "DistributedSampler: padded to equal shards": [
            [(padded[p], p >= n) for p in range(r, per * world_size, world_size)]
            for r in range(world_size)
        ],
        "range(rank, n, world_size): exact": [
            [(i, False) for i in range(r, n, world_size)] for r in range(world_size)
        ],
    }
    fig, axes = plt.subplots(1, 2, figsize=(10, 0.55 * world_size + 1.3))
    for ax, (title, shards) in zip(axes, layouts.items(), strict=True):
        for r, shard in enumerate(shards):
            y = world_size - 1 - r
            for j, (i, repeat) in enumerate(shard):
                color = COLORS[3] if repeat else COLORS[r % len(COLORS)]
                ax.add_patch(Rectangle((j, y + 0.1), 0.9, 0.8, facecolor=color, alpha=0.85))
                ax.text(
                    j + 0.45, y + 0.5, str(i), ha="center", va="center", fontsize=8, color="white"
                )
            ax.text(-0.2, y + 0.5, f"rank {r}", ha="right", va="center", fontsize=9)
        ax.set_xlim(-1.3, per + 0.2)
        ax.set_ylim(0, world_size)
        ax.axis("off")
        counted = sum(len(s) for s in shards)
        ax.set_title(f"{title}\n{counted} samples scored for {n}", fontsize=9)
    fig.suptitle(f"Evaluating {n} samples on {world_size} ranks (red: scored twice)", fontsize=10)
    return _done(fig)


def my_ddp_timeline(layers: int = 4) -> Figure:
    """What your ``MyDDP`` does: a broadcast at the start, a blocking all-reduce per gradient.

    Args:
        layers: layers of the model (backward meets them last-first).

    Returns:
        The figure: a time line of one training step on one rank, the construction-time
        broadcast before it.

    Example:
        >>> len(my_ddp_timeline(3).axes)
        1
    """
    fig, ax = plt.subplots(figsize=(10, 2.4))
    ax.axis("off")
    ax.set_xlim(-0.2, 2.9 + 2.2 * layers + 1.4)
    ax.set_ylim(0.1, 2.15)
    wrap = "MyDDP(model):\nbroadcast rank 0's\nweights + buffers"
    _box(ax, 0, 1.1, 1.5, 0.7, wrap, COLORS[4], fontsize=8)
    ax.text(0.75, 0.7, "once", ha="center", fontsize=8, color=GREY)
    _box(ax, 1.8, 1.1, 1.0, 0.7, "forward", COLORS[0], fontsize=8)
    x = 2.9
    for k in range(layers, 0, -1):
        _box(ax, x, 1.1, 1.0, 0.7, f"backward\nlayer {k}", COLORS[0], fontsize=8)
        _arrow(ax, (x + 1.0, 1.1), (x + 1.05, 0.65))
        _box(ax, x + 1.0, 0.2, 1.1, 0.5, f"all-reduce\ngrads of {k}", COLORS[1], fontsize=7)
        ax.annotate(
            "",
            (x + 2.2, 1.45),
            (x + 1.0, 1.45),
            arrowprops={"arrowstyle": "-", "ls": ":", "color": GREY},
        )
        x += 2.2
    _box(ax, x, 1.1, 1.2, 0.7, "optimizer\nstep", COLORS[2], fontsize=8)
    ax.text(
        0,
        2.0,
        "one rank, one step  (a hook runs as soon as a parameter's .grad is "
        "complete; backward waits while it all-reduces)",
        fontsize=9,
    )
    return _done(fig)


def bucket_timeline(timelines: Mapping[str, Mapping]) -> Figure:
    """Measured: when gradients became ready and when DDP handed each bucket to the network.

    Args:
        timelines: ``label -> {"end": seconds backward took, "ready": [seconds when each
            parameter's gradient was ready], "buckets": [(seconds, megabytes), ...]}``, times
            measured from the start of ``loss.backward()``.

    Returns:
        The figure: one row per label (e.g. a ``bucket_cap_mb``), the backward pass as a
        grey bar scaled to its own duration (written at its end), ticks where gradients
        became ready and a marker per bucket all-reduce (area ~ bucket size).

    Example:
        >>> fig = bucket_timeline({"1 MB": {"end": 1.0, "ready": [0.2, 0.9],
        ...                                  "buckets": [(0.5, 0.3), (1.0, 0.7)]}})
        >>> len(fig.axes)
        1
    """
    labels = list(timelines)
    fig, ax = plt.subplots(figsize=(9, 0.85 * len(labels) + 1.3))
    for i, label in enumerate(labels):
        t = timelines[label]
        y = len(labels) - 1 - i
        end = t["end"]
        ax.add_patch(Rectangle((0, y - 0.18), 100, 0.36, facecolor=LIGHT, edgecolor=GREY))
        ax.vlines(
            [100 * s / end for s in t["ready"]],
            y - 0.18,
            y + 0.18,
            color=COLORS[0],
            lw=0.8,
            label="a gradient is ready" if i == 0 else None,
        )
        for k, (when, mb) in enumerate(t["buckets"]):
            ax.scatter(
                [100 * when / end],
                [y + 0.3],
                s=40 + 400 * mb,
                color=COLORS[1],
                alpha=0.8,
                edgecolor="black",
                lw=0.5,
                zorder=3,
                label="a bucket's all-reduce starts" if i == 0 and k == 0 else None,
            )
        said = f" {len(t['buckets'])} bucket(s), backward {1e3 * end:.1f} ms"
        ax.text(101, y, said, va="center", fontsize=8)
    ax.set_yticks(range(len(labels)), list(reversed(labels)))
    ax.set_ylim(-0.6, len(labels) - 0.2)
    ax.set_xlim(0, 135)
    ax.set_xticks(range(0, 101, 20))
    ax.set_xlabel("% of loss.backward() elapsed (grey: the backward pass)")
    ax.set_title("DDP buckets: all-reduces start during backward, not after it", fontsize=10)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=2, frameon=False)
    return _done(fig)


def overlap(layers: int = 4, comm: float = 0.6) -> Figure:
    """Why overlap pays: one step without and with communication hidden behind backward.

    Args:
        layers: buckets (one per layer here), all-reduced in backward order.
        comm: all-reduce time of one bucket, relative to one layer's backward.

    Returns:
        The figure: two time lines (compute row, network row) and the step time each needs.

    Example:
        >>> len(overlap(3).axes)
        1
    """
    fig, ax = plt.subplots(figsize=(10, 2.6))
    ax.axis("off")
    rows = {"after backward (no overlap)": 1.6, "during backward (DDP buckets)": 0.0}
    ends = {}
    for title, y in rows.items():
        ax.text(-0.1, y + 0.95, title, fontsize=9, weight="bold")
        _box(ax, 0, y + 0.4, 1.0, 0.4, "forward", COLORS[0], fontsize=7)
        t = 1.0
        net = 0.0
        for k in range(layers, 0, -1):
            _box(ax, t, y + 0.4, 1.0, 0.4, f"bwd {k}", COLORS[0], fontsize=7)
            t += 1.0
            if title.startswith("during"):
                start = max(t, net)
                _box(ax, start, y, comm, 0.35, f"AR {k}", COLORS[1], fontsize=7)
                net = start + comm
        if title.startswith("after"):
            net = t
            for k in range(layers, 0, -1):
                _box(ax, net, y, comm, 0.35, f"AR {k}", COLORS[1], fontsize=7)
                net += comm
        end = max(t, net)
        _box(ax, end, y + 0.4, 0.8, 0.4, "step", COLORS[2], fontsize=7)
        ends[title] = end + 0.8
        ax.text(end + 0.95, y + 0.45, f"step time {end + 0.8:.1f}", fontsize=8, va="center")
    ax.text(
        -0.1,
        -0.35,
        "top row of each: computation; bottom row: the network (AR: all-reduce of one bucket)",
        fontsize=8,
        color=GREY,
    )
    ax.set_xlim(-0.2, max(ends.values()) + 2.2)
    ax.set_ylim(-0.5, 2.7)
    return _done(fig)


def uneven_steps(steps: Sequence[int] = (6, 5)) -> Figure:
    """Uneven inputs: the extra step of one rank waits for partners that have finished.

    Args:
        steps: batches per rank.

    Returns:
        The figure: a row of steps per rank; every step ends in an all-reduce that needs all
        ranks; the extra ones have no partner.

    Example:
        >>> len(uneven_steps((2, 1)).axes)
        1
    """
    top = max(steps)
    fig, ax = plt.subplots(figsize=(9, 0.7 * len(steps) + 1.1))
    ax.axis("off")
    for r, k in enumerate(steps):
        y = len(steps) - 1 - r
        ax.text(-0.2, y + 0.3, f"rank {r}: {k} batches", ha="right", va="center", fontsize=9)
        for s in range(top):
            if s < k:
                lonely = s >= min(steps)
                text = f"step {s}\n" + ("waits forever" if lonely else "all-reduce")
                color = COLORS[3] if lonely else COLORS[r % len(COLORS)]
                _box(
                    ax,
                    s * 1.2,
                    y,
                    1.0,
                    0.6,
                    text,
                    color,
                    alpha=0.45 if lonely else 0.25,
                    fontsize=7,
                )
            else:
                done = "done: next epoch,\nor exit"
                ax.text(
                    s * 1.2 + 0.5, y + 0.3, done, ha="center", va="center", fontsize=7, color=GREY
                )
    ax.set_xlim(-2.6, top * 1.2 + 0.2)
    ax.set_ylim(-0.2, len(steps))
    ax.set_title(
        "Uneven inputs: a collective that not every rank calls never completes", fontsize=10
    )
    return _done(fig)


def scaling(processes: Sequence[int], samples_per_s: Sequence[float], title: str) -> Figure:
    """Throughput and efficiency against the number of processes (``ddp_lab.figures.scaling``).

    Example:
        >>> len(scaling([1, 2], [100.0, 150.0], "test").axes)
        2
    """
    from ddp_lab.figures.scaling import plot_scaling

    fig = plot_scaling(processes, samples_per_s, title=title)
    plt.close(fig)
    return fig


def lr_schedules(
    scaled_lr: Callable,
    warmup_lr: Callable,
    base_lr: float,
    base_batch: int,
    batch_size: int,
    worlds: Sequence[int],
    warmup_steps: int,
    total_steps: int,
) -> Figure:
    """Your learning rate over the first steps for several world sizes: scaled, with warm-up.

    Args:
        scaled_lr: your ``scaled_lr(base_lr, base_batch, batch_size, world_size)``.
        warmup_lr: your ``warmup_lr(step, base_lr, peak_lr, warmup_steps)``.
        base_lr: the rate tuned for ``base_batch`` samples a step.
        base_batch: that global batch.
        batch_size: samples per process.
        worlds: process counts to draw.
        warmup_steps: length of the ramp from ``base_lr`` to the scaled rate.
        total_steps: steps drawn.

    Raises:
        NotImplementedError: your functions are still the stubs.

    Example:
        >>> flat = lambda base_lr, *args: base_lr
        >>> len(lr_schedules(flat, lambda s, b, p, w: p, 0.1, 32, 32, [1, 2], 10, 20).axes)
        1
    """
    steps = range(total_steps + 1)
    peaks = [scaled_lr(base_lr, base_batch, batch_size, w) for w in worlds]
    curves = [[warmup_lr(s, base_lr, peak, warmup_steps) for s in steps] for peak in peaks]
    fig, ax = plt.subplots(figsize=(9, 3.0))
    for k, (w, peak, curve) in enumerate(zip(worlds, peaks, curves, strict=True)):
        label = f"{w} process(es): global batch {w * batch_size}, lr {peak:g}"
        ax.plot(steps, curve, color=COLORS[k % len(COLORS)], label=label)
    ax.axvline(warmup_steps, color=GREY, ls="--", lw=1)
    ax.text(
        warmup_steps,
        0.6,
        " end of warm-up",
        transform=ax.get_xaxis_transform(),
        fontsize=8,
        color=GREY,
    )
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("learning rate")
    ax.set_title("Your scaled_lr and warmup_lr: linear scaling with gradual warm-up", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    return _done(fig)
