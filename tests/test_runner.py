"""The visible-check runner (ddp_lab.checks.runner): the same inputs -> run -> judge path as
the grader, on small fixed inputs, with friendly messages for unfinished exercises."""

from __future__ import annotations

import pytest
from selftest import lab00
from selftest.students import RANK_SUM_FILE

from ddp_lab.checks import runner
from ddp_lab.checks.failure import CheckFailed


def test_visible_check_in_process_passes_and_fails_like_the_judge(capsys):
    lab00.add(lambda a, b: a + b)
    assert capsys.readouterr().out.startswith("OK: add is right")
    with pytest.raises(CheckFailed, match="max abs difference"):
        lab00.add(lambda a, b: a - b)


def test_visible_check_of_a_stub_says_finish_the_exercise_first():
    def add(a, b):
        raise NotImplementedError()

    with pytest.raises(CheckFailed, match="finish this exercise first"):
        lab00.add(add)


def test_visible_check_reports_the_students_error_in_one_line():
    with pytest.raises(CheckFailed, match="your code raised ZeroDivisionError"):
        lab00.add(lambda a, b: 1 / 0)


@pytest.mark.timeout(120)
def test_visible_distributed_check_runs_the_file_on_every_rank(tmp_path, capsys):
    (tmp_path / "rank_sum.py").write_text(RANK_SUM_FILE)
    lab00.rank_sum(str(tmp_path / "rank_sum.py"))
    assert "OK: rank_sum equals the sum" in capsys.readouterr().out
    (tmp_path / "rank_sum.py").write_text(
        "import torch.distributed as dist\ndef rank_sum(t):\n    dist.all_reduce(t)\n"
    )
    with pytest.raises(CheckFailed, match="all_reduce is not allowed"):
        lab00.rank_sum(str(tmp_path / "rank_sum.py"))


def test_visible_distributed_check_refuses_a_stub_or_missing_file_without_starting(tmp_path):
    with pytest.raises(CheckFailed, match="not found"):
        lab00.rank_sum(str(tmp_path / "rank_sum.py"))
    (tmp_path / "rank_sum.py").write_text("def rank_sum(t):\n    raise NotImplementedError()\n")
    with pytest.raises(CheckFailed, match="finish this exercise first"):
        lab00.rank_sum(str(tmp_path / "rank_sum.py"))


def test_visible_distributed_check_defers_to_the_grader_under_autograde(monkeypatch, capsys):
    monkeypatch.setenv("NBGRADER_EXECUTION", "autograde")
    lab00.rank_sum("does-not-exist/rank_sum.py")
    assert "run by the grader" in capsys.readouterr().out


def test_split_magics_turns_writefile_cells_into_files():
    assert runner.split_magics("%%writefile w.py\nprint(1)\n") == ("", {"w.py": "print(1)\n"})
    assert runner.split_magics("%time x = 1\ny = 2") == ("\ny = 2", {})


@pytest.mark.timeout(120)
def test_a_check_in_a_notebook_shows_one_readable_message_and_no_value():
    """In a real kernel: a failed check's error output is its message alone, wrapped to lines
    that nbgrader's Validate shows whole, with no frame of the checker; a passing check's
    cell prints ``OK: ...`` once and has no ``Out[...]`` value (Validate reads one as a score)."""
    import re

    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("from selftest import lab00"),
        nbformat.v4.new_code_cell("lab00.add(lambda a, b: a + b)"),
        nbformat.v4.new_code_cell("lab00.add(lambda a, b: a - b)"),
    ]
    NotebookClient(nb, timeout=90, allow_errors=True, kernel_name="python3").execute()
    ok, failed = nb.cells[1].outputs, nb.cells[2].outputs
    assert [o.output_type for o in ok] == ["stream"], ok
    assert ok[0].text.startswith("OK: add is right") and ok[0].text.count("OK:") == 1
    (error,) = failed
    assert error.output_type == "error" and error.ename == "CheckFailed"
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in error.traceback]
    assert lines[0].startswith("CheckFailed: ") and "max abs difference" in "\n".join(lines)
    assert " ".join(line.strip() for line in lines) == f"CheckFailed: {error.evalue}"
    assert all(len(line) <= 80 for line in lines), lines
    shown = "\n".join(lines)
    assert "Traceback" not in shown and "ddp_lab" not in shown and "File " not in shown, shown


def test_a_stub_of_several_functions_is_named_in_one_sentence():
    def stub(*args):
        raise NotImplementedError()

    ex = lab00.EXERCISES[0]
    with pytest.raises(CheckFailed, match=r"^add, save and load still raise NotImplementedError"):
        runner.visible(lab00.LAB, ex.grade_id, functions={"add": stub, "save": stub, "load": stub})
