"""Lab 7's tensor-parallel mistake that assumes a bias: a ``RowParallelLinear`` whose forward
adds ``self.bias`` whatever it is, right on every layer with a bias, a ``TypeError`` on the
grading run's row layer without one (``self.bias`` None), on every rank of its group alike.

Inserted into ``MISTAKES`` by ``mistakes.py`` as exercise 4's second mistake (after the
sample class's): a wrong answer that raises gives no outputs to judge, so it goes through
the grader in ``tests/test_mistakes.py``; ``tests/test_lab07.py`` runs it on torchrun too.
"""

from __future__ import annotations

from ddp_lab.answers import Mistake
from ddp_lab.answers.lab07.references import FILES

_RIGHT = "        return y if self.bias is None else y + self.bias\n"
_WRONG = "        return y + self.bias  # the bias once, after the sum: but is there one?\n"
assert FILES["tp.py"].count(_RIGHT) == 1, "the reference's row layer changed: rewrite this"
_ASSUMES_BIAS = "%%writefile tp.py\n" + FILES["tp.py"].replace(_RIGHT, _WRONG)

TP_MISTAKES = [
    Mistake(
        "ex4_tensor_parallel",
        "row_assumes_bias",  # right with a bias; raises on the row layer without one
        _ASSUMES_BIAS,
        "built from an nn.Linear without a bias",
    ),
]
