"""The out-of-kernel grader on the self-test lab: right, wrong, hanging, crashing and
cheating student code, each judged in fresh processes on fresh inputs."""

from __future__ import annotations

import os

import pytest
from _harness import new_leftovers, own_tmpdir
from selftest.students import GOOD_ADD, GOOD_SUM, RANK_SUM_FILE

from ddp_lab.grading import sandbox
from ddp_lab.grading.authoring import notebook, solution
from ddp_lab.grading.verdict import judge_notebook

LAB = "lab00_selftest"


def _nb(add: str = GOOD_ADD, rank_sum: str = GOOD_SUM) -> dict:
    return notebook([solution("add", add), solution("rank_sum", rank_sum)])


def _judge(nb, *ids):
    return judge_notebook(nb, LAB, list(ids) or None)


@pytest.mark.timeout(180)
def test_correct_code_passes_both_exercises():
    v = _judge(_nb())
    assert v["test_add"].passed, v["test_add"]
    assert v["test_rank_sum"].passed, v["test_rank_sum"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "source,reason",
    [
        ("def add(a, b):\n    return a - b", "max abs difference"),
        ("def add(a, b):\n    raise NotImplementedError()", "NotImplementedError"),
        ("def add(a, b):\n    return (a + b)[:-1]", "expected shape"),
        ("def add(a, b):\n    return 'a + b'", "expected a tensor"),
        ("def plus(a, b):\n    return a + b", "KeyError"),
        ("def add(a, b):\n    while True:\n        pass", "did not finish"),
        ("import os\ndef add(a, b):\n    os._exit(0)", "no outputs"),
    ],
    ids=["wrong", "stub", "shape", "type", "renamed", "hang", "exit"],
)
def test_wrong_code_fails_with_a_reason(source, reason):
    v = _judge(_nb(add=source), "test_add")["test_add"]
    assert not v.passed
    assert reason in v.message, v.message


@pytest.mark.timeout(60)
def test_cheating_inside_the_student_process_does_not_help():
    # Disarm every comparison and forge the outputs file with the "right" numbers for
    # inputs the student can read: the judge loads the grader's own copy of the inputs.
    cheat = """
import torch, os
torch.allclose = lambda *a, **k: True
inputs = torch.load("inputs.pt", weights_only=True)
torch.save({"a": torch.zeros_like(inputs["a"]), "b": torch.zeros_like(inputs["b"])},
           "inputs.pt")
def add(a, b):
    return torch.zeros_like(a)
"""
    v = _judge(_nb(add=cheat), "test_add")["test_add"]
    assert not v.passed, v


# Student code that finds the grader's private folder (next to its own working folder).
FIND_JUDGE = """
import os, torch
from pathlib import Path
judge = next(p / "judge" for p in [Path.cwd(), *Path.cwd().parents] if (p / "judge").is_dir())
"""


SWAP_INPUTS = (
    FIND_JUDGE
    + """
inputs = torch.load(judge / "test_add-inputs.pt", weights_only=True)
torch.save({k: torch.zeros_like(v) for k, v in inputs.items()}, judge / "test_add-inputs.pt")
def add(a, b):
    return torch.zeros_like(a)
"""
)


@pytest.mark.timeout(60)
def test_swapping_the_graders_own_inputs_is_caught(monkeypatch):
    # Without the sandbox the grader's private folder is reachable: the hashes catch it.
    monkeypatch.setenv("DDP_LAB_SANDBOX", "off")
    v = _judge(_nb(add=SWAP_INPUTS), "test_add")["test_add"]
    assert not v.passed and "inputs were modified" in v.message, v


@pytest.mark.timeout(60)
@pytest.mark.skipif(not sandbox.available(), reason="needs mount namespaces (Linux)")
def test_the_sandbox_hides_the_graders_folder():
    v = _judge(_nb(add=SWAP_INPUTS), "test_add")["test_add"]
    assert not v.passed and "No such file" in v.message, v


@pytest.mark.timeout(120)
def test_a_later_exercise_cannot_rewrite_an_earlier_ones_outputs(monkeypatch):
    monkeypatch.setenv("DDP_LAB_SANDBOX", "off")
    # add is wrong; rank_sum's file, run after it, writes the right sums over add's outputs.
    forge = (
        "%%writefile rank_sum.py\n"
        + FIND_JUDGE
        + """
inputs = torch.load(judge / "test_add-inputs.pt", weights_only=True)
torch.save({"sum": inputs["a"] + inputs["b"]}, judge / "test_add-outputs.pt")
"""
        + RANK_SUM_FILE
    )
    v = _judge(_nb(add="def add(a, b):\n    return a * 0", rank_sum=forge))
    assert v["test_rank_sum"].passed, v["test_rank_sum"]  # the forger's own exercise is right
    assert not v["test_add"].passed and "modified after" in v["test_add"].message, v["test_add"]


