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
