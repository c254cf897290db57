"""Lab 9 (PyTorch's distributed stack), instructor only: reference answers, the grader's
additions, mistakes.

- ``references.py``: every exercise's reference (and the three ``%%writefile`` files);
- ``hidden.py``: ``HIDDEN``, exact comparisons and named diagnoses of typical mistakes;
- ``mistakes.py``: ``MISTAKES`` (the first of each exercise being the sample class's) and
  ``MORE_MISTAKES``.

Not in the student kit (see :mod:`ddp_lab.answers`).
"""

from ddp_lab.answers.lab09.hidden import HIDDEN
from ddp_lab.answers.lab09.mistakes import MISTAKES, MORE_MISTAKES

__all__ = ["HIDDEN", "MISTAKES", "MORE_MISTAKES"]
