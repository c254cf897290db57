"""Figures of lab 9 (PyTorch's distributed stack), one function per concept.

Every function returns a matplotlib Figure that is already closed for pyplot, so a notebook
cell that ends with the call shows it exactly once. Lab 7's figures of the same ideas
(tensor parallelism, hybrid layouts) are reused from :mod:`ddp_lab.figures.lab07`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from ddp_lab.figures.style import COLORS, GREY
from ddp_lab.figures.style import box as _box
from ddp_lab.figures.style import done as _done


def fsdp_rows(shapes: Mapping[str, Sequence[int]], world: int = 3) -> Figure:
    """Each parameter of ``shapes`` as a column of its rows, coloured by the rank that holds
    them under FSDP2 (``torch.chunk`` along dimension 0; ranks past the last chunk hold
    nothing). The rows are drawn from the mechanism, not from any exercise's answer.

    Example:
        >>> len(fsdp_rows({"head.weight": (10, 16), "ln.bias": (2,)}, world=3).axes)
        1
    """
    fig, ax = plt.subplots(figsize=(1.6 + 1.7 * len(shapes), 3.6))
    tallest = 10.0  # every parameter drawn at the same height, its rows in proportion
    for i, (name, shape) in enumerate(shapes.items()):
        rows, per = shape[0], math.ceil(shape[0] / world)
        unit = tallest / rows
        for r in range(world):
            lo, hi = min(r * per, rows), min((r + 1) * per, rows)
            if hi > lo:
                text = f"rank {r}: {hi - lo} row{'s' if hi - lo > 1 else ''}"
                _box(
                    ax,
                    i * 1.7,
                    tallest - hi * unit,
                    1.4,
                    (hi - lo) * unit,
                    text,
                    COLORS[r % len(COLORS)],
                    fontsize=7,
                )
        empty = [r for r in range(world) if min(r * per, rows) >= rows]
        label = f"{name}\n{' x '.join(map(str, shape))}"
        if empty:
            label += (
                f"\nranks {', '.join(map(str, empty))}: none"
                if len(empty) > 1
                else (f"\nrank {empty[0]}: none")
            )
        ax.text(i * 1.7 + 0.6, -0.6, label, ha="center", va="top", fontsize=8)
    ax.set_title(
        f"FSDP2 over {world} ranks: each parameter cut by rows, ceil(rows / {world}) "
        "a rank, the last ranks what is left",
        fontsize=9,
    )
    ax.set_xlim(-0.3, 1.7 * len(shapes))
    ax.set_ylim(-0.35 * tallest - 2, tallest + 0.5)
    ax.axis("off")
    return _done(fig)


def gathered(layers: int, per_block: bool) -> dict[str, list[bool]]:
    """Which units are gathered (whole on every rank) at each moment of a step, ``F0 ..
    F{L-1}`` then ``B{L-1} .. B0``: ``{unit: [gathered at each moment]}``. One unit for the
    whole model keeps everything gathered through the step; one unit per block gathers a
    block for its forward, frees it, gathers it again for its backward, while the root
    unit (the rest of the model) stays gathered from its forward to its backward.
    (Prefetching, which gathers the next block a little early, is left out.)

    Example:
        >>> gathered(2, per_block=True)["block 1"]
        [False, True, True, False]
    """
    moments = 2 * layers
    out = {"rest (root)": [True] * moments}
    for i in range(layers):
        out[f"block {i}"] = [not per_block or m in (i, moments - 1 - i) for m in range(moments)]
    return out


def fsdp_units(layers: int = 4) -> Figure:
    """Which parameters are gathered through a step of a ``layers``-block model: one FSDP
    unit for the whole model against one unit per block (see :func:`gathered`).

    Example:
        >>> len(fsdp_units(3).axes)
        2
    """
    fig, axes = plt.subplots(
        1, 2, figsize=(11, 0.9 + 0.45 * (layers + 1)), gridspec_kw={"width_ratios": [1, 1]}
    )
    names = [f"F{i}" for i in range(layers)] + [f"B{i}" for i in reversed(range(layers))]
    for ax, per_block, title in (
        (axes[0], False, "one unit: the whole model"),
        (axes[1], True, "one unit per block, then the model"),
    ):
        units = gathered(layers, per_block)
        for row, (unit, flags) in enumerate(units.items()):
            y = len(units) - 1 - row
            for m, on in enumerate(flags):
                _box(ax, m, y, 0.9, 0.8, "", COLORS[0] if on else GREY, alpha=0.7 if on else 0.1)
            ax.text(-0.2, y + 0.4, unit, ha="right", va="center", fontsize=8)
        for m, name in enumerate(names):
            ax.text(m + 0.45, -0.35, name, ha="center", va="center", fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.set_xlim(-2.4, len(names))
        ax.set_ylim(-0.7, layers + 1)
        ax.axis("off")
    fig.suptitle(
        "Parameters gathered (dark: whole on every rank) through one step: forward of "
        "block i (F i), then backward (B i)",
        fontsize=9,
    )
    return _done(fig)
