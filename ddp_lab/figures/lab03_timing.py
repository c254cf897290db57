"""Figures of lab 3 about communication during backward: your own DDP's time line, DDP's
buckets as measured, why overlap pays, and your wrappers measured on a slowed link.

Every function returns a matplotlib Figure that is already closed for pyplot, so a notebook
cell that ends with the call shows it exactly once. ``ddp_lab.figures.lab03`` re-exports
them.
"""

from __future__ import annotations

from collections.abc import Mapping

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from ddp_lab.figures.style import COLORS, GREY
from ddp_lab.figures.style import arrow as _arrow
from ddp_lab.figures.style import box as _box
from ddp_lab.figures.style import done as _done

LIGHT = "#E5E5E5"


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


def overlap_measured(results: Mapping[str, Mapping], latency: float) -> Figure:
    """Measured on a slowed link: one step of your wrappers, messages drawn where they travel.

    Args:
        results: ``label -> {"step": seconds, "end": seconds when backward returned,
            "calls": [[seconds when an all-reduce started, elements, async_op], ...]}``
            (what ``ddp_lab.checks.lab03.network.measure_step`` returns).
        latency: seconds a message occupies the link (one message at a time).

    Returns:
        The figure: one row per label: the backward pass (grey, until ``loss.backward()``
        returned), each message on the link (from its start, or when the link got free),
        and the step time.

    Example:
        >>> fig = overlap_measured({"a": {"step": 0.3, "end": 0.2, "calls": [[0.0, 10, True]]}},
        ...                        0.1)
        >>> len(fig.axes)
        1
    """
    labels = list(results)
    longest = max(r["step"] for r in results.values())
    fig, ax = plt.subplots(figsize=(10, 0.75 * len(labels) + 1.4))
    for i, label in enumerate(labels):
        r, y = results[label], len(labels) - 1 - i
        ax.add_patch(Rectangle((0, y + 0.05), 1e3 * r["end"], 0.3, facecolor=LIGHT, edgecolor=GREY))
        free = 0.0
        for k, (start, _, _) in enumerate(r["calls"]):
            begin = max(start, free)
            free = begin + latency
            ax.add_patch(
                Rectangle(
                    (1e3 * begin, y - 0.32),
                    1e3 * latency,
                    0.3,
                    facecolor=COLORS[1 + k % 2],
                    edgecolor="black",
                    lw=0.4,
                    alpha=0.8,
                )
            )
        ax.plot([1e3 * r["step"]] * 2, [y - 0.38, y + 0.41], color="black", lw=1.2)
        ax.text(1e3 * r["step"] + 4, y, f"{1e3 * r['step']:.0f} ms", va="center", fontsize=8)
    ax.set_yticks(range(len(labels)), list(reversed(labels)), fontsize=8)
    ax.set_ylim(-0.6, len(labels) - 0.4)
    ax.set_xlim(0, 1e3 * longest * 1.15)
    ax.set_xlabel(
        f"ms since the step began (grey: backward; coloured: messages of {1e3 * latency:g} ms "
        "on the link; black line: the step ends)"
    )
    ax.set_title("Your wrappers on a slowed link: what overlap saves", fontsize=10)
    return _done(fig)
