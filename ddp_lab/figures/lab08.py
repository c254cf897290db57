"""Lab 8's figures: where a training step's time goes on this machine.

- :func:`matmul_peak`: the FLOP/s of a large float32 matrix product here (the "peak" a
  utilisation figure divides by), measured;
- :func:`op_groups`: a profiled step's self CPU time by kind of operator;
- :func:`utilisation`: the step's time split by kind of operator, next to the time its
  FLOPs would take at the measured peak.
"""

from __future__ import annotations

import time

import matplotlib.pyplot as plt
import torch
from matplotlib.figure import Figure

from ddp_lab.figures.style import COLORS

__all__ = ["GROUPS", "matmul_peak", "op_groups", "utilisation"]

#: kind of operator -> name fragments of the aten operators it holds (first match wins)
GROUPS = {
    "matmul": ("addmm", "mm", "bmm", "matmul", "linear", "convolution", "conv"),
    "optimizer": ("_foreach", "sgd", "adam", "lerp", "addcmul", "addcdiv"),
    "elementwise": ("relu", "gelu", "threshold", "add", "mul", "div", "sub", "copy", "fill"),
    "loss": ("log_softmax", "nll_loss", "cross_entropy", "softmax"),
}


def matmul_peak(n: int = 1024, repeats: int = 10) -> float:
    """FLOP/s of an ``n x n`` float32 matrix product on this process's threads: the best of
    ``repeats`` timed products (``2 n^3`` FLOPs each), after one untimed warm-up."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def op_groups(key_averages) -> dict[str, float]:
    """Seconds of self CPU time per kind of operator (:data:`GROUPS`, then ``"other"``) in a
    profiler's ``key_averages()`` (the profiler's own ``ProfilerStep`` ranges left out)."""
    out = dict.fromkeys([*GROUPS, "other"], 0.0)
    for row in key_averages:
        if row.key.startswith("ProfilerStep"):
            continue
        name = row.key.removeprefix("aten::").lower()
        group = next((g for g, parts in GROUPS.items() if any(p in name for p in parts)), "other")
        out[group] += row.self_cpu_time_total / 1e6
    return out


def utilisation(groups: dict[str, float], flops: float, peak: float, steps: int) -> Figure:
    """One step's self CPU time by kind of operator (stacked), under the time its ``flops``
    would take at ``peak`` FLOP/s."""
    fig, ax = plt.subplots(figsize=(9, 2.4))
    ideal = flops / peak * 1e3
    ax.barh(1, ideal, color="0.3", height=0.6)
    ax.text(ideal, 1, f"  {ideal:.2f} ms", va="center", fontsize=9)
    left = 0.0
    for (name, seconds), color in zip(groups.items(), [*COLORS, "0.7"], strict=False):
        width = seconds / steps * 1e3
        if width <= 0:
            continue
        ax.barh(0, width, left=left, color=color, height=0.6, label=name)
        left += width
    ax.text(left, 0, f"  {left:.2f} ms", va="center", fontsize=9)
    ax.set_yticks([0, 1], ["measured step,\nby operator", "its FLOPs at\nthe matmul peak"])
    ax.set_xlabel("ms per step (self CPU time of the operators)")
    ax.set_xlim(0, max(left, ideal) * 1.2)
    ax.legend(loc="center left", fontsize=8, frameon=False, bbox_to_anchor=(1.0, 0.5))
    ax.set_title(f"utilisation {ideal / left:.0%} of the measured peak", loc="left")
    fig.tight_layout()
    plt.close(fig)
    return fig