@pytest.mark.timeout(60)
def test_pickled_code_in_outputs_is_refused():
    cheat = """
import torch, atexit
class Evil:
    def __reduce__(self):
        return (print, ("owned",))
def add(a, b):
    atexit.register(lambda: torch.save({"sum": Evil()}, "outputs.pt"))
    return a + b
"""
    v = _judge(_nb(add=cheat), "test_add")["test_add"]
    assert not v.passed and "could not be read" in v.message, v


@pytest.mark.timeout(60)
def test_a_kernel_side_forged_file_is_ignored(tmp_path, monkeypatch):
    # Files lying around where the notebook ran are never read: verdicts start from source.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rank_sum.py").write_text("def rank_sum(t):\n    pass\n")
    v = _judge(_nb(), "test_rank_sum")["test_rank_sum"]
    assert v.passed, v


@pytest.mark.timeout(120)
def test_forbidden_collective_and_deadlock_fail(tmp_path, monkeypatch):
    uses_all_reduce = (
        "%%writefile rank_sum.py\nimport torch.distributed as dist\n"
        "def rank_sum(t):\n    dist.all_reduce(t)\n"
    )
    v = _judge(_nb(rank_sum=uses_all_reduce), "test_rank_sum")["test_rank_sum"]
    assert not v.passed and "not allowed" in v.message, v
    deadlock = (
        "%%writefile rank_sum.py\nimport torch.distributed as dist\n"
        "def rank_sum(t):\n    dist.recv(t, src=(dist.get_rank() + 1) % dist.get_world_size())\n"
    )
    marker = own_tmpdir(monkeypatch, tmp_path)
    before = set(os.listdir("/proc"))
    v = _judge(_nb(rank_sum=deadlock), "test_rank_sum")["test_rank_sum"]
    assert not v.passed, v
    leftovers = new_leftovers(before, marker)
    assert not leftovers, f"processes of the hanging job survived: {leftovers}"


@pytest.mark.timeout(60)
def test_in_kernel_verdict_under_autograde_only_defers(monkeypatch, capsys):
    from ddp_lab.grading.verdict import hidden_test

    monkeypatch.setenv("NBGRADER_EXECUTION", "autograde")
    hidden_test("test_add")
    assert "judged by the grader" in capsys.readouterr().out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("module", ["ddp_lab.checks", "ddp_lab.answers", "ddp_lab.grading"])
def test_solution_cells_may_not_use_the_checks_the_answers_or_the_grader(module):
    package, _, leaf = module.rpartition(".")
    lazy = f"from {package} import {leaf}\ndef add(a, b):\n    return a + b"
    v = _judge(_nb(add=lazy), "test_add")["test_add"]
    assert not v.passed and f"uses {module}" in v.message, v


@pytest.mark.timeout(60)
def test_the_graders_exact_check_runs_after_the_oracle():
    # float32 sums are within the oracle's tolerance often enough; the hidden check
    # (tests/selftest/lab00_answers.py) insists on the inputs' dtype
    v = _judge(_nb(add="def add(a, b):\n    return (a + b).float()"), "test_add")["test_add"]
    assert not v.passed and "expected torch.float64" in v.message, v


@pytest.mark.timeout(60)
def test_the_answers_are_hidden_from_student_code():
    if not sandbox.available():
        pytest.fail("the grading sandbox is not available on this machine")
    peek = (
        "import pathlib, ddp_lab\n"
        "ANSWERS = pathlib.Path(ddp_lab.__file__).parent / 'answers'\n"
        "def add(a, b):\n"
        "    assert not list(ANSWERS.glob('*.py')), 'the answers are visible'\n"
        "    return a + b\n"
    )
    v = _judge(_nb(add=peek), "test_add")["test_add"]
    assert v.passed, v


def _thief_notebook(lab: str, gid: str) -> dict:
    from ddp_lab.grading import sample_class

    return notebook([solution(gid.removeprefix("test_"), sample_class.steal(lab, gid, ""))])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("confined", [True, False], ids=["sandbox", "no-sandbox"])
def test_copying_the_instructors_answer_at_grading_time_fails_in_the_sandbox(confined, monkeypatch):
    """A solution cell that reads solutions/ and runs the instructor's cell: the sandbox
    hides solutions/ from student processes; without it the theft would score."""
    lab, gid = "lab01_data_parallel", "ex1_split_batch"
    if not confined:
        monkeypatch.setenv("DDP_LAB_SANDBOX", "off")
    elif not sandbox.available():
        pytest.fail("the grading sandbox is not available on this machine")
    v = judge_notebook(_thief_notebook(lab, gid), lab, [f"test_{gid}"])[f"test_{gid}"]
    assert v.passed is not confined, v


@pytest.mark.timeout(60)
def test_student_processes_see_no_gpu_on_any_host(monkeypatch):
    # a GPU grading host and a laptop give the same points: the grader hides GPUs
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    probe = (
        "import os, torch\n"
        "def add(a, b):\n"
        "    assert os.environ['CUDA_VISIBLE_DEVICES'] == '' and not torch.cuda.is_available()\n"
        "    return a + b\n"
    )
    v = _judge(_nb(add=probe), "test_add")["test_add"]
    assert v.passed, v
