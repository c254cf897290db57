"""Lab 4 (SyncBatchNorm), instructor only: reference answers, the grader's additions, mistakes.

- ``references.py``: synchronised BatchNorm step by step (exercises 1 and 4) and the files
  of exercises 2 and 3;
- ``hidden.py``: ``HIDDEN``, the diagnoses of typical mistakes and the reference files
  exercise 4 builds on;
- ``mistakes.py``: ``MISTAKES``, ``HANGS``, ``HANG_LOSES``.
"""

from ddp_lab.answers.lab04.hidden import HIDDEN
from ddp_lab.answers.lab04.mistakes import HANG_LOSES, HANGS, MISTAKES

__all__ = ["HANGS", "HANG_LOSES", "HIDDEN", "MISTAKES"]
