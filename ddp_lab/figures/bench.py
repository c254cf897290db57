"""The figure of ``make bench`` (``results/bench/bench.png``): the trainer against plain
PyTorch pair by pair, the communication share of a step, and bus bandwidth over message
sizes for ``dist.all_reduce`` and a ring all-reduce with their fitted alpha-beta model.

It reads the dict that ``bench.json`` holds and draws whatever parts it finds.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure

from ddp_lab.figures.style import COLORS, GREY, done


def plot_bench(result: dict, path: str | None = None) -> Figure:
    """Up to three panels from a ``bench.json`` dict.

    Args:
        result: what ``make bench`` wrote (``throughput``, ``comm_share``, ``bandwidth``).
        path: where to save the PNG, if anywhere.

    Returns:
        The (closed) figure.

    Example:
        >>> fig = plot_bench({"bandwidth": {"sizes": [1024, 2048], "world_size": 2,
        ...     "bus_bandwidth": {"all_reduce": [1e8, 2e8]}, "fit": {}}})
        >>> len(fig.axes)
        1
    """
    panels = [k for k in ("throughput", "comm_share", "bandwidth") if k in result]
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(4.6 * max(1, len(panels)), 3.6))
    axes = np.atleast_1d(axes)
    for ax, name in zip(axes, panels, strict=False):
        {"throughput": _pairs, "comm_share": _comm, "bandwidth": _bandwidth}[name](ax, result)
    if path:
        fig.tight_layout()
        fig.savefig(path, dpi=100)
    return done(fig)


def _pairs(ax, result: dict) -> None:
    tp = result["throughput"]
    keys = sorted(k for k in tp if k.startswith("np"))
    for i, key in enumerate(keys):
        for other, style in (("reference", "o-"), ("plain", "s--")):
            r = tp[key].get(f"trainer_over_{other}")
            if r is None:
                continue
            xs = np.arange(1, len(r["ratios"]) + 1)
            label = f"{key[2:]} proc. / {other}: {r['median']:.3f}"
            ax.plot(xs, r["ratios"], style, color=COLORS[i], label=label)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.axhline(1.0, color=GREY, lw=1)
    ax.axhline(0.98, color=COLORS[3], lw=1, ls="--", label="target 0.98")
    ax.set_xlabel("round (reference, plain, trainer)")
    ax.set_ylabel("trainer / plain DDP samples/s")
    ax.set_title(f"{result.get('model', '')}, batch {result.get('batch_per_process', '')}")
    ax.legend(fontsize=8)


def _comm(ax, result: dict) -> None:
    c = result["comm_share"]
    ms = [c["synced_median_s"] * 1e3, c["no_sync_median_s"] * 1e3]
    ax.bar(["synced", "no_sync"], ms, color=[COLORS[0], COLORS[2]])
    ax.set_ylabel("step time (ms)")
    ax.set_title(f"communication share {c['share']:.1%}")


def _bandwidth(ax, result: dict) -> None:
    b = result["bandwidth"]
    sizes = np.asarray(b["sizes"], dtype=float)
    n = b["world_size"]
    for i, (name, bus) in enumerate(b["bus_bandwidth"].items()):
        ax.plot(sizes, np.asarray(bus) / 1e9, "o", color=COLORS[i], label=name)
        curve = b["fit"].get(name, {}).get("curve")  # [[size, bus bandwidth], ...]
        if curve:
            xs, ys = zip(*curve, strict=True)
            ax.plot(xs, np.asarray(ys) / 1e9, "-", color=COLORS[i], lw=1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(f"all-reduce on {n} processes (lines: alpha-beta fit)")
    ax.legend(fontsize=8)
