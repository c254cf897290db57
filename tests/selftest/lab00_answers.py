"""The self-test lab's hidden part: an exact check that the kit's judge does not make.

``add`` must also keep the inputs' dtype (float64): a student who computes in float32 is
within the visible tolerance of the oracle only by luck, and the hidden check says so.
"""

from __future__ import annotations

from ddp_lab.answers import Hidden
from ddp_lab.checks.failure import CheckFailed


def _same_dtype(inputs: dict, outputs: dict) -> None:
    if outputs["sum"].dtype != inputs["a"].dtype:
        raise CheckFailed(
            f"add(a, b) returned {outputs['sum'].dtype}, expected {inputs['a'].dtype}"
        )


HIDDEN = {"test_add": Hidden(check=_same_dtype)}
