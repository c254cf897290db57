"""Typical student mistakes, collected from ``tests/mistakes_labNN.py`` (one file per lab).

Each ``mistakes_labNN.py`` defines

- ``LAB``: the lab's name, e.g. ``"lab01_data_parallel"``;
- ``MISTAKES``: ``{solution cell grade_id: wrong source}``, one typical wrong answer for
  *every* exercise; all of them replace the release's cells at once, so each must cost
  exactly its own exercise's points (the exercises of a lab are independent);
- ``HANGS`` (optional): ``{solution cell grade_id: source}`` whose torchrun job deadlocks,
  put into the solutions; ``HANG_LOSES``: the test cells that hang costs;
- ``FORGED_FILES`` (optional): ``{filename: text}`` result files a cheater writes by hand.
"""

from __future__ import annotations

import importlib
from pathlib import Path

MISTAKES: dict[str, dict[str, str]] = {}
HANGS: dict[str, dict[str, str]] = {}
HANG_LOSES: dict[str, list[str]] = {}
FORGED_FILES: dict[str, dict[str, str]] = {}

for _path in sorted(Path(__file__).parent.glob("mistakes_lab*.py")):
    _mod = importlib.import_module(_path.stem)
    MISTAKES[_mod.LAB] = _mod.MISTAKES
    if getattr(_mod, "HANGS", None):
        HANGS[_mod.LAB] = _mod.HANGS
        HANG_LOSES[_mod.LAB] = list(_mod.HANG_LOSES)
    FORGED_FILES[_mod.LAB] = dict(getattr(_mod, "FORGED_FILES", {}))
