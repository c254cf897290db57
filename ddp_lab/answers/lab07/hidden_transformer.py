"""What the grader adds to lab 7's judge of the transformer exercise (5).

- ex5: the bytes compared with the reference's formula; a wrong answer matched against
  typical counts (the scores kept beside the weights, the mask left out or counted in the
  model's dtype or per sample, one attention matrix for all heads, LayerNorm's statistics
  left out, the parameters counted), else told how many ``B T C``-sized tensors it counts.
"""

from __future__ import annotations

from ddp_lab.answers.lab07 import references as ref
from ddp_lab.checks.failure import CheckFailed
from ddp_lab.checks.lab07 import ex5_activations as ex5
from ddp_lab.checks.values import number

# --- exercise 5 ---------------------------------------------------------------------------


def activations_check(inputs: dict, outputs: dict) -> None:
    for case, got in zip(inputs["cases"], outputs["results"], strict=True):
        if ex5.case_problem(case, got, ref.activation_bytes(*ex5.args(case))):
            raise CheckFailed(f"activation_bytes for {ex5.describe(case)} differs from the formula")


def _terms(b, t, c, h, e, *, btc=16, att=None, mask=None, stats=4, params=0):
    att = b * h * t * t if att is None else att
    mask = t * t if mask is None else mask
    return e * (btc * b * t * c + att + stats * b * t + params) + mask


_ACTIVATION_TWINS = [
    (
        lambda b, t, c, h, e: _terms(b, t, c, h, e, att=2 * b * h * t * t),
        "the scores before the softmax are not kept: the scaling by a number and masked_fill "
        "save no scores for their backward, softmax saves its output, and the matmul after it "
        "saves that same tensor: one B x H x T x T tensor in all",
    ),
    (
        lambda b, t, c, h, e: _terms(b, t, c, h, e, mask=0),
        "masked_fill keeps its mask for the backward pass (a T x T tensor of bools): "
        "your count leaves it out",
    ),
    (
        lambda b, t, c, h, e: _terms(b, t, c, h, e, mask=e * t * t),
        "the causal mask is a tensor of bools, 1 byte a number, not bytes_per_number",
    ),
    (
        lambda b, t, c, h, e: _terms(b, t, c, h, e, mask=b * t * t),
        "the causal mask is built once per forward pass, T x T, and broadcast over the batch "
        "and the heads: not one per sample",
    ),
    (
        lambda b, t, c, h, e: _terms(b, t, c, h, e, att=b * t * t),
        "every head has its own attention weights: B x H x T x T numbers, not B x T x T",
    ),
    (
        lambda b, t, c, h, e: _terms(b, t, c, h, e, stats=0),
        "a LayerNorm keeps more than its input: its backward needs each token's mean and "
        "1/std too (B x T numbers each, in the model's dtype), in both LayerNorms",
    ),
    (
        lambda b, t, c, h, e: _terms(b, t, c, h, e, params=12 * c * c + 13 * c),
        "the block's parameters are the model's, not activations: count only what the "
        "forward pass computes and keeps",
    ),
]


def _btc_count(case: dict, got: float) -> int | None:
    """``k`` when ``got`` is the right count with ``k B T C`` numbers instead of 16."""
    b, t, c, h, e = ex5.args(case)
    rest = got - _terms(b, t, c, h, e, btc=0)
    k = rest / (e * b * t * c)
    return int(k) if k == int(k) and 0 <= k <= 64 else None


def activations_explain(inputs: dict, outputs: dict) -> str | None:
    results = outputs.get("results")
    if not isinstance(results, list) or len(results) != len(inputs["cases"]):
        return None
    wrong = [
        (case, got)
        for case, got in zip(inputs["cases"], results, strict=True)
        if ex5.case_problem(case, got, ex5.oracle(case))
    ]
    if not wrong or any(isinstance(got, str) for _, got in wrong):
        return None
    case, got = wrong[0]
    what = f"activation_bytes for a block of {ex5.describe(case)}"
    for twin, why in _ACTIVATION_TWINS:
        if all(number(g) == twin(*ex5.args(c)) for c, g in wrong):
            return f"{what}: {why}"
    counts = {_btc_count(c, number(g)) for c, g in wrong}
    if len(counts) == 1 and (k := counts.pop()) is not None:
        return (
            f"{what}: everything but the tensors of B x T x C numbers (or 4C wide) is right; "
            f"those add up to {k} B T C numbers in your count, and the block keeps 16 B T C: "
            "go through its forward operation by operation (a view saves nothing, an "
            "operation may keep a copy of its input, two operations may keep one tensor)"
        )
    return None
