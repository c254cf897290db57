"""Exercise 1, ``fp16_report(grads)``: what float16 (and bfloat16) do to a model's gradients.

Given float32 gradients, the student reports the share of nonzero entries that become 0
in float16 at loss scale 1, the largest power-of-two loss scale under which no entry becomes
inf in float16, the share that still becomes 0 at that scale, and the share that becomes 0
in bfloat16.

The judge's oracle does not cast anything: it derives the rounding thresholds of each format
from ``torch.finfo`` (round to nearest, ties to even) and compares magnitudes with them:

- a value becomes 0 when ``|x| <= smallest subnormal / 2`` (``smallest_normal * eps / 2``:
  ``2**-25`` in float16, ``2**-134`` in bfloat16);
- a value becomes inf in float16 when ``|x| >= max + ulp / 2`` (65504 + 16 = 65520), where
  ``ulp`` is the spacing of the top binade (``eps * 2**15``).

The case set holds gradients of a real backward pass (a small MLP with ReLU, so some entries
are exactly 0, and a parameter with an all-zero gradient), large gradients (the largest scale
is below 1), and values placed at the thresholds: ``2**-25`` and ``2**-134`` (rounded to 0),
their neighbours just above (kept), and a largest magnitude that lands in (65504, 65520) at
the answer's scale (finite: a comparison with ``finfo.max`` gives a scale half as large);
and tiny gradients, all below ``65520 * 2**-128`` (about 1.9e-34), many of them float32
subnormals: their largest safe scale is above ``2**127``, beyond float32's range (a search
that multiplies float32 tensors by ``2.0**k`` meets inf at ``k = 128`` and stops at
``2**127``), and those at or below ``2**-134`` become 0 in bfloat16 although float32 holds
them.

Every value of the report must be a Python ``float``, as the docstring promises (checked
once the values are right: a 0-d tensor, or an ``int`` from ``2**k``, loses the exercise).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

from ddp_lab.checks.contract import Exercise
from ddp_lab.checks.failure import CheckFailed
from ddp_lab.checks.values import kind, log_uniform, number, plain, randint

#: The keys of a report, in the order the docstring lists them.
KEYS = ("underflow", "max_scale", "underflow_at_max_scale", "bf16_underflow")
#: Shares are ratios of counts: compared to this absolute tolerance (float32 arithmetic).
SHARE_ATOL = 1e-6


def zero_threshold(dtype: torch.dtype) -> float:
    """The largest magnitude that rounds to 0 in ``dtype``: half its smallest subnormal.

    Example:
        >>> zero_threshold(torch.float16) == 2.0**-25
        True
    """
    info = torch.finfo(dtype)
    return info.smallest_normal * info.eps / 2


def inf_threshold(dtype: torch.dtype) -> float:
    """The smallest magnitude that rounds to inf in ``dtype``: its max plus half an ulp.

    Example:
        >>> inf_threshold(torch.float16)
        65520.0
    """
    info = torch.finfo(dtype)
    top_binade = 2.0 ** math.floor(math.log2(info.max))
    return info.max + info.eps * top_binade / 2


def oracle(grads: list[torch.Tensor]) -> dict[str, float]:
    """The report, from the thresholds (float64 arithmetic on the float32 values)."""
    flat = torch.cat([g.reshape(-1).double() for g in grads])
    mags = flat[flat != 0].abs()
    n = mags.numel()
    z16, inf16 = zero_threshold(torch.float16), inf_threshold(torch.float16)
    top = float(mags.max())
    k = math.floor(math.log2(inf16 / top))
    while top * 2.0**k >= inf16:
        k -= 1
    while top * 2.0 ** (k + 1) < inf16:
        k += 1
    scale = 2.0**k
    return {
        "underflow": int((mags <= z16).sum()) / n,
        "max_scale": scale,
        "underflow_at_max_scale": int((mags * scale <= z16).sum()) / n,
        "bf16_underflow": int((mags <= zero_threshold(torch.bfloat16)).sum()) / n,
    }


def _backward_case(gen: torch.Generator, widths: tuple[int, int, int], batch: int) -> list:
    """Gradients of one backward pass of an MLP with ReLU, its loss multiplied by a small
    factor (a late, well-trained phase: small losses, small gradients), plus an unused
    layer whose gradient is all zeros."""
    d, h, c = widths
    model = nn.Sequential(nn.Linear(d, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, c))
    with torch.no_grad():
        for p in model.parameters():  # weights from the case's generator, not torch's seed
            fan_in = p.shape[-1] if p.dim() > 1 else h
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(fan_in))
    x = torch.randn(batch, d, generator=gen)
    y = torch.randint(0, c, (batch,), generator=gen)
    factor = log_uniform(gen, 2.0**-22, 2.0**-15)
    (nn.functional.cross_entropy(model(x), y) * factor).backward()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    grads.append(torch.zeros(c, h))  # a layer that received no gradient this step
    return grads


def _large_case(gen: torch.Generator) -> list:
    """Gradients up to 2**16 .. 2**19 (the largest scale is below 1), some tiny ones."""
    big = torch.randn(randint(gen, 20, 60), generator=gen) * 2.0 ** randint(gen, 16, 19)
    tiny = torch.randn(randint(gen, 10, 40), generator=gen) * 2.0 ** -randint(gen, 26, 30)
    mid = torch.randn(randint(gen, 10, 40), generator=gen)
    return [big, torch.cat([tiny, mid])]


def _edges_case(gen: torch.Generator) -> list:
    """Values at the rounding thresholds, and a largest magnitude that lands in
    (65504, 65520) at the largest scale (2**j)."""
    j = randint(gen, 3, 12)
    z16, z_bf16 = zero_threshold(torch.float16), zero_threshold(torch.bfloat16)
    edges = [z16, -z16, z16 * (1 + 2.0**-10), 2 * z16, z_bf16, z_bf16 * 2, -z_bf16 * 1.01]
    top = (65504 + 1 + 14 * float(torch.rand(1, generator=gen))) * 2.0**-j
    body = torch.randn(20, generator=gen) * 2.0 ** -randint(gen, 12, 20)
    return [torch.tensor(edges, dtype=torch.float32), torch.cat([body, torch.tensor([-top])])]


def _tiny_case(gen: torch.Generator) -> list:
    """Magnitudes from just below ``2**-113`` down to float32's subnormals (``2**-148``),
    with ``2**-134`` (0 in bfloat16) and ``2**-133`` (bfloat16's smallest subnormal, kept):
    the largest safe scale is ``2**129`` or more."""
    top = randint(gen, 114, 125)
    n = randint(gen, 20, 40)
    exps = top + (148 - top) * torch.rand(n, generator=gen, dtype=torch.float64)
    signs = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0).double()
    body = (signs * torch.exp2(-exps)).float()
    edges = torch.tensor([2.0**-134, -(2.0**-133), 2.0**-top], dtype=torch.float32)
    return [body, edges]


def make_inputs(gen: torch.Generator) -> dict:
    """Four cases: a real backward pass (underflow between 5 % and 95 %), large gradients
    (scale below 1), values at the thresholds, tiny gradients (scale above ``2**127``)."""
    while True:
        backward = _backward_case(gen, (randint(gen, 6, 12), randint(gen, 8, 24), 4), 16)
        share = oracle(backward)["underflow"]
        if 0.05 < share < 0.95:
            break
    return {"cases": [backward, _large_case(gen), _edges_case(gen), _tiny_case(gen)]}


def visible_inputs(gen: torch.Generator) -> dict:
    """A smaller backward pass, the threshold values and tiny gradients."""
    return {"cases": [_backward_case(gen, (6, 8, 3), 8), _edges_case(gen), _tiny_case(gen)]}


def run(ns: dict, inputs: dict, workdir: Path | None) -> dict:
    """The student's report of every case (on copies of the gradients)."""
    fn = ns["fp16_report"]
    return {"reports": [plain(fn([g.clone() for g in grads])) for grads in inputs["cases"]]}


def describe(grads: list[torch.Tensor]) -> str:
    """How feedback names a case."""
    flat = torch.cat([g.reshape(-1) for g in grads])
    nz = flat[flat != 0].abs()
    return (
        f"{len(grads)} gradient tensors, {nz.numel()} nonzero entries of magnitude "
        f"{float(nz.min()):.3g} .. {float(nz.max()):.3g}"
    )


def check_report(grads: list[torch.Tensor], got) -> None:
    """Raise :class:`CheckFailed` unless ``got`` is the oracle's report of ``grads``."""
    what = f"fp16_report on {describe(grads)}"
    if not isinstance(got, dict) or set(KEYS) - set(got):
        missing = sorted(set(KEYS) - set(got)) if isinstance(got, dict) else list(KEYS)
        raise CheckFailed(f"{what}: expected a dict with keys {list(KEYS)}; missing {missing}")
    want = oracle(grads)
    scale = number(got["max_scale"])
    if scale != want["max_scale"]:
        if scale > 0 and math.isfinite(scale) and math.log2(scale) != round(math.log2(scale)):
            raise CheckFailed(
                f"{what}: max_scale {scale:g} is not a power of two; loss scales are powers of "
                "two (multiplying by them is exact)"
            )
        raise CheckFailed(
            f"{what}: max_scale should be {want['max_scale']:g} "
            f"(2**{math.log2(want['max_scale']):g}), got {scale:g}: the largest |g| times the "
            "scale must stay finite when cast to float16, and twice that scale must not"
        )
    for key, words in (
        ("underflow", "the share of nonzero entries that become 0 in float16 at scale 1"),
        ("underflow_at_max_scale", f"the share that still becomes 0 at scale {scale:g}"),
        ("bf16_underflow", "the share of nonzero entries that become 0 in bfloat16"),
    ):
        value = number(got[key])
        if not abs(value - want[key]) <= SHARE_ATOL:
            raise CheckFailed(
                f"{what}: {key} ({words}) should be {want[key]:.6f}, got "
                f"{value if value == value else kind(got[key])}"
            )
    for key in KEYS:  # right values: now the types the docstring promises
        if not isinstance(got[key], float):
            raise CheckFailed(
                f"{what}: {key} has the right value but is {kind(got[key])}; the docstring "
                "promises Python floats (a tensor's .item(), float(...), 2.0**k)"
            )


def judge(inputs: dict, outputs: dict) -> str:
    """Every case's report against the threshold oracle."""
    reports = outputs.get("reports")
    if not isinstance(reports, list) or len(reports) != len(inputs["cases"]):
        raise CheckFailed("fp16_report: expected one report per case")
    for grads, got in zip(inputs["cases"], reports, strict=True):
        check_report(grads, got)
    shares = ", ".join(f"{oracle(g)['underflow']:.1%}" for g in inputs["cases"])
    return (
        f"fp16_report is right on {len(reports)} sets of gradients (float16 underflow at "
        f"scale 1: {shares})"
    )


EXERCISE = Exercise(
    "test_ex1_fp16_report",
    ("ex1_fp16_report",),
    "float16 underflow and the largest safe loss scale",
    make_inputs,
    judge,
    run=run,
    timeout=60,
    visible_inputs=visible_inputs,
)
