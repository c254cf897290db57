"""Lab 8's notebook is built from Python (``ddp_lab.answers.lab08.notebook``): the committed
source notebook is exactly what its modules build, so the two cannot drift apart."""

from __future__ import annotations

from ddp_lab.answers.lab08 import notebook
from ddp_lab.grading.authoring import clean, dumps
from ddp_lab.grading.authoring import notebook as as_notebook


def test_the_committed_notebook_is_what_its_modules_build():
    built = dumps(clean(as_notebook(notebook.cells())))
    assert notebook.PATH.read_text() == built, (
        "solutions/lab08_profiling/lab08_profiling.ipynb differs from ddp_lab.answers.lab08: "
        "edit the modules, then run python -m ddp_lab.answers.lab08.notebook and make release"
    )


def test_the_points_add_up_to_20_with_three_written_answers():
    cells = notebook.cells()
    points = [c["metadata"]["nbgrader"].get("points", 0) for c in cells]
    written = [
        c for c in cells if c["cell_type"] == "markdown" and c["metadata"]["nbgrader"]["grade"]
    ]
    assert sum(points) == 20 and len(written) == 3
    assert sum(c["metadata"]["nbgrader"]["points"] for c in written) == 6
