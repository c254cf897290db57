"""What every lab's figures share: the palette, and closed figures, boxes and arrows."""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

COLORS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3")
GREY = "#8C8C8C"


def done(fig: Figure) -> Figure:
    """Lay ``fig`` out and close it for pyplot, so that a notebook cell ending with the
    call shows it exactly once."""
    fig.tight_layout()
    plt.close(fig)
    return fig


def box(ax, x, y, w, h, text, color, alpha=0.25, fontsize=9) -> None:
    """A rounded, tinted box at ``(x, y)`` of size ``(w, h)`` with centred ``text``."""
    ax.add_patch(
        FancyBboxPatch(
            (x, y), w, h, boxstyle="round,pad=0.02", facecolor=color, edgecolor=color, alpha=alpha
        )
    )
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize)


def arrow(ax, start, end, color="black", style="-|>") -> None:
    """An arrow from ``start`` to ``end`` (data coordinates)."""
    ax.add_patch(
        FancyArrowPatch(start, end, arrowstyle=style, mutation_scale=10, color=color, lw=1)
    )
