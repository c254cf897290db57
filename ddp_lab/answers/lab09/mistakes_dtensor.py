"""Typical wrong answers of lab 9's exercise 3, ``parallelize_block`` in ``tp_plan.py``: the
plain plan (right numbers, 4 all-reduces in the backward pass), a block left whole (right
numbers, no communication, nothing split), and the MLP's output left a DTensor (the
residual sum then mixes a tensor and a DTensor: PyTorch's error, quoted by the grader).

The first two are in ``MISTAKES`` (the grader's rounds, ``tests/test_mistakes.py``), the
third in ``MORE_MISTAKES`` (``tests/test_lab09.py``, on the grader's path).
"""

from __future__ import annotations

from ddp_lab.answers import Mistake
from ddp_lab.answers.lab09.references import PLAN_SOURCE

_ONCE = """    once = PrepareModuleInput(
        input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),), use_local_output=False
    )
"""


def _cell(source: str) -> str:
    return "%%writefile tp_plan.py\n" + source


_PLAIN = PLAN_SOURCE.replace(_ONCE, "").replace('        "attn": once,\n', "")
assert _PLAIN != PLAN_SOURCE and "once" not in _PLAIN

DTENSOR_MISTAKES = [
    Mistake(
        "ex3_dtensor_block",
        "plain_plan",  # each of q, k, v all-reduces its input's gradient on its own
        _cell(_PLAIN),
        "three where one would do",
    ),
    Mistake(
        "ex3_dtensor_block",
        "left_whole",  # right numbers without splitting anything
        _cell("def parallelize_block(block, mesh):\n    return block\n"),
        "should be a DTensor of which each rank holds",
    ),
    Mistake(
        "ex3_dtensor_block",
        "dtensor_output",  # the last layer hands on a DTensor
        _cell(
            PLAN_SOURCE.replace(
                '"mlp.proj": RowwiseParallel()',
                '"mlp.proj": RowwiseParallel(use_local_output=False)',
            )
        ),
        "got mixed torch.Tensor and DTensor",
    ),
]
