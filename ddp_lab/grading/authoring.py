"""Writing graded notebooks from Python, with stable cell ids and nbgrader metadata.

Instructors may edit ``solutions/`` in JupyterLab with nbgrader's "Create Assignment"
toolbar; lab authors can also build a notebook from a script::

    from ddp_lab.grading.authoring import md, code, solution, test, write_notebook
    write_notebook("solutions/lab01_data_parallel/lab01_data_parallel.ipynb", [
        md("intro", "# Lab 1 ..."),
        solution("ex1_split_batch", "def split_batch(...):\\n    ### BEGIN SOLUTION\\n..."),
        test("test_ex1_split_batch", "checks.split_batch(split_batch)", points=2),
    ])

Every cell gets ``id`` = its name, so diffs stay readable, and :func:`clean` strips outputs,
execution counts and volatile metadata (a test keeps the committed notebooks that way).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}


def _meta(name: str, *, solution: bool, grade: bool, locked: bool, points: float | None):
    meta = {
        "grade": grade,
        "grade_id": name,
        "locked": locked,
        "schema_version": 3,
        "solution": solution,
        "task": False,
    }
    if points is not None:
        meta["points"] = points
    return {"nbgrader": meta}


def md(name: str, text: str) -> dict:
    """A locked markdown cell (students read it; nbgrader restores it if edited)."""
    return {
        "cell_type": "markdown",
        "id": name,
        "source": text.strip("\n"),
        "metadata": _meta(name, solution=False, grade=False, locked=True, points=None),
    }


def code(name: str, text: str, locked: bool = True) -> dict:
    """A code cell students run but do not edit (set-up, demos, plots)."""
    return {
        "cell_type": "code",
        "id": name,
        "source": text.strip("\n"),
        "metadata": _meta(name, solution=False, grade=False, locked=locked, points=None),
        "execution_count": None,
        "outputs": [],
    }


def free(name: str, text: str = "") -> dict:
    """A plain code cell without nbgrader metadata (a scratch cell for the student)."""
    return {
        "cell_type": "code",
        "id": name,
        "source": text.strip("\n"),
        "metadata": {},
        "execution_count": None,
        "outputs": [],
    }


def solution(name: str, text: str) -> dict:
    """A cell the student completes; the part between ``### BEGIN/END SOLUTION`` is theirs."""
    cell = code(name, text, locked=False)
    cell["metadata"] = _meta(name, solution=True, grade=False, locked=False, points=None)
    return cell


def test(name: str, text: str, points: float) -> dict:
    """A locked, autograded test cell worth ``points`` (hidden part between the markers)."""
    cell = code(name, text)
    cell["metadata"] = _meta(name, solution=False, grade=True, locked=True, points=points)
    return cell


def written(name: str, question_id: str, answer: str, points: float) -> dict:
    """A manually graded written answer ("predict, then explain"): a markdown cell the
    student writes in, worth ``points``. Put the model answer and the rubric between
    ``### BEGIN SOLUTION`` and ``### END SOLUTION`` (the release keeps only "YOUR ANSWER
    HERE"); the question itself goes into the markdown cell ``question_id`` before it.

    Example:
        >>> written("ex1_why", "q_ex1_why", "### BEGIN SOLUTION\\nBecause ...\\n"
        ...         "### END SOLUTION", 1)["metadata"]["nbgrader"]["points"]
        1
    """
    cell = md(name, answer)
    cell["metadata"] = _meta(name, solution=True, grade=True, locked=False, points=points)
    return cell


def notebook(cells: list[dict]) -> dict:
    """A notebook (nbformat 4.5) of ``cells``."""
    return {
        "cells": cells,
        "metadata": {"kernelspec": KERNELSPEC, "language_info": {"name": "python"}},
        "nbformat": 4,
        "nbformat_minor": 5,
    }


def clean(nb: Mapping) -> dict:
    """The notebook without outputs, execution counts or volatile metadata."""
    out = json.loads(json.dumps(nb))
    for cell in out["cells"]:
        if cell["cell_type"] == "code":
            cell["outputs"] = []
            cell["execution_count"] = None
        for key in ("collapsed", "scrolled", "execution", "jupyter"):
            cell.get("metadata", {}).pop(key, None)
        if isinstance(cell.get("source"), list):
            cell["source"] = "".join(cell["source"])
    out["metadata"] = {"kernelspec": KERNELSPEC, "language_info": {"name": "python"}}
    return out


def dumps(nb: Mapping) -> str:
    """Serialise exactly as Jupyter and nbgrader do (``nbformat.writes``)."""
    import nbformat

    return nbformat.writes(nbformat.from_dict(json.loads(json.dumps(nb))))


def write_notebook(path: str | Path, cells: list[dict]) -> None:
    """Write a clean notebook of ``cells`` to ``path`` (folders created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dumps(clean(notebook(cells))))
