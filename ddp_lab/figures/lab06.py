"""Figures of lab 6 (checkpoints, elastic restarts and faults), one function per concept.

Every function returns a matplotlib Figure that is already closed for pyplot, so a notebook
cell that ends with the call shows it exactly once. A figure that shows an exercise's answer
takes the student's function (or its results) as an argument.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping, Sequence

import matplotlib.pyplot as plt
import torch
from matplotlib.figure import Figure

from ddp_lab.figures.lab06_restart import restart_timeline
from ddp_lab.figures.style import COLORS, GREY
from ddp_lab.figures.style import arrow as _arrow
from ddp_lab.figures.style import box as _box
from ddp_lab.figures.style import done as _done

__all__ = [
    "atomic_write",
    "checkpoint_contents",
    "dcp_reshard",
    "hang_timeline",
    "restart_timeline",
    "resume_divergence",
    "rollback_curve",
]


def _nbytes(value) -> int:
    buf = io.BytesIO()
    torch.save(value, buf)
    return len(buf.getvalue())


def checkpoint_contents(state: Mapping) -> Figure:
    """What a checkpoint holds, part by part, in bytes (each part serialised alone).

    Args:
        state: a checkpoint's dict (model, optimizer, scheduler, RNG states, counters...).

    Returns:
        One horizontal bar per top-level key, its size written next to it.

    Example:
        >>> fig = checkpoint_contents({"model": {"w": torch.zeros(10)}, "step": 3})
        >>> len(fig.axes)
        1
    """
    sizes = {str(k): _nbytes(v) for k, v in state.items()}
    names = list(sizes)[::-1]
    fig, ax = plt.subplots(figsize=(8, 0.5 + 0.42 * len(names)))
    top = max(sizes.values()) / 1e6
    for i, name in enumerate(names):
        mb = sizes[name] / 1e6
        ax.barh(i, mb, color=COLORS[i % len(COLORS)], alpha=0.85)
        label = f" {mb:.2f} MB" if sizes[name] > 1e5 else f" {sizes[name]:,} bytes"
        ax.text(mb, i, label, va="center", fontsize=8)
    ax.set_yticks(range(len(names)), names, fontsize=9)
    ax.set_xlim(0, top * 1.3)
    total = sum(sizes.values())
    ax.set_xlabel(f"MB (each part saved alone; together {total / 1e6:.2f} MB)")
    ax.set_title("What a checkpoint holds: the model is not the only large part", fontsize=10)
    return _done(fig)


_WRITE_PHASES = (
    ("serialise\n(torch.save to memory)", 1.2),
    ("write\nckpt.pt.tmp", 1.6),
    ("flush +\nfsync", 1.0),
    ("rename onto\nckpt.pt", 0.8),
    ("fsync\nfolder", 0.7),
)


def atomic_write(world: int = 3) -> Figure:
    """The atomic checkpoint write by rank 0, the barrier of every rank, and what a crash
    at each moment leaves on disk; below, the same write done in place.

    Example:
        >>> len(atomic_write().axes)
        1
    """
    fig, ax = plt.subplots(figsize=(10, 2.6 + 0.55 * world))
    top = world + 0.2  # rank 0's lane; rank r's is 0.75 * r below
    x, ends = 0.0, []
    for i, (name, width) in enumerate(_WRITE_PHASES):
        _box(ax, x, top, width - 0.08, 0.55, name, COLORS[i], alpha=0.3, fontsize=7.5)
        ends.append(x + width)
        x += width
    barrier = x + 0.15
    for r in range(world):
        y = top - 0.75 * r
        ax.text(-0.1, y + 0.27, f"rank {r}", ha="right", va="center", fontsize=9)
        if r:
            _box(ax, 0, y, 1.5, 0.55, "its own step", GREY, alpha=0.2, fontsize=7.5)
            _box(ax, 1.6, y, barrier - 1.7, 0.55, "waits in dist.barrier()", GREY, 0.08, 7.5)
    ax.axvline(barrier, ymin=0.3, color="black", lw=1.2)
    ax.text(
        barrier + 0.08,
        top + 0.5,
        "barrier: nobody runs\nahead of a checkpoint\nthat may not exist yet",
        fontsize=7.5,
        va="top",
    )
    notes = [
        (ends[0] - 0.6, "old ckpt.pt intact\n(nothing written)"),
        (ends[2] - 0.5, "old ckpt.pt intact,\na stray .tmp"),
        (ends[4] - 0.35, "new ckpt.pt,\non disk"),
    ]
    for cx, text in notes:
        _arrow(ax, (cx, top + 1.05), (cx, top + 0.6), color=COLORS[3])
        ax.text(cx, top + 1.1, "crash here: " + text, ha="center", va="bottom", fontsize=7)
    low = top - 0.75 * (world - 1) - 1.1
    ax.text(-0.1, low + 0.25, "in place", ha="right", va="center", fontsize=9)
    _box(ax, 0, low, 2.6, 0.5, "open ckpt.pt ('wb' empties it)", COLORS[3], 0.25, 7.5)
    _box(ax, 2.7, low, 2.6, 0.5, "write the new bytes", COLORS[3], 0.25, 7.5)
    _arrow(ax, (4.0, low - 0.45), (4.0, low - 0.02), color=COLORS[3])
    ax.text(
        4.0,
        low - 0.5,
        "crash here: neither the old nor the new checkpoint",
        ha="center",
        va="top",
        fontsize=7.5,
        color=COLORS[3],
    )
    ax.set_xlim(-1.0, barrier + 2.0)
    ax.set_ylim(low - 1.0, top + 1.8)
    ax.axis("off")
    ax.set_title(
        "An atomic checkpoint: temporary file, fsync, rename, then every rank meets", fontsize=10
    )
    return _done(fig)


def resume_divergence(curves: Mapping[str, Sequence[float]], resumed_at: int) -> Figure:
    """How far resumed runs drift from the uninterrupted one, step by step.

    Args:
        curves: ``name -> max abs weight difference after each optimizer step``.
        resumed_at: the step the runs resumed from (a vertical line).

    Example:
        >>> len(resume_divergence({"full state": [0.0, 0.0], "no RNG": [0.0, 1e-3]}, 1).axes)
        1
    """
    fig, ax = plt.subplots(figsize=(8, 3.2))
    floor = 1e-12
    for i, (name, diffs) in enumerate(curves.items()):
        steps = range(1, len(diffs) + 1)
        values = [max(float(d), floor) for d in diffs]
        ax.semilogy(steps, values, marker="o", ms=3, color=COLORS[i % len(COLORS)], label=name)
    ax.axvline(resumed_at, color=GREY, ls="--", lw=1)
    ax.text(resumed_at, floor * 3, " resumed here", fontsize=8, color=GREY)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("max |w - w_uninterrupted|\n(1e-12: bit-identical)")
    ax.legend(fontsize=8)
    ax.set_title("A resume is right only if the weights stay equal bit for bit", fontsize=10)
    return _done(fig)


def rollback_curve(history: Sequence[Mapping], drop: float, plan_fn: Callable) -> Figure:
    """The rollback rule on an accuracy curve, as ``plan_fn(history, drop)`` decides it.

    Args:
        history: ``[{"step", "accuracy"}]`` (accuracy in percent).
        drop: the threshold in points.
        plan_fn: the rule (``rollback_plan``), returning one decision per evaluation.

    Returns:
        The evaluations (rollbacks in red), the best checkpoint's accuracy and the line
        ``drop`` points below it, an arrow from each rollback to the checkpoint it
        restores, and the thrown-away steps shaded.
    """
    plan = plan_fn([dict(h) for h in history], drop)
    steps = [h["step"] for h in history]
    acc = [h["accuracy"] for h in history]
    by_step = dict(zip(steps, acc, strict=True))
    fig, ax = plt.subplots(figsize=(9, 3.6))
    ax.plot(steps, acc, color=GREY, lw=1, zorder=1)
    best = [by_step.get(d["best"], float("nan")) for d in plan]
    ax.step(steps, best, where="post", color=COLORS[2], lw=1.5, label="best checkpoint")
    ax.step(
        steps,
        [b - drop for b in best],
        where="post",
        color=COLORS[2],
        ls=":",
        lw=1.2,
        label=f"best - {drop:g} points",
    )
    for s, a, d in zip(steps, acc, plan, strict=True):
        rolled = d["restore"] is not None
        ax.scatter([s], [a], color=COLORS[3] if rolled else COLORS[0], zorder=3, s=25)
        if rolled:
            target = (d["restore"], by_step.get(d["restore"], a))
            _arrow(ax, (s, a), target, color=COLORS[3])
            if d["discarded"]:
                ax.axvspan(s - d["discarded"], s, color=COLORS[3], alpha=0.08)
    ax.scatter([], [], color=COLORS[3], s=25, label="rollback (shaded: updates thrown away)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("validation accuracy (%)")
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(
        f"The rollback rule: restore the best checkpoint after a drop of more than {drop:g} points",
        fontsize=10,
    )
    return _done(fig)


def hang_timeline(sequences: Mapping[int, Sequence[str]], title: str = "") -> Figure:
    """Which rank waits in which collective: each rank's collectives in the order it calls
    them, the ``i``-th of every rank paired (that is how a backend matches them).

    Args:
        sequences: ``rank -> [label of each collective, in order]`` (e.g. ``"e0 s2 grad"``).
        title: what the figure shows.

    Returns:
        One lane per rank; pairs whose labels disagree in red (a silent mismatch, or an
        error under ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` when the shapes differ); the
        collectives of the longer lanes that have no partner marked "waits until the
        timeout".

    Example:
        >>> len(hang_timeline({0: ["a", "b"], 1: ["a"]}).axes)
        1
    """
    ranks = sorted(sequences)
    longest = max((len(s) for s in sequences.values()), default=0)
    shortest = min((len(s) for s in sequences.values()), default=0)
    fig, ax = plt.subplots(figsize=(min(16, 1.5 + 0.95 * longest), 0.9 + 0.8 * len(ranks)))
    for row, r in enumerate(ranks):
        y = len(ranks) - 1 - row
        ax.text(-0.2, y + 0.3, f"rank {r}", ha="right", va="center", fontsize=9)
        for i, label in enumerate(sequences[r]):
            partners = [sequences[q][i] for q in ranks if i < len(sequences[q])]
            if i >= shortest:
                color, text = COLORS[3], f"{label}\nwaits until\nthe timeout"
            elif any(p != label for p in partners):
                color, text = COLORS[1], label
            else:
                color, text = COLORS[0], label
            _box(ax, i, y, 0.88, 0.6, text, color, alpha=0.3, fontsize=6.5)
    ax.set_xlim(-1.0, longest + 0.2)
    ax.set_ylim(-0.3, len(ranks))
    ax.axis("off")
    ax.set_title(
        title
        or "Collectives pair up by position: blue agrees, orange mismatched, red has no partner",
        fontsize=10,
    )
    return _done(fig)


def _chunks(rows: int, parts: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of ``torch.chunk``'s pieces of ``rows`` rows (FSDP2's shards)."""
    bounds, start = [], 0
    for piece in torch.arange(rows).chunk(parts):
        bounds.append((start, start + len(piece)))
        start += len(piece)
    return bounds


def dcp_reshard(saved: int = 2, loaded: int = 3, rows: int = 256) -> Figure:
    """A sharded parameter saved by ``saved`` ranks with ``torch.distributed.checkpoint`` and
    loaded by ``loaded`` ranks: each rank writes its own rows into its own file, and each
    new rank reads its new rows from whichever files hold them (``.metadata`` says where).

    Example:
        >>> len(dcp_reshard().axes)
        1
    """
    fig, ax = plt.subplots(figsize=(10, 3.2))
    scale = 4.0 / rows  # rows -> height
    old, new = _chunks(rows, saved), _chunks(rows, loaded)
    for r, (a, b) in enumerate(old):
        y = 4.0 - b * scale
        _box(
            ax,
            0.0,
            y,
            1.6,
            (b - a) * scale - 0.06,
            f"rank {r}\nrows {a}-{b - 1}",
            COLORS[r],
            0.3,
            8,
        )
        _box(
            ax,
            3.2,
            y,
            1.8,
            (b - a) * scale - 0.06,
            f"__{r}_0.distcp\nrows {a}-{b - 1}",
            COLORS[r],
            0.15,
            8,
        )
        _arrow(
            ax, (1.65, y + (b - a) * scale / 2), (3.15, y + (b - a) * scale / 2), color=COLORS[r]
        )
    ax.text(4.1, 4.25, ".metadata: which rows are in which file", ha="center", fontsize=8)
    for r, (a, b) in enumerate(new):
        y = 4.0 - b * scale
        _box(ax, 6.6, y, 1.6, (b - a) * scale - 0.06, f"rank {r}\nrows {a}-{b - 1}", GREY, 0.2, 8)
        for f, (fa, fb) in enumerate(old):  # the files this new rank reads from
            lo, hi = max(a, fa), min(b, fb)
            if lo < hi:
                mid = 4.0 - (lo + hi) / 2 * scale
                _arrow(ax, (5.05, mid), (6.55, mid), color=COLORS[f])
    ax.text(0.8, -0.45, f"saved on {saved} ranks (each writes)", ha="center", fontsize=9)
    ax.text(7.4, -0.45, f"loaded on {loaded} ranks (each reads)", ha="center", fontsize=9)
    ax.set_xlim(-0.2, 8.4)
    ax.set_ylim(-0.7, 4.5)
    ax.axis("off")
    ax.set_title(
        f"One sharded parameter of {rows} rows: written by {saved} ranks, resharded onto {loaded}",
        fontsize=10,
    )
    return _done(fig)
