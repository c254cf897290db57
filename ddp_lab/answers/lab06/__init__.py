"""Lab 6 (checkpoints, elastic restarts and faults), instructor only: reference answers, the
grader's additions, mistakes.

- ``references.py``: every exercise's reference (and the two ``%%writefile`` files);
- ``hidden.py``: ``HIDDEN``, exact comparisons and named diagnoses of typical mistakes;
- ``mistakes.py``: ``MISTAKES`` (the first of each exercise being the sample class's) and
  ``MORE_MISTAKES``.

Not in the student kit (see :mod:`ddp_lab.answers`).
"""

from ddp_lab.answers.lab06.hidden import HIDDEN
from ddp_lab.answers.lab06.mistakes import MISTAKES, MORE_MISTAKES

__all__ = ["HIDDEN", "MISTAKES", "MORE_MISTAKES"]
