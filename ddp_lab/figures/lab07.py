"""Figures of lab 7 (beyond data parallelism), one function per concept.

Every function returns a matplotlib Figure that is already closed for pyplot, so a notebook
cell that ends with the call shows it exactly once. A figure that shows an exercise's
answer takes the student's function (or the student's measured results) as an argument.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from ddp_lab.figures.style import COLORS, GREY
from ddp_lab.figures.style import arrow as _arrow
from ddp_lab.figures.style import box as _box
from ddp_lab.figures.style import done as _done
from ddp_lab.parallel.hybrid import coords
from ddp_lab.parallel.timeline import busy_and_span, gpipe_bubble, held, peak_held

PARTS = ("params", "grads", "optimizer")
_PART_COLORS = dict(zip(PARTS, (COLORS[0], COLORS[1], COLORS[2]), strict=True))
_STAGE_NAMES = ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")


def zero_sharding(world: int = 4) -> Figure:
    """What each of ``world`` ranks holds under DDP and ZeRO stages 1, 2, 3.

    Example:
        >>> len(zero_sharding(3).axes)
        1
    """
    fig, ax = plt.subplots(figsize=(10, 3.8))
    place = {"optimizer": (0.0, 2.0), "grads": (2.1, 1.0), "params": (3.2, 1.0)}  # y, height
    for s, name in enumerate(_STAGE_NAMES):
        x0 = s * (world + 1.2)
        ax.text(x0 + world / 2, 4.4, name, ha="center", fontsize=10, weight="bold")
        for r in range(world):
            x = x0 + r
            for part, (y, height) in place.items():
                color = _PART_COLORS[part]
                if s >= {"optimizer": 1, "grads": 2, "params": 3}[part]:
                    piece = height / world
                    ax.add_patch(
                        plt.Rectangle(
                            (x + 0.05, y), 0.9, height * 0.97, fill=False, ec=GREY, lw=0.6, ls=":"
                        )
                    )
                    ax.add_patch(
                        plt.Rectangle((x + 0.05, y + r * piece), 0.9, piece * 0.97, color=color)
                    )
                else:
                    ax.add_patch(
                        plt.Rectangle((x + 0.05, y), 0.9, height * 0.97, color=color, alpha=0.6)
                    )
            ax.text(x + 0.5, -0.3, f"rank {r}", ha="center", fontsize=7)
    for part in PARTS:
        ax.bar(
            0,
            0,
            color=_PART_COLORS[part],
            label={"params": "parameters", "grads": "gradients", "optimizer": "AdamW state (2x)"}[
                part
            ],
        )
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=3, fontsize=8, frameon=False)
    ax.set_xlim(-0.3, 4 * (world + 1.2))
    ax.set_ylim(-0.5, 4.7)
    ax.axis("off")
    return _done(fig)


def memory_over_worlds(
    memory_fn: Callable,
    numels: Sequence[int],
    bytes_per_number: int,
    worlds: Sequence[int] = (1, 2, 4, 8, 16, 32, 64),
) -> Figure:
    """The most loaded rank's bytes for DDP and ZeRO 1-3 over world sizes, from
    ``memory_fn`` (your ``memory_per_rank``), on a log-log scale."""
    fig, ax = plt.subplots(figsize=(7.5, 4))
    for stage, name in enumerate(_STAGE_NAMES):
        totals = [
            max(sum(r.values()) for r in memory_fn(list(numels), bytes_per_number, w, stage)) / 1e9
            for w in worlds
        ]
        ax.plot(worlds, totals, "o-", color=COLORS[stage], label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("ranks (data-parallel world size)")
    ax.set_ylabel("GB per rank (params + grads + AdamW)")
    ax.set_title(f"{sum(numels) / 1e9:.1f} B parameters, {bytes_per_number} bytes each")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    return _done(fig)


def zero_step(world: int = 3, numbers: int = 8) -> Figure:
    """One step of a sharded AdamW: reduce-scatter, update the own chunk, all-gather; the
    flat vector padded to ``world * ceil(numbers / world)`` so that every chunk has one size."""
    chunk = math.ceil(numbers / world)
    fig, ax = plt.subplots(figsize=(10, 0.9 + 0.75 * world))
    cols = [
        ("every rank's own\ngradient (padded)", "all"),
        ("reduce-scatter:\naverage of own chunk", "own"),
        ("AdamW on own chunk\n(own moments)", "step"),
        ("all-gather:\nall new parameters", "all"),
    ]
    for c, (title, what) in enumerate(cols):
        x0 = c * (chunk * world * 0.32 + 0.9)
        ax.text(x0 + chunk * world * 0.16, world + 0.2, title, ha="center", fontsize=8)
        for r in range(world):
            y = world - 1 - r
            for i in range(chunk * world):
                owner = i // chunk
                pad = i >= numbers
                shown = what == "all" or owner == r
                color = GREY if pad else COLORS[owner % len(COLORS)]
                alpha = 0.15 if not shown else (0.35 if pad else (0.9 if what == "step" else 0.6))
                ax.add_patch(plt.Rectangle((x0 + i * 0.32, y), 0.3, 0.7, color=color, alpha=alpha))
            if c == 0:
                ax.text(x0 - 0.15, y + 0.35, f"rank {r}", ha="right", va="center", fontsize=8)
        if c < len(cols) - 1:
            _arrow(
                ax,
                (x0 + chunk * world * 0.32 + 0.05, world / 2),
                (x0 + chunk * world * 0.32 + 0.8, world / 2),
            )
    ax.set_xlim(-1.0, len(cols) * (chunk * world * 0.32 + 0.9))
    ax.set_ylim(-0.2, world + 0.8)
    ax.axis("off")
    return _done(fig)


def measured_memory(result: Mapping, memory_fn: Callable | None = None) -> Figure:
    """Per-rank bytes the compare runs measured (stacked), and what ``memory_fn`` predicts
    (DDP: stage 0, ZeRO: stage 1, FSDP: stage 3; black ticks)."""
    runs = result["runs"]
    fig, ax = plt.subplots(figsize=(9, 3.8))
    stage_of = {"ddp": 0, "zero1 (torch)": 1, "zero (yours)": 1, "fsdp": 3}
    x, ticks, labels = 0.0, [], []
    for kind, run in runs.items():
        predicted = None
        if memory_fn is not None:
            predicted = memory_fn(list(result["numels"]), 4, result["world_size"], stage_of[kind])
        for r, row in enumerate(run["ranks"]):
            bottom = 0.0
            for part in PARTS:
                ax.bar(
                    x,
                    row[part] / 1e6,
                    bottom=bottom,
                    color=_PART_COLORS[part],
                    width=0.8,
                    label=part if x == 0 else None,
                )
                bottom += row[part] / 1e6
            if predicted:
                ax.plot(
                    [x - 0.4, x + 0.4],
                    [sum(predicted[r].values()) / 1e6] * 2,
                    "k-",
                    lw=2,
                    label="your memory_per_rank" if x == 0 else None,
                )
            ticks.append(x)
            labels.append(f"{kind}\nrank {r}" if r == 0 else f"rank {r}")
            x += 1
        x += 0.8
    ax.set_xticks(ticks, labels, fontsize=7)
    ax.set_ylabel("MB held after a step")
    ax.legend(fontsize=8, ncol=4)
    return _done(fig)


def pipeline_schedule(events: Sequence[Sequence[tuple]], title: str = "") -> Figure:
    """A measured schedule: per stage (rank) its forward (F) and backward (B) passes."""
    busy, t0, span = busy_and_span(events)
    fig, ax = plt.subplots(figsize=(9, 0.6 + 0.45 * len(events)))
    for stage, rank_events in enumerate(events):
        y = len(events) - 1 - stage
        counts = {"F": 0, "B": 0}
        for kind, start, end in rank_events:
            color = COLORS[0] if kind == "F" else COLORS[1]
            ax.barh(y, end - start, left=start - t0, color=color, edgecolor="white", height=0.8)
            ax.text(
                start - t0 + (end - start) / 2,
                y,
                f"{kind}{counts[kind]}",
                ha="center",
                va="center",
                fontsize=6,
                color="white",
            )
            counts[kind] += 1
    ax.set_yticks(range(len(events)), [f"stage {s}" for s in reversed(range(len(events)))])
    ax.set_xlabel("seconds")
    bubble = 1 - sum(busy) / (len(events) * span)
    ax.set_title(f"{title} measured bubble {bubble:.0%}".strip(), fontsize=9)
    ax.set_xlim(0, span)
    return _done(fig)


def bubble_curve(measured: Mapping[int, float], stages: int) -> Figure:
    """The measured bubble against GPipe's ``(p - 1) / (m + p - 1)`` over micro-batches."""
    ms = sorted(measured)
    fig, ax = plt.subplots(figsize=(6, 3.4))
    fine = range(1, max(ms) + 1)
    ax.plot(
        fine,
        [gpipe_bubble(stages, m) for m in fine],
        "-",
        color=GREY,
        label=f"(p-1)/(m+p-1), p = {stages}",
    )
    ax.plot(ms, [measured[m] for m in ms], "o", color=COLORS[3], label="measured")
    ax.set_xlabel("micro-batches m")
    ax.set_ylabel("bubble (share of idle stage time)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    return _done(fig)


def held_activations(runs: Mapping[str, Sequence[Sequence[tuple]]]) -> Figure:
    """Per schedule (``name -> events per stage``, measured), how many micro-batches'
    activations each stage holds over time (:func:`ddp_lab.parallel.timeline.held`).

    Example:
        >>> run = [[("F", 0, 1), ("B", 2, 3)], [("F", 1, 2), ("B", 2, 2.5)]]
        >>> len(held_activations({"a": run, "b": run}).axes)
        2
    """
    fig, axes = plt.subplots(1, len(runs), figsize=(4.6 * len(runs), 3.2), sharey=True)
    axes = [axes] if len(runs) == 1 else list(axes)
    for ax, (name, events) in zip(axes, runs.items(), strict=True):
        _, t0, span = busy_and_span(events)
        for stage, rank_events in enumerate(events):
            points = [(t0, 0), *held(rank_events)]
            ax.step(
                [t - t0 for t, _ in points],
                [n for _, n in points],
                where="post",
                color=COLORS[stage % len(COLORS)],
                label=f"stage {stage}",
            )
        peaks = ", ".join(str(peak_held(e)) for e in events)
        ax.set_title(f"{name}: peak per stage {peaks}", fontsize=9)
        ax.set_xlabel("seconds")
        ax.set_xlim(0, span)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("micro-batches' activations held")
    axes[0].legend(fontsize=7)
    return _done(fig)


def tensor_parallel(world: int = 2) -> Figure:
    """Column- and row-parallel linear layers in the MLP block: what each rank holds, and the
    two places (f and g) where the ranks may have to communicate."""
    fig, ax = plt.subplots(figsize=(10, 2.6 + 0.5 * world))
    h = 0.9
    for r in range(world):
        y = (world - 1 - r) * 1.1
        c = COLORS[r % len(COLORS)]
        _box(ax, 0.0, y, 1.2, h, "X (full)", GREY, alpha=0.3, fontsize=8)
        _box(ax, 1.8, y, 1.6, h, f"fc1 rows, part {r}\n(column-parallel)", c, fontsize=8)
        _box(ax, 4.0, y, 1.3, h, f"hidden part {r}\nGELU(...)", c, alpha=0.15, fontsize=8)
        _box(ax, 5.9, y, 1.6, h, f"fc2 columns, part {r}\n(row-parallel)", c, fontsize=8)
        _box(ax, 8.1, y, 1.3, h, f"partial Y_{r}", c, alpha=0.15, fontsize=8)
        for a, b in ((1.2, 1.8), (3.4, 4.0), (5.3, 5.9), (7.5, 8.1)):
            _arrow(ax, (a, y + h / 2), (b, y + h / 2))
    top = world * 1.1 - 0.1
    _box(
        ax,
        8.0,
        top + 0.1,
        2.4,
        0.6,
        "g: Y from the partial Y_r ?",
        COLORS[3],
        alpha=0.4,
        fontsize=8,
    )
    _box(ax, -0.3, top + 0.1, 2.6, 0.6, "f: X in, dX back ?", COLORS[3], alpha=0.4, fontsize=8)
    ax.text(
        4.6,
        -0.55,
        "no communication between the two layers: each rank's hidden slice "
        "feeds its own columns of fc2",
        ha="center",
        fontsize=8,
    )
    ax.set_xlim(-0.5, 10.6)
    ax.set_ylim(-0.8, top + 0.9)
    ax.axis("off")
    return _done(fig)


def hybrid_layout(dp: int, tp: int, pp: int, gpus_per_node: int = 8) -> Figure:
    """GPUs of a ``dp x tp x pp`` job by node: colour = pipeline stage, label = coordinates;
    tensor groups sit inside a node, replicas next, pipeline stages outermost (across nodes)."""
    world = dp * tp * pp
    nodes = math.ceil(world / gpus_per_node)
    fig, ax = plt.subplots(figsize=(min(12, 1.2 * gpus_per_node + 1), 0.6 + 0.8 * nodes))
    for rank in range(world):
        d, p, t = coords(rank, dp, tp)
        node, slot = divmod(rank, gpus_per_node)
        y = nodes - 1 - node
        _box(
            ax,
            slot * 1.2,
            y,
            1.05,
            0.65,
            f"GPU {rank}\nd{d} p{p} t{t}",
            COLORS[p % len(COLORS)],
            alpha=0.25 + 0.5 * (d % 2),
            fontsize=7,
        )
    for node in range(nodes):
        ax.text(-0.2, nodes - 1 - node + 0.32, f"node {node}", ha="right", va="center", fontsize=8)
    ax.set_title(
        f"data {dp} x tensor {tp} x pipeline {pp} = {world} GPUs "
        "(d = replica, p = stage, t = tensor slice)",
        fontsize=9,
    )
    ax.set_xlim(-1.3, gpus_per_node * 1.2)
    ax.set_ylim(-0.2, nodes)
    ax.axis("off")
    return _done(fig)


def hybrid_plans(plans: Mapping[str, Mapping]) -> Figure:
    """Per layout: memory per GPU and bytes sent per step (data, tensor, pipeline), and the
    bubble."""
    names = list(plans)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.6))
    for i, name in enumerate(names):
        mem = plans[name]["memory"]
        bottom = 0.0
        for part in PARTS:
            left.bar(
                i,
                mem[part] / 1e9,
                bottom=bottom,
                color=_PART_COLORS[part],
                label=part if i == 0 else None,
            )
            bottom += mem[part] / 1e9
        bottom = 0.0
        for j, kind in enumerate(("data", "tensor", "pipeline")):
            value = plans[name]["comm"][kind] / 1e9
            right.bar(i, value, bottom=bottom, color=COLORS[3 + j], label=kind if i == 0 else None)
            bottom += value
        right.text(
            i, bottom, f"bubble {plans[name]['bubble']:.0%}", ha="center", va="bottom", fontsize=7
        )
    for ax, label in ((left, "GB per GPU"), (right, "GB sent per GPU and step")):
        ax.set_xticks(range(len(names)), names, fontsize=7, rotation=15)
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    return _done(fig)


