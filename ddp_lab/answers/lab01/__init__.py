"""Lab 1's instructor part: reference answers, the grader's exact checks, typical mistakes.

Not in the student kit (see :mod:`ddp_lab.answers`).
"""

from ddp_lab.answers.lab01.hidden import HIDDEN
from ddp_lab.answers.lab01.mistakes import MISTAKES

__all__ = ["HIDDEN", "MISTAKES"]
