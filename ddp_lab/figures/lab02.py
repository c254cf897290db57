"""Figures of lab 2 (processes and collectives), one function per concept.

Every function returns a matplotlib Figure that is already closed for pyplot, so a notebook
cell that ends with the call shows it exactly once.

- :func:`collectives`: each rank's tensor before and after broadcast, all_reduce, ...;
- :func:`ring_steps`: the chunks every rank holds after each step of a ring all-reduce;
- :func:`staleness_curves`: the loss of a parameter server with staleness 0, 1, 2, ...;
- :func:`model_scaling`: how the alpha-beta models' times grow with the number of ranks;
- :func:`bandwidth_sweep`: measured all-reduce times with the fitted alpha-beta line;
- :func:`ring_vs_server`: measured times of the ring and the server against ``n``;
- :func:`send_recv_order`: why blocking receives deadlock and posted sends do not.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import to_rgb
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Rectangle
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from ddp_lab.figures.style import COLORS
from ddp_lab.figures.style import done as _done

SUM = "#7F7F7F"
FOUR = ("broadcast", "all_reduce", "all_gather", "reduce_scatter")
CAPTIONS = {
    "broadcast": "broadcast(t, src=0): everyone gets rank 0's tensor",
    "all_reduce": "all_reduce(t): everyone gets the sum",
    "all_gather": "all_gather(parts, t): everyone gets every tensor",
    "reduce_scatter": "reduce_scatter(out, chunks): rank r gets the sum of chunk r",
}

#: The messages of a ring all-reduce on 3 ranks, step by step: ``(src, dst, chunk)``. The
#: first two steps are the reduce-scatter (the receiver adds), the last two the all-gather
#: (the receiver overwrites). This is what the picture shows; it is the notebook's text.
RING_3 = (
    ((0, 1, 0), (1, 2, 1), (2, 0, 2)),
    ((0, 1, 2), (1, 2, 0), (2, 0, 1)),
    ((0, 1, 1), (1, 2, 2), (2, 0, 0)),
    ((0, 1, 0), (1, 2, 1), (2, 0, 2)),
)


def _cells(ax, y: float, values: Sequence[float], colors: Sequence[str], x0: float = 0.0):
    for i, (v, c) in enumerate(zip(values, colors, strict=True)):
        ax.add_patch(Rectangle((x0 + i, y), 0.94, 0.8, facecolor=c, alpha=0.35, edgecolor=c))
        ax.text(x0 + i + 0.47, y + 0.4, f"{v:g}", ha="center", va="center", fontsize=8)


def _origins(op: str, rank: int, length: int, width: int, members: Sequence[int]) -> list[str]:
    """The colour of each value after ``op``: the rank it came from, or grey for a sum."""
    if op == "broadcast":
        return [COLORS[0]] * length
    if op == "all_gather":
        return [COLORS[(i // width) % len(COLORS)] for i in range(length)]
    if rank not in members:
        return [COLORS[rank % len(COLORS)]] * length
    return [SUM] * length


def collectives(tour: Mapping, ops: Sequence[str] = FOUR) -> Figure:
    """Every rank's tensor before (left) and after (right) each collective of ``tour``.

    Args:
        tour: the result the notebook's ``tour.py`` wrote: ``{"world_size": n, "ranks":
            [{"before": [...], "after": {op: [...]}}, ...]}``.
        ops: which collectives to draw, in order (keys of ``after``). An op named
            ``"... group [0, 1]"`` is drawn as a collective of those ranks only.

    Returns:
        One row per collective. Colours say where a value came from: one colour per rank,
        grey for a sum.

    Example:
        >>> tour = {"world_size": 2, "ranks": [
        ...     {"before": [0.0, 1.0], "after": {"all_reduce": [10.0, 12.0]}},
        ...     {"before": [10.0, 11.0], "after": {"all_reduce": [10.0, 12.0]}}]}
        >>> len(collectives(tour, ["all_reduce"]).axes)
        1
    """
    n = tour["world_size"]
    ranks = tour["ranks"]
    width = len(ranks[0]["before"])
    widest = max(len(ranks[r]["after"][op]) for op in ops for r in range(n))
    fig, axes = plt.subplots(
        len(ops),
        1,
        figsize=(1.0 + 0.55 * (width + widest + 3), 0.55 + 0.62 * n * len(ops)),
        squeeze=False,
    )
    for ax, op in zip(axes[:, 0], ops, strict=True):
        members = range(n)
        if "group [" in op:
            members = [int(v) for v in op.split("group [")[1].rstrip("]").split(",")]
        for r in range(n):
            y = n - 1 - r
            ax.text(-0.3, y + 0.4, f"rank {r}", ha="right", va="center", fontsize=9)
            _cells(ax, y, ranks[r]["before"], [COLORS[r % len(COLORS)]] * width)
            after = ranks[r]["after"][op]
            _cells(ax, y, after, _origins(op, r, len(after), width, members), x0=width + 2)
            if r not in members:
                ax.text(
                    width + 2.1 + len(after),
                    y + 0.4,
                    "not in the group",
                    va="center",
                    fontsize=8,
                    color=SUM,
                )
        ax.annotate(
            "",
            (width + 1.8, n / 2),
            (width + 0.2, n / 2),
            arrowprops={"arrowstyle": "->", "lw": 1.5},
        )
        ax.text(width / 2, n + 0.05, "before", ha="center", fontsize=9)
        ax.text(width + 2 + widest / 2, n + 0.05, "after", ha="center", fontsize=9)
        ax.set_title(CAPTIONS.get(op, op), fontsize=10, loc="left")
        ax.set_xlim(-1.6, width + 2 + widest + (2.5 if len(members) < n else 0.2))
        ax.set_ylim(-0.2, n + 0.45)
        ax.axis("off")
    return _done(fig)


def ring_steps(world_size: int = 3, schedule: Sequence | None = None) -> Figure:
    """The chunks each rank holds before and after every step of a ring all-reduce.

    Args:
        world_size: ranks on the ring.
        schedule: the ring's ``2 * (world_size - 1)`` steps, each a list of ``(src, dst,
            chunk)`` messages, the reduce-scatter first (default: :data:`RING_3`, for 3 ranks).

    Returns:
        One panel per state: the start, ``n - 1`` reduce-scatter steps, ``n - 1`` all-gather
        steps. A box lists the ranks whose values the chunk sums; it darkens as the sum
        fills up, and a red edge marks the chunk received in that step.

    Raises:
        ValueError: no schedule given for another world size than 3.

    Example:
        >>> len(ring_steps(3).axes)
        5
    """
    n = world_size
    if schedule is None:
        if n != 3:
            raise ValueError(f"the default schedule is for 3 ranks; give schedule= for {n}")
        schedule = RING_3
    held = [[{r} for _ in range(n)] for r in range(n)]  # held[rank][chunk]: ranks summed in
    states, received = [[row[:] for row in held]], [set()]
    for k, step in enumerate(schedule):
        reduce = k < len(schedule) // 2
        sent = [(dst, chunk, set(held[src][chunk])) for src, dst, chunk in step]
        for dst, chunk, values in sent:
            held[dst][chunk] = held[dst][chunk] | values if reduce else values
        states.append([[set(c) for c in row] for row in held])
        received.append({(dst, chunk) for dst, chunk, _ in sent})
    cols = len(states)
    fig, axes = plt.subplots(1, cols, figsize=(2.0 * cols + 0.6, 0.9 + 0.55 * n), squeeze=False)
    for k, (ax, state) in enumerate(zip(axes[0], states, strict=True)):
        for r in range(n):
            y = n - 1 - r
            if k == 0:
                ax.text(-0.15, y + 0.4, f"rank {r}", ha="right", va="center", fontsize=8)
            for c in range(n):
                full = len(state[r][c]) / n
                edge = "#C44E52" if (r, c) in received[k] else "#555555"
                face = (*to_rgb(COLORS[2]), 0.15 + 0.7 * full**2)
                lw = 2.0 if (r, c) in received[k] else 0.6
                ax.add_patch(Rectangle((c, y), 0.92, 0.8, facecolor=face, edgecolor=edge, lw=lw))
                label = "+".join(str(v) for v in sorted(state[r][c]))
                ax.text(c + 0.46, y + 0.4, label, ha="center", va="center", fontsize=7)
        if k == 0:
            title = "start: chunk c of rank r"
        elif k < n:
            title = f"reduce-scatter {k}/{n - 1}"
        else:
            title = f"all-gather {k - n + 1}/{n - 1}"
        for c in range(n):
            ax.text(c + 0.46, -0.2, f"chunk {c}", ha="center", va="center", fontsize=7)
        ax.set_title(title, fontsize=9)
        ax.set_xlim(-0.05, n)
        ax.set_ylim(-0.4, n)
        ax.axis("off")
    fig.suptitle(
        f"Ring all-reduce on {n} ranks: each box lists the ranks summed into a chunk", fontsize=10
    )
    return _done(fig)


def staleness_curves(curves: Mapping) -> Figure:
    """The loss after every step of the same training with different staleness bounds.

    Args:
        curves: ``{staleness: [loss at the start, after step 1, ...]}`` (keys may be strings,
            as they come back from JSON).

    Returns:
        One panel, the loss on a log scale against the step, one line per staleness.

    Example:
        >>> len(staleness_curves({0: [1.0, 0.5, 0.2], "1": [1.0, 0.7, 0.6]}).axes)
        1
    """
    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    for i, (s, curve) in enumerate(sorted(curves.items(), key=lambda kv: int(kv[0]))):
        label = "synchronous (staleness 0)" if int(s) == 0 else f"staleness {s}"
        ax.plot(range(len(curve)), curve, "-", color=COLORS[i % len(COLORS)], label=label)
    ax.set_yscale("log")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss over all workers' data")
    ax.legend(fontsize=9)
    ax.grid(alpha=0.3, which="both")
    return _done(fig)


def model_scaling(
    time_fn: Callable,
    alpha: float = 20e-6,
    bandwidth: float = 10e9,
    sizes: Sequence[float] = (1e3, 1e6, 1e9),
    max_world_size: int = 64,
    server_fn: Callable | None = None,
) -> Figure:
    """The alpha-beta models' times for several message sizes, against ``n``.

    Args:
        time_fn: ``time_fn(size_bytes, world_size, alpha, bandwidth)``: your ``ring_time``.
        alpha, bandwidth: the model's latency (s) and bandwidth (bytes/s).
        sizes: message sizes in bytes, one line each.
        max_world_size: the largest ``n`` drawn.
        server_fn: another model with the same arguments (your ``server_time``), drawn
            dashed, relative to the ring on 2 ranks.

    Returns:
        Time relative to the ring on 2 ranks: small messages grow with the latencies; large
        ones level off below 2x in the ring.

    Example:
        >>> def toy(size, n, alpha, bandwidth):  # any model; the notebook passes ring_time
        ...     return n * alpha + size / bandwidth
        >>> len(model_scaling(toy).axes)
        1
    """
    n = np.unique(np.geomspace(2, max_world_size, 12).astype(int))
    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    for i, s in enumerate(sizes):
        t = np.array([float(time_fn(s, int(k), alpha, bandwidth)) for k in n])
        ax.plot(n, t / t[0], "o-", color=COLORS[i], label=f"ring, S = {_bytes(s)}")
        if server_fn is not None:
            ts = np.array([float(server_fn(s, int(k), alpha, bandwidth)) for k in n])
            ax.plot(n, ts / t[0], "--", color=COLORS[i], label=f"server, S = {_bytes(s)}")
    ax.set_xscale("log", base=2)
    ax.set_xticks([k for k in (2, 4, 8, 16, 32, 64, 128, 256) if k <= max_world_size])
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_yscale("log")
    ax.set_xlabel("ranks n")
    ax.set_ylabel("time / ring time on 2 ranks")
    ax.set_title(f"alpha = {alpha * 1e6:g} us, B = {bandwidth / 1e9:g} GB/s", fontsize=10)
    ax.legend(fontsize=9)
    ax.grid(alpha=0.3, which="both")
    return _done(fig)


def _bytes(s: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if s >= scale:
            return f"{s / scale:g} {unit}"
    return f"{s:g} B"


def bandwidth_sweep(
    sizes: Sequence[float],
    seconds: Sequence[float],
    world_size: int,
    alpha: float,
    bandwidth: float,
    time_fn: Callable,
    title: str = "all_reduce, gloo on this CPU",
) -> Figure:
    """Measured all-reduce times against message size, with the fitted model.

    Args:
        sizes: message sizes in bytes.
        seconds: measured time for each size.
        world_size: ranks the times were measured with.
        alpha, bandwidth: the fitted latency (s) and bandwidth (bytes/s).
        time_fn: the model, ``time_fn(size_bytes, world_size, alpha, bandwidth)`` (your
            ``ring_time``), drawn as a line.
        title: what was measured, where.

    Returns:
        Two panels: time (log-log, points measured, line the model) and the achieved bus
        bandwidth ``2(n - 1)/n * S / T`` with the fitted ``B`` as a dashed line.

    Example:
        >>> def toy(size, n, alpha, bandwidth):  # any model; the notebook passes ring_time
        ...     return n * alpha + size / bandwidth
        >>> s = np.array([1e3, 1e6]); t = toy(s, 2, 1e-5, 1e9)
        >>> len(bandwidth_sweep(s, t, 2, 1e-5, 1e9, toy).axes)
        2
    """
    s, t = np.asarray(sizes, dtype=float), np.asarray(seconds, dtype=float)
    n = world_size
    line = np.geomspace(s.min(), s.max(), 100)
    model = np.asarray(time_fn(line, n, alpha, bandwidth), dtype=float)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    ax1.loglog(s, t * 1e6, "o", color=COLORS[0], label=f"measured, {n} ranks")
    label = f"model: alpha = {alpha * 1e6:.3g} us, B = {bandwidth / 1e9:.3g} GB/s"
    ax1.loglog(line, model * 1e6, "-", color=COLORS[3], label=label)
    ax1.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax1.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax1.yaxis.set_minor_formatter(NullFormatter())
    ax1.set_xlabel("message size S (bytes)")
    ax1.set_ylabel("time (us)")
    ax1.legend(fontsize=8)
    ax1.grid(alpha=0.3, which="both")
    busbw = s / t * (2 - 2 / n) / 1e9  # nccl-tests' bus bandwidth, in GB/s
    ax2.semilogx(s, busbw, "o-", color=COLORS[0], label="measured: 2(n-1)/n S / T")
    tops = [v for v in (*busbw, bandwidth / 1e9) if np.isfinite(v) and v > 0]
    if np.isfinite(bandwidth) and bandwidth > 0:
        ax2.axhline(bandwidth / 1e9, color=COLORS[3], linestyle="--", label="fitted B")
    ax2.set_xlabel("message size S (bytes)")
    ax2.set_ylabel("bus bandwidth (GB/s)")
    ax2.set_ylim(0, max(tops, default=1.0) * 1.15)
    ax2.legend(fontsize=8)
    ax2.grid(alpha=0.3, which="both")
    fig.suptitle(title, fontsize=10)
    return _done(fig)


def ring_vs_server(race: Mapping) -> Figure:
    """Measured times of ``dist.all_reduce``, a ring and a parameter-server step against ``n``.

    Args:
        race: ``{n: {"sizes": [S, ...], "seconds": {design: [seconds per size]}}}``, what the
            notebook's ``race.py`` wrote for each number of ranks.

    Returns:
        One panel per message size: milliseconds against the number of ranks, one line per
        design.

    Example:
        >>> run = {"sizes": [64, 4096], "seconds": {"ring": [1e-4, 2e-4], "server": [1e-4, 4e-4]}}
        >>> len(ring_vs_server({2: run, 3: run}).axes)
        2
    """
    ns = sorted(race, key=int)
    sizes = race[ns[0]]["sizes"]
    designs = list(race[ns[0]]["seconds"])
    fig, axes = plt.subplots(1, len(sizes), figsize=(5 * len(sizes), 3.2), squeeze=False)
    for j, (ax, size) in enumerate(zip(axes[0], sizes, strict=True)):
        for i, design in enumerate(designs):
            ms = [race[n]["seconds"][design][j] * 1e3 for n in ns]
            ax.plot([int(n) for n in ns], ms, "o-", color=COLORS[i % len(COLORS)], label=design)
        ax.set_xticks([int(n) for n in ns])
        ax.set_xlabel("ranks n")
        ax.set_ylabel("time (ms)")
        ax.set_ylim(bottom=0)
        binary = next(
            (f"{size / k:g} {u}" for u, k in (("MB", 2**20), ("KB", 2**10)) if size >= k), ""
        )
        ax.set_title(f"S = {binary or f'{size} B'}", fontsize=10)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    return _done(fig)


def send_recv_order() -> Figure:
    """Two ranks exchanging a message: blocking receives first (deadlock) against posted sends.

    Example:
        >>> len(send_recv_order().axes)
        2
    """
    fig, axes = plt.subplots(1, 2, figsize=(10, 2.6))
    cases = [
        ("every rank: recv(left), then send(right)", ["recv: waits", "recv: waits"], False),
        ("every rank: isend(right), recv(left), wait()", ["isend", "isend"], True),
    ]
    for ax, (title, first, works) in zip(axes, cases, strict=True):
        for r, y in ((0, 1.0), (1, 0.0)):
            ax.plot([0, 10], [y, y], color="#555555", lw=1)
            ax.text(-0.3, y, f"rank {r}", ha="right", va="center", fontsize=9)
            ax.text(1.0, y + 0.12, first[r], fontsize=8)
        if works:
            for y0, y1 in ((1.0, 0.0), (0.0, 1.0)):
                ax.add_patch(
                    FancyArrowPatch(
                        (1.5, y0), (4.5, y1), arrowstyle="->", mutation_scale=12, color=COLORS[2]
                    )
                )
            for y in (1.0, 0.0):
                ax.text(4.8, y + 0.12, "recv: done   wait(): done", fontsize=8, color=COLORS[2])
            ax.text(
                5,
                -0.45,
                "both messages are on their way before anyone blocks",
                ha="center",
                fontsize=8,
            )
        else:
            for y in (1.0, 0.0):
                ax.plot([1.5, 9.5], [y, y], color=COLORS[3], lw=4, alpha=0.5)
                ax.text(
                    5.5,
                    y - 0.22,
                    "blocked ... until the launcher's timeout",
                    ha="center",
                    fontsize=8,
                    color=COLORS[3],
                )
            ax.text(
                5, -0.45, "each waits for a message the other never sends", ha="center", fontsize=8
            )
        ax.set_title(title, fontsize=10)
        ax.set_xlim(-1.5, 10.5)
        ax.set_ylim(-0.6, 1.4)
        ax.axis("off")
    return _done(fig)
