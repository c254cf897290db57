"""Lab 3's instructor part: reference answers, the grader's exact checks, typical mistakes.

Not in the student kit (see :mod:`ddp_lab.answers`).
"""

from ddp_lab.answers.lab03.hidden import HIDDEN
from ddp_lab.answers.lab03.mistakes import FORGED_FILES, MISTAKES

__all__ = ["FORGED_FILES", "HIDDEN", "MISTAKES"]
