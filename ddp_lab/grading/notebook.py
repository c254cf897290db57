"""Reading graded notebooks: nbgrader cell metadata, solution sources, cell magics.

Graders never trust what a student's kernel did or wrote to disk. They take the *source*
of the solution cells from the notebook file, by their nbgrader ``grade_id``, and rebuild
everything else from it in a fresh process. This module does the reading.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path

WRITEFILE = re.compile(r"^%%writefile(?:\s+-a)?\s+(\S+)\s*$")


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


def split_magics(source: str) -> tuple[str, dict[str, str]]:
    """Turn a cell's source into plain Python, plus the files it would write.

    A cell that starts with ``%%writefile NAME`` is a file, not code. Other IPython lines
    (``%time``, ``!ls``) are blanked, keeping line numbers for error messages.

    Returns:
        ``(code, files)``: the Python code and a ``{filename: text}`` map.

    Example:
        >>> split_magics("%%writefile w.py\\nprint(1)\\n")
        ('', {'w.py': 'print(1)\\n'})
        >>> split_magics("%matplotlib inline\\nx = 1")
        ('\\nx = 1', {})
    """
    lines = source.split("\n")
    if lines and (m := WRITEFILE.match(lines[0].strip())):
        return "", {m.group(1): "\n".join(lines[1:])}
    code = ["" if line.lstrip().startswith(("%", "!")) else line for line in lines]
    return "\n".join(code), {}
