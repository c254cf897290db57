"""Units of the grading pipeline: cell parsing, the output rewrite nbgrader scores."""

from __future__ import annotations

import pytest
from nbformat import NotebookNode
from nbgrader.utils import determine_grade

from ddp_lab.checks.contract import Exercise
from ddp_lab.grading.notebook import split_magics
from ddp_lab.grading.preprocessor import rewrite_outputs


def test_writefile_cells_become_files_and_magics_are_blanked():
    assert split_magics("%%writefile a.py\nx = 1\n") == ("", {"a.py": "x = 1\n"})
    code, files = split_magics("%time y = 2\n!ls\nz = 3")
    assert files == {} and code == "\n\nz = 3"


def _test_cell(outputs):
    return NotebookNode(
        cell_type="code",
        source="",
        outputs=outputs,
        metadata=NotebookNode(
            nbgrader=NotebookNode(grade=True, solution=False, points=3, grade_id="t")
        ),
    )


@pytest.mark.parametrize(
    "kernel_outputs",
    [
        [],
        [NotebookNode(output_type="error", ename="CheckFailed", evalue="x", traceback=[])],
        [NotebookNode(output_type="stream", name="stderr", text="warning\n")],
        [
            NotebookNode(
                output_type="execute_result",
                data={"text/plain": "0.0"},
                metadata={},
                execution_count=1,
            )
        ],
    ],
)
def test_points_follow_the_verdict_not_the_kernel(kernel_outputs):
    for passed, points in ((True, 3.0), (False, 0.0)):
        cell = _test_cell([NotebookNode(o) for o in kernel_outputs])
        rewrite_outputs(cell, passed, "because")
        assert determine_grade(cell)[0] == points
        assert "because" in str(cell.outputs[-1])


def test_exercise_needs_exactly_one_runner():
    with pytest.raises(ValueError):
        Exercise("t", ("c",), "x", lambda g: {}, lambda i, o: "")