def activation_growth(
    width: int = 768, heads: int = 12, batch: int = 8, seqs: Sequence[int] = ()
) -> Figure:
    """Bytes one transformer block (``ddp_lab.gpt.Block``, float32) keeps for its backward,
    measured on the meta device over sequence lengths, against the block's model states
    under AdamW (16 bytes a parameter) and against what a checkpointed block keeps (its
    input, measured through ``torch.utils.checkpoint`` the same way).

    Example:
        >>> len(activation_growth(width=16, heads=2, batch=2, seqs=(4, 8)).axes)
        1
    """
    import torch
    from torch.utils.checkpoint import checkpoint

    from ddp_lab.gpt import Block, GPTConfig
    from ddp_lab.parallel.memory import saved_bytes

    seqs = list(seqs) or [2**k for k in range(6, 14)]
    kept, ckpt = [], []
    with torch.device("meta"):
        for t in seqs:
            block = Block(GPTConfig(seq_len=t, width=width, heads=heads, layers=1))
            x = torch.empty(batch, t, width, requires_grad=True)
            kept.append(saved_bytes(block, x))
            ckpt.append(
                saved_bytes(
                    lambda x, block=block: checkpoint(block, x, use_reentrant=False),
                    x,
                    exclude=block.parameters(),
                )
            )
    states = 16 * sum(p.numel() for p in block.parameters())
    fig, ax = plt.subplots(figsize=(7.5, 4.0))
    ax.loglog(seqs, kept, "o-", color=COLORS[0], label="activations kept by the block")
    ax.loglog(seqs, ckpt, "s--", color=COLORS[2], label="checkpointed block (its input only)")
    ax.axhline(states, color=GREY, lw=1.2, label="the block's params + grads + AdamW (16 B each)")
    ax.set_xlabel("sequence length T (tokens)")
    ax.set_ylabel("bytes per block")
    ax.set_title(f"One block, width {width}, {heads} heads, batch {batch}, float32 (measured)")
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(True, which="major", alpha=0.3)
    return _done(fig)
