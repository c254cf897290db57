"""Typical wrong answers of lab 7's exercise 5, ``activation_bytes``: counts that leave out,
double or misplace one kind of tensor a transformer block keeps, the parameters counted as
activations, and a function that builds a block and measures it (refused: no formula).
All are judged in one process (``tests/test_mistakes.py``, ``tests/test_lab07.py``).
"""

from __future__ import annotations

from ddp_lab.answers import Mistake

_ACT = """
def activation_bytes(batch, seq, width, heads, bytes_per_number):
    b, t, c, h, e = batch, seq, width, heads, bytes_per_number
    tensors = {btc} * b * t * c      # the block's (B, T, C)-sized tensors, the MLP's at 4C
    weights = {att}              # attention weights
    stats = {stats}                 # LayerNorm means and 1/std
    mask = {mask}                   # the causal mask
    return e * (tensors + weights + stats{params}) + mask
"""


def _act(btc=16, att="b * h * t * t", stats="4 * b * t", mask="t * t", params=""):
    return _ACT.format(btc=btc, att=att, stats=stats, mask=mask, params=params)


ACTIVATION_MISTAKES = [
    Mistake(
        "ex5_activations",
        "scores_and_weights",  # the scores before the softmax counted as well
        _act(att="2 * b * h * t * t"),
        "the scores before the softmax are not kept",
    ),
    Mistake("ex5_activations", "no_mask", _act(mask="0"), "masked_fill keeps its mask"),
    Mistake("ex5_activations", "mask_in_dtype", _act(mask="e * t * t"), "1 byte a number"),
    Mistake("ex5_activations", "mask_per_sample", _act(mask="b * t * t"), "not one per sample"),
    Mistake("ex5_activations", "one_matrix", _act(att="b * t * t"), "every head has its own"),
    Mistake("ex5_activations", "no_ln_stats", _act(stats="0"), "mean and 1/std"),
    Mistake(
        "ex5_activations",
        "parameters_counted",
        _act(params=" + 12 * c * c + 13 * c"),
        "not activations",
    ),
    Mistake(  # q, k and v counted once each (their copies for the matmuls missed)
        "ex5_activations", "no_head_copies", _act(btc=13), "add up to 13 B T C numbers"
    ),
    Mistake(  # the MLP's hidden tensors counted at width C
        "ex5_activations", "mlp_at_width", _act(btc=10), "add up to 10 B T C numbers"
    ),
    Mistake(
        "ex5_activations",
        "measures_a_block",  # builds the block and measures it: no formula
        """
import torch
from ddp_lab.gpt import Block, GPTConfig
from ddp_lab.parallel.memory import saved_bytes


def activation_bytes(batch, seq, width, heads, bytes_per_number):
    dtype = {4: torch.float32, 8: torch.float64}[bytes_per_number]
    with torch.device("meta"):
        block = Block(GPTConfig(seq_len=seq, width=width, heads=heads, layers=1)).to(dtype)
        x = torch.randn(batch, seq, width, dtype=dtype, requires_grad=True)
    return saved_bytes(block, x)
""",
        "must compute the bytes from the five sizes",
    ),
]
