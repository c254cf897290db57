"""Figures of lab 3 (DistributedDataParallel), one function per concept.

Every function returns a matplotlib Figure that is already closed for pyplot, so a notebook
cell that ends with the call shows it exactly once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import matplotlib.pyplot as plt
import torch
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from torch.utils.data import DistributedSampler

from ddp_lab.figures.lab03_timing import (  # noqa: F401 - the lab's figures, in one place
    bucket_timeline,
    my_ddp_timeline,
    overlap,
    overlap_measured,
)
from ddp_lab.figures.style import COLORS, GREY
from ddp_lab.figures.style import arrow as _arrow
from ddp_lab.figures.style import box as _box
from ddp_lab.figures.style import done as _done
from ddp_lab.optim import warmup_schedule

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
    n: int = 22,
    world_size: int = 3,
    epochs: int = 2,
    seed: int = 0,
    set_epoch: bool = True,
    drop_last: bool = True,
) -> Figure:
    """The order of each epoch under ``DistributedSampler``, and which rank reads what.

    Args:
        n: data set size.
        world_size: number of ranks.
        epochs: rows to draw.
        seed: the sampler's seed.
        set_epoch: whether ``sampler.set_epoch(epoch)`` is called (False: every epoch uses
            the order of epoch 0).
        drop_last: the sampler's ``drop_last`` (False: the order is padded with repeats).

    Returns:
        The figure: one row per epoch, the epoch's order from left to right, each position
        coloured by the rank that reads it (the number in a cell is the sample index); padded
        positions hatched, dropped samples grey at the end.

    Example:
        >>> len(sampler_shards(8, 3, epochs=1, drop_last=False).axes)
        1
    """
    samplers = [
        DistributedSampler(
            range(n), num_replicas=world_size, rank=r, shuffle=True, seed=seed, drop_last=drop_last
        )
        for r in range(world_size)
    ]
    width = max(n, len(samplers[0]) * world_size)
    fig, ax = plt.subplots(figsize=(min(11, 0.42 * width + 1.6), 0.75 * epochs + 1.1))
    for e in range(epochs):
        shards = []
        for sampler in samplers:
            sampler.set_epoch(e if set_epoch else 0)
            shards.append(list(sampler))
        y = epochs - 1 - e
        cells = [
            (i, r) for k in range(len(shards[0])) for r, s in enumerate(shards) for i in [s[k]]
        ]
        cells += [(i, None) for i in range(n) if all(i not in s for s in shards)]
        for pos, (i, r) in enumerate(cells):
            pad = r is not None and pos >= n
            ax.add_patch(
                Rectangle(
                    (pos, y + 0.1),
                    0.92,
                    0.8,
                    facecolor=LIGHT if r is None else COLORS[r],
                    alpha=0.85,
                    hatch="///" if pad else None,
                    edgecolor="white",
                )
            )
            color = "black" if r is None else "white"
            ax.text(pos + 0.46, y + 0.5, str(i), ha="center", va="center", fontsize=7, color=color)
        ax.text(-0.3, y + 0.5, f"epoch {e}", ha="right", va="center", fontsize=9)
    for r in range(world_size):
        ax.add_patch(Rectangle((0, 0), 0, 0, facecolor=COLORS[r], label=f"rank {r}"))
    if drop_last:
        ax.add_patch(Rectangle((0, 0), 0, 0, facecolor=LIGHT, label="dropped"))
    else:
        ax.add_patch(Rectangle((0, 0), 0, 0, facecolor=GREY, hatch="///", label="padding"))
    ax.set_xlim(-2.2, width + 0.2)
    ax.set_ylim(-0.1, epochs + 0.1)
    ax.set_xticks([])
    ax.set_yticks([])
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.set_xlabel("the epoch's order, first to last (in a cell: the sample index)")
    what = "set_epoch(epoch)" if set_epoch else "WITHOUT set_epoch: every epoch is epoch 0"
    tail = "drop_last=True" if drop_last else "drop_last=False (padding)"
    ax.set_title(
        f"DistributedSampler, {n} samples on {world_size} ranks, {tail}, {what}", fontsize=10
    )
    ax.legend(
        fontsize=8,
        ncol=world_size + 1,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.25),
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
    """Throughput and efficiency against the number of processes
    (``ddp_lab.figures.lab03_scaling``).

    Example:
        >>> len(scaling([1, 2], [100.0, 150.0], "test").axes)
        2
    """
    from ddp_lab.figures.lab03_scaling import plot_scaling

    fig = plot_scaling(processes, samples_per_s, title=title)
    plt.close(fig)
    return fig


def warmup_schedules(
    warmup_steps_for: Callable,
    base_lr: float,
    base_batch: int,
    batch_size: int,
    worlds: Sequence[int],
    total_steps: int,
    logged: Mapping[int, Sequence[tuple[int, float]]] | None = None,
) -> Figure:
    """The trainer's learning rate over the first steps for several world sizes, each
    warmed up for as many steps as your ``warmup_steps_for`` says, and the rates the trainer
    logged.

    Args:
        warmup_steps_for: your ``warmup_steps_for(base_batch, batch_size, world_size,
            accum_steps, warmup_samples)`` (called with no accumulation and no samples).
        base_lr: the rate tuned for ``base_batch`` samples a step.
        base_batch: that global batch.
        batch_size: samples per process.
        worlds: process counts to draw.
        total_steps: steps drawn.
        logged: ``processes -> [(step, lr), ...]`` that the trainer logged (drawn as dots).

    Raises:
        NotImplementedError: your function is still the stub.

    Example:
        >>> two = lambda *args, **kw: 2
        >>> len(warmup_schedules(two, 0.1, 32, 32, [1, 2], 20).axes)
        1
    """
    steps = range(1, total_steps + 1)
    fig, ax = plt.subplots(figsize=(9, 3.0))
    for k, w in enumerate(worlds):
        warmup = warmup_steps_for(base_batch, batch_size, w, accum_steps=1, warmup_samples=0)
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        factor = warmup_schedule(opt, int(warmup)).lr_lambdas[0]
        peak = base_lr * w * batch_size / base_batch  # the linear scaling rule
        curve = [peak * factor(s - 1) for s in steps]
        color = COLORS[k % len(COLORS)]
        label = f"{w} process(es): global batch {w * batch_size}, warm-up {warmup} step(s)"
        ax.plot(steps, curve, color=color, marker=".", ms=4, label=label)
    for k, (w, points) in enumerate(sorted((logged or {}).items())):
        if points:
            xs, ys = zip(*points, strict=True)
            ax.scatter(
                xs,
                ys,
                s=14,
                color="black",
                marker="o" if k == 0 else "x",
                zorder=3,
                label=f"trainer's logged lr, {w} process(es) (--warmup-steps 8)",
            )
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("learning rate")
    ax.set_title(
        f"Linear scaling with your warm-ups: no step rises by more than base_lr = {base_lr:g}",
        fontsize=10,
    )
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    return _done(fig)
