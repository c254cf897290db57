"""Reading graded notebooks: nbgrader cell metadata, solution sources, cell magics.

Graders never trust what a student's kernel did or wrote to disk. They take the *source*
of the solution cells from the notebook file, by their nbgrader ``grade_id``, and rebuild
everything else from it in a fresh process. This module does the reading.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from ddp_lab.checks.runner import split_magics

__all__ = [
    "is_solution",
    "is_test",
    "is_written",
    "load",
    "nbgrader_meta",
    "solution_sources",
    "source_of",
    "split_magics",
]


def nbgrader_meta(cell: Mapping) -> dict:
    """The ``nbgrader`` metadata of a cell (``{}`` when the cell has none)."""
    return dict(cell.get("metadata", {}).get("nbgrader", {}) or {})


def is_solution(cell: Mapping) -> bool:
    """True for a cell the student writes (``solution: true``)."""
    return bool(nbgrader_meta(cell).get("solution"))


def is_test(cell: Mapping) -> bool:
    """True for an autograded test cell (``grade: true`` on a code cell that is no solution)."""
    meta = nbgrader_meta(cell)
    return bool(meta.get("grade")) and not meta.get("solution") and cell["cell_type"] == "code"


def is_written(cell: Mapping) -> bool:
    """True for a manually graded written answer (a markdown cell with ``grade`` and
    ``solution``): no verdict, an instructor grades it by hand."""
    meta = nbgrader_meta(cell)
    return (
        bool(meta.get("grade")) and bool(meta.get("solution")) and cell["cell_type"] == "markdown"
    )


def source_of(cell: Mapping) -> str:
    """A cell's source as one string (notebook files may store a list of lines)."""
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def load(path: str | Path) -> dict:
    """A notebook file as plain JSON (no nbformat validation: submissions may be odd)."""
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def solution_sources(nb: Mapping) -> dict[str, str]:
    """``grade_id -> source`` of every solution cell of ``nb`` (a dict or NotebookNode)."""
    out = {}
    for cell in nb["cells"]:
        if is_solution(cell) and cell["cell_type"] == "code":
            out[nbgrader_meta(cell)["grade_id"]] = source_of(cell)
    return out
