"""Figures of lab 5 (mixed precision, gradient accumulation, clipping), one function per concept.

Every function returns a matplotlib Figure that is already closed for pyplot, so a notebook
cell that ends with the call shows it exactly once.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
import torch
from matplotlib.figure import Figure

from ddp_lab.figures.style import COLORS, GREY
from ddp_lab.figures.style import arrow as _arrow
from ddp_lab.figures.style import box as _box
from ddp_lab.figures.style import done as _done

#: Binary exponents (log2 of the magnitude) each format covers: smallest subnormal, smallest
#: normal, largest finite.
FORMATS = {
    "float32": (-149, -126, 128),
    "bfloat16": (-133, -126, 128),
    "float16": (-24, -14, 16),
}
_FORMAT_COLORS = {"float32": COLORS[0], "bfloat16": COLORS[2], "float16": COLORS[1]}


def _log2_magnitudes(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    flat = torch.cat([g.detach().reshape(-1).double() for g in grads])
    flat = flat[flat != 0].abs()
    return torch.log2(flat)


def number_formats(grads: Sequence[torch.Tensor], scale: float | None = None) -> Figure:
    """The three formats' ranges on a log2 number line, and where real gradients fall.

    Args:
        grads: gradients (float32 tensors) of a real backward pass.
        scale: a loss scale; its shifted histogram is drawn too.

    Returns:
        Top: the range of float32, bfloat16 and float16 (subnormals lighter) over the
        exponents -150 .. 130. Bottom: a zoom on float16's range with the histogram of
        ``log2 |g|`` of the nonzero gradients (and of ``log2 |scale * g|``).

    Example:
        >>> fig = number_formats([torch.randn(100) * 1e-4])
        >>> len(fig.axes)
        2
    """
    mags = _log2_magnitudes(grads)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 5.2), height_ratios=(1, 1.6))
    for row, (name, (sub, normal, high)) in enumerate(FORMATS.items()):
        color = _FORMAT_COLORS[name]
        top.barh(row, normal - sub, left=sub, color=color, alpha=0.3, height=0.6)
        top.barh(row, high - normal, left=normal, color=color, alpha=0.8, height=0.6)
        top.text(high + 2, row, name, va="center", fontsize=9)
    lo, hi = float(mags.min()), float(mags.max())
    top.axvspan(lo, hi, color=GREY, alpha=0.25)
    top.text((lo + hi) / 2, 2.55, "your gradients", ha="center", fontsize=8)
    top.set_yticks([])
    top.set_xlim(-155, 150)
    top.set_ylim(-0.6, 2.9)
    top.set_xlabel("log2 |x|  (light: subnormal numbers, dark: normal numbers)")
    top.set_title("What each format can hold: bfloat16 has float32's exponent range", fontsize=10)
    sub, normal, high = FORMATS["float16"]
    bottom.axvspan(sub - 1, sub, color=COLORS[3], alpha=0.15)
    bottom.axvspan(sub, normal, color=COLORS[1], alpha=0.12)
    bottom.axvspan(normal, high, color=COLORS[1], alpha=0.25)
    bottom.axvspan(high, high + 8, color=COLORS[3], alpha=0.15)
    edges = torch.arange(math.floor(min(lo, sub - 6)), math.ceil(max(hi, high + 4)) + 1, 0.5)
    counts = torch.histogram(mags.float(), bins=edges.float())[0]
    bottom.stairs(counts.numpy(), edges.numpy(), fill=True, color=GREY, alpha=0.7, label="|g|")
    if scale is not None:
        shifted = torch.histogram((mags + math.log2(scale)).float(), bins=edges.float())[0]
        bottom.stairs(
            shifted.numpy(),
            edges.numpy(),
            color=COLORS[0],
            lw=1.5,
            label=f"|g| x {scale:g} (loss scale)",
        )
    ymax = float(counts.max()) if counts.numel() else 1.0
    bottom.text(sub - 0.5, ymax * 0.95, "-> 0", ha="center", fontsize=8, color=COLORS[3])
    bottom.text((sub + normal) / 2, ymax * 0.95, "subnormal", ha="center", fontsize=8)
    bottom.text((normal + high) / 2, ymax * 0.95, "float16 normal", ha="center", fontsize=8)
    bottom.text(high + 2, ymax * 0.95, "-> inf", ha="center", fontsize=8, color=COLORS[3])
    bottom.set_xlim(float(edges[0]), float(edges[-1]))
    bottom.set_xlabel("log2 |gradient entry|")
    bottom.set_ylabel("entries")
    bottom.legend(fontsize=8, loc="center left")
    return _done(fig)


def loss_scale_trajectory(
    runs: Mapping[str, Sequence[float]], skipped: Sequence[bool], initial: float
) -> Figure:
    """The loss scale step by step, with the skipped steps marked.

    Args:
        runs: ``label -> scale after each step`` (several scalers: they should overlap).
        skipped: whether each step was skipped (its gradients held an inf or a NaN).
        initial: the scale before the first step.

    Example:
        >>> fig = loss_scale_trajectory({"a": [4.0, 2.0, 4.0]}, [False, True, False], 2.0)
        >>> len(fig.axes)
        1
    """
    fig, ax = plt.subplots(figsize=(9, 3.4))
    for i, (label, scales) in enumerate(runs.items()):
        ys = [math.log2(initial), *(math.log2(s) for s in scales)]
        ax.step(
            range(len(ys)),
            ys,
            where="post",
            color=COLORS[i % len(COLORS)],
            lw=2.5 if i == 0 else 1.2,
            ls="-" if i == 0 else "--",
            label=label,
        )
    first = next(iter(runs.values()))
    for step, skip in enumerate(skipped):
        if skip:
            ax.axvspan(step, step + 1, color=COLORS[3], alpha=0.15)
            ax.plot(step + 1, math.log2(first[step]), "v", color=COLORS[3])
    ax.plot([], [], "v", color=COLORS[3], label="step skipped (inf/NaN), scale backed off")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("log2(loss scale)")
    ax.set_title("Dynamic loss scaling: back off on overflow, grow after good steps", fontsize=10)
    ax.legend(fontsize=8, loc="best")
    return _done(fig)


def accumulation_timeline(k: int = 4) -> Figure:
    """One optimizer step of ``k`` accumulated micro-batches on a rank, without and with
    ``no_sync``: forward/backward blocks, the all-reduces, the optimizer step.

    Example:
        >>> fig = accumulation_timeline(3)
        >>> len(fig.axes)
        1
    """
    fig, ax = plt.subplots(figsize=(10, 2.9))
    fb, ar, opt = 1.0, 0.6, 0.35
    rows = {"without no_sync": 1.6, "with no_sync": 0.3}
    for label, y in rows.items():
        x = 0.0
        ax.text(-0.15, y + 0.3, label, ha="right", va="center", fontsize=9)
        for i in range(k):
            _box(ax, x, y, fb - 0.05, 0.6, f"fwd+bwd\n{i + 1} (loss/{k})", COLORS[0], fontsize=7)
            x += fb
            if label == "without no_sync" or i == k - 1:
                _box(ax, x, y, ar - 0.05, 0.6, "all-\nreduce", COLORS[3], alpha=0.4, fontsize=7)
                x += ar
        _box(ax, x, y, opt, 0.6, "step", COLORS[2], alpha=0.5, fontsize=7)
        ax.text(
            x + opt + 0.1, y + 0.3, f"{k if y > 1 else 1} all-reduce(s)", va="center", fontsize=8
        )
    ax.set_xlim(-2.2, k * (fb + ar) + 2.0)
    ax.set_ylim(0.1, 2.4)
    ax.axis("off")
    ax.set_title(
        f"Accumulating {k} micro-batches: no_sync keeps the gradients local until the last one",
        fontsize=10,
    )
    return _done(fig)


def amp_step_order() -> Figure:
    """The order of a mixed-precision step with clipping, and the minGPT order that clips the
    scaled gradients.

    Example:
        >>> len(amp_step_order().axes)
        1
    """
    fig, ax = plt.subplots(figsize=(10, 2.9))
    right = [
        ("scaler.scale(loss)\n.backward()", "grads = S x g"),
        ("scaler.unscale_\n(optimizer)", "grads = g,\ninf/NaN found?"),
        ("clip_grad_norm_\n(params, max_norm)", "compares ||g||\nwith max_norm"),
        ("scaler.step\n(optimizer)", "skipped if\ninf/NaN"),
        ("scaler.update()", "back off or\ngrow S"),
    ]
    w, gap = 1.7, 0.35
    for i, (what, note) in enumerate(right):
        x = i * (w + gap)
        _box(ax, x, 1.25, w, 0.7, what, COLORS[2], alpha=0.35, fontsize=8)
        ax.text(x + w / 2, 1.05, note, ha="center", va="top", fontsize=7)
        if i:
            _arrow(ax, (x - gap, 1.6), (x, 1.6))
    wrong = ["scale(loss)\n.backward()", "clip_grad_norm_", "unscale_", "step", "update"]
    for i, what in enumerate(wrong):
        x = i * (w + gap)
        _box(ax, x, -0.15, w, 0.55, what, COLORS[3] if i in (1, 2) else GREY, alpha=0.3, fontsize=8)
        if i:
            _arrow(ax, (x - gap, 0.12), (x, 0.12))
    ax.text(
        1.5 * (w + gap) + w / 2,
        -0.3,
        "clips S x ||g|| against max_norm: the step shrinks by a factor S (the minGPT bug)",
        ha="center",
        va="top",
        fontsize=8,
        color=COLORS[3],
    )
    ax.text(-0.2, 1.6, "right", ha="right", va="center", fontsize=9)
    ax.text(-0.2, 0.12, "wrong", ha="right", va="center", fontsize=9)
    ax.set_xlim(-1.0, 5 * (w + gap))
    ax.set_ylim(-0.75, 2.15)
    ax.axis("off")
    ax.set_title("A mixed-precision step with clipping: unscale before you clip", fontsize=10)
    return _done(fig)


def sharded_norm(sizes: Sequence[int]) -> Figure:
    """Gradients sharded over ranks, and what the global norm asks for: one number, the same
    on every rank of the group, from one collective (which values go in is the exercise).

    Args:
        sizes: how many gradient entries each rank holds (0: none).

    Example:
        >>> len(sharded_norm([5, 0, 3]).axes)
        1
    """
    n = len(sizes)
    fig, ax = plt.subplots(figsize=(9, 0.8 + 0.75 * n))
    total = max(1, sum(sizes))
    start = 0
    for r, size in enumerate(sizes):
        y = n - 1 - r
        ax.text(-0.2, y + 0.3, f"rank {r}", ha="right", va="center", fontsize=9)
        ax.barh(y + 0.3, 5, left=0, height=0.5, color=GREY, alpha=0.12)
        if size:
            ax.barh(
                y + 0.3,
                5 * size / total,
                left=5 * start / total,
                height=0.5,
                color=COLORS[r % len(COLORS)],
                alpha=0.7,
            )
        start += size
        label = f"{size} entries g_i" if size else "holds nothing (still takes part)"
        _arrow(ax, (5.2, y + 0.3), (6.2, (n - 1) / 2 + 0.3), color=COLORS[r % len(COLORS)])
        ax.text(5.3, y + 0.55, label, fontsize=7)
    _box(
        ax,
        6.3,
        (n - 1) / 2,
        3.2,
        0.6,
        "one collective ->\nthe same ||g|| on every rank",
        GREY,
        alpha=0.2,
        fontsize=8,
    )
    ax.set_xlim(-1.2, 9.8)
    ax.set_ylim(-0.3, n + 0.2)
    ax.axis("off")
    ax.set_title(
        "The global norm of sharded gradients: the norm of all entries together", fontsize=10
    )
    return _done(fig)


def precision_runs(
    times: Mapping[str, Mapping[str, float]], losses: Mapping[str, Sequence[float]]
) -> Figure:
    """Measured step times per model and precision, and the loss curves per precision.

    Args:
        times: ``model -> {precision -> seconds per training step}``.
        losses: ``precision -> loss at each step`` (the same model, data and seed).

    Example:
        >>> fig = precision_runs({"mlp": {"fp32": 0.02, "bf16": 0.01}}, {"fp32": [2.3, 2.1]})
        >>> len(fig.axes)
        2
    """
    fig, (bars, curves) = plt.subplots(1, 2, figsize=(10, 3.6))
    models = list(times)
    precisions = list(dict.fromkeys(p for m in models for p in times[m]))
    width = 0.8 / max(1, len(precisions))
    for j, p in enumerate(precisions):
        for i, m in enumerate(models):
            if p not in times[m]:
                continue
            ratio = times[m][p] / times[m][precisions[0]]
            bars.bar(
                i + j * width,
                ratio,
                width,
                color=COLORS[j % len(COLORS)],
                label=p if i == 0 else None,
            )
            bars.text(
                i + j * width,
                ratio,
                f"{times[m][p] * 1e3:.0f} ms",
                ha="center",
                va="bottom",
                fontsize=7,
            )
    bars.axhline(1.0, color=GREY, lw=0.8)
    bars.set_yscale("log")
    ratios = [times[m][p] / times[m][precisions[0]] for m in models for p in times[m]]
    ticks = [2.0**k for k in range(-4, 7) if min(ratios) / 2 <= 2.0**k <= max(ratios) * 2]
    bars.set_yticks(ticks, [f"{t:g}x" for t in ticks])
    bars.minorticks_off()
    bars.set_xticks([i + width * (len(precisions) - 1) / 2 for i in range(len(models))], models)
    bars.set_ylabel(f"step time / {precisions[0]}'s (log scale)")
    bars.set_title("Step time on this machine", fontsize=10)
    bars.legend(fontsize=8)
    for j, (p, ys) in enumerate(losses.items()):
        curves.plot(
            range(1, len(ys) + 1), ys, color=COLORS[j % len(COLORS)], label=p, lw=1.5, alpha=0.9
        )
    curves.set_xlabel("step")
    curves.set_ylabel("training loss")
    curves.set_title("Same model, data and seed: the curves overlap", fontsize=10)
    curves.legend(fontsize=8)
    return _done(fig)


def attention_overflow(rows: Sequence[Mapping[str, float]], fp16_max: float = 65504.0) -> Figure:
    """The largest attention score against the growth of the inputs, and what each
    precision made of the attention's output.

    Args:
        rows: one per scale ``s`` of the block's input: ``{"s", "raw", "score", "fp16_bad",
            "fp16_err", "bf16_err"}``: the largest ``|q . k|`` before the ``1/sqrt(d)``, the
            largest score after it (both float32), the fraction of float16 outputs that are
            not finite, and the relative error of the float16 and bfloat16 outputs against
            float32 (NaN where not finite).
        fp16_max: float16's largest finite number.

    Example:
        >>> rows = [{"s": 1, "raw": 1.4, "score": 0.25, "fp16_bad": 0.0, "fp16_err": 5e-4,
        ...          "bf16_err": 4e-3}, {"s": 256, "raw": 9e4, "score": 1.6e4,
        ...          "fp16_bad": 0.06, "fp16_err": float("nan"), "bf16_err": 0.09}]
        >>> len(attention_overflow(rows).axes)
        2
    """
    fig, (scores, errors) = plt.subplots(1, 2, figsize=(10, 3.6))
    s = [r["s"] for r in rows]
    scores.plot(
        s, [r["raw"] for r in rows], "o-", color=COLORS[1], label="|q . k|, before 1/sqrt(d)"
    )
    scores.plot(s, [r["score"] for r in rows], "o-", color=COLORS[0], label="|score|, after it")
    scores.axhline(fp16_max, color=COLORS[3], ls="--", lw=1, label="float16's largest: 65504")
    broken = [r["s"] for r in rows if r["fp16_bad"] > 0]
    if broken:
        scores.axvspan(min(broken), max(s), color=COLORS[3], alpha=0.08)
        scores.text(min(broken), fp16_max / 300, " float16\n output\n not finite", fontsize=8)
    scores.set_xscale("log", base=2)
    scores.set_yscale("log")
    scores.set_xlabel("scale s of the block's input")
    scores.set_ylabel("largest value (float32)")
    scores.set_title("Attention scores grow as s squared", fontsize=10)
    scores.legend(fontsize=7, loc="upper left")
    for key, label, color in (
        ("fp16_err", "float16", COLORS[3]),
        ("bf16_err", "bfloat16", COLORS[2]),
    ):
        kept = [r for r in rows if math.isfinite(r[key])]  # a NaN error is not drawn
        errors.plot([r["s"] for r in kept], [r[key] for r in kept], "o-", color=color, label=label)
    errors.set_xscale("log", base=2)
    errors.set_yscale("log")
    errors.set_xlabel("scale s of the block's input")
    errors.set_ylabel("relative error of the output")
    errors.set_title("Output against float32", fontsize=10)
    errors.legend(fontsize=8)
    return _done(fig)
