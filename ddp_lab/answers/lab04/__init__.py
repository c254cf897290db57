"""Lab 4 (SyncBatchNorm), instructor only: reference answers, the grader's additions, mistakes.

- ``references.py``: the three exercises' files (``sync_stats.py``, ``sync_grad.py``,
  ``sync_bn.py``) and the pieces the tests use to simulate every rank in one process;
- ``hidden.py``: ``HIDDEN``, the diagnoses of typical mistakes and the reference files
  exercise 3 builds on;
- ``mistakes.py``: ``MISTAKES``, ``HANGS``, ``HANG_LOSES``.
"""

from ddp_lab.answers.lab04.hidden import HIDDEN
from ddp_lab.answers.lab04.mistakes import HANG_LOSES, HANGS, MISTAKES

__all__ = ["HANGS", "HANG_LOSES", "HIDDEN", "MISTAKES"]
