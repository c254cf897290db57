"""Verdicts reached outside the student's kernel.

For each exercise of a notebook, :func:`judge_notebook`

1. draws fresh inputs (a seed from the OS, unknown to the student) in this process;
2. runs the student's solution cells, taken from the notebook's *source*, in a fresh
   student process (``ddp_lab.grading.student``) with a time limit; the whole process
   tree is killed afterwards, so nothing the student started survives;
3. judges all saved outputs in one fresh judge process (``ddp_lab.grading.judge``) that
   never runs student code.

Nothing the student's kernel did (monkeypatched comparisons, replaced check functions,
result files written by hand) reaches the verdict.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ddp_lab import proctree
from ddp_lab.checks.contract import SEALED, Exercise, exercises, lab_of_notebook, unsealed
from ddp_lab.checks.failure import CheckFailed, passed
from ddp_lab.checks.runner import INPUTS_FILE, write_cells
from ddp_lab.childenv import child_env
from ddp_lab.grading import limits
from ddp_lab.grading.judge import package_hashes, sha256
from ddp_lab.grading.notebook import load, solution_sources
from ddp_lab.grading.sandbox import confine, course_roots

if TYPE_CHECKING:  # the answers are hidden from a confined kernel, which imports this module
    from ddp_lab.answers import Hidden

JUDGE_TIMEOUT_S = 120.0
REPO_ROOT = Path(__file__).resolve().parent.parent.parent


@dataclass
class Verdict:
    """The grader's decision on one test cell."""

    grade_id: str
    title: str
    passed: bool
    message: str
    seconds: float

    def __str__(self) -> str:
        mark = "PASSED" if self.passed else "FAILED"
        return f"[{mark}] {self.grade_id} ({self.title}): {self.message}"


#: GPUs are hidden from every process the grader starts: the same submission gets the same
#: points on a laptop and on a GPU grading host (a solution that picks NCCL and a cuda device
#: when CUDA is available takes its CPU branch here, as on the students' laptops).
HIDE_GPUS = {"CUDA_VISIBLE_DEVICES": ""}


def _student_env() -> dict[str, str]:
    return child_env(HIDE_GPUS, drop_torchrun=True, drop_prefixes=("JPY_", "NBGRADER_"))


def _last_lines(text: str, n: int = 8) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return "\n".join(lines[-n:])


def _run_student(
    ex: Exercise,
    extra: Hidden | None,
    lab: str,
    sources: Mapping[str, str],
    tmp: Path,
    private: Path,
    seed: int,
) -> tuple[dict | None, str]:
    """Run one exercise's student process; return (judge item, "") or (None, why it failed)."""
    workdir = tmp / ex.grade_id
    workdir.mkdir()
    make_inputs = extra.inputs if extra and extra.inputs else ex.make_inputs
    inputs = make_inputs(torch.Generator().manual_seed(seed))
    inputs_path = private / f"{ex.grade_id}-inputs.pt"
    torch.save(unsealed(inputs), inputs_path)  # what the student's process gets a copy of
    inputs_sha256 = sha256(inputs_path)  # before any student code runs
    sealed = {}  # the answer known by construction: the judge's alone
    if SEALED in inputs:
        path = private / f"{ex.grade_id}-sealed.pt"
        torch.save({SEALED: inputs[SEALED]}, path)
        sealed = {"sealed": str(path), "sealed_sha256": sha256(path)}
    shutil.copy(inputs_path, workdir / INPUTS_FILE)
    write_cells(workdir, sources, ex.cells)
    for name, text in (extra.files() if extra and extra.files else {}).items():
        (workdir / name).write_text(text)  # reference pieces this exercise builds on
    # confined: the course read-only, its answers, the judge's folder and the other
    # exercises' folders hidden (where the platform allows; the hashes guard the rest)
    others = [p for p in tmp.iterdir() if p != workdir]
    # limited: memory, processes, file size and CPU time (ddp_lab.grading.limits)
    lim = limits.current()
    student = [sys.executable, "-m", "ddp_lab.grading.student", lab, ex.grade_id, str(workdir)]
    run = proctree.run(
        confine(limits.wrap(student, lim), keep=[workdir], hide=others),
        timeout=ex.timeout,
        cwd=str(workdir),
        env=_student_env(),
        max_processes=None if limits.pids_cgroups_available() else lim.processes,
    )
    if run.too_many:
        return None, (
            f"your code ran more than {lim.processes} processes at once (a process-spawning "
            "loop?) and was stopped"
        )
    if run.timed_out:
        return None, (
            f"your code did not finish within {ex.timeout:g} s and was stopped "
            "(an endless loop, or ranks waiting for each other?)"
        )
    if run.returncode != 0:
        why = _last_lines(run.stderr) or f"exit status {run.returncode}"
        hit = limits.explain(run.stderr, lim, run.returncode)
        return None, f"{hit}: {why}" if hit else f"your code failed: {why}"
    if not (workdir / "outputs.pt").is_file():
        return None, "your code produced no outputs"
    # the outputs as they were when this exercise's processes ended: a later exercise's
    # student code cannot replace them unnoticed
    outputs_path = private / f"{ex.grade_id}-outputs.pt"
    shutil.copy(workdir / "outputs.pt", outputs_path)
    return {
        "grade_id": ex.grade_id,
        "inputs": str(inputs_path),
        "inputs_sha256": inputs_sha256,
        **sealed,
        "outputs": str(outputs_path),
        "outputs_sha256": sha256(outputs_path),
    }, ""


def released_stubs(lab: str) -> dict[str, str]:
    """``grade_id -> source`` of the released notebook's solution cells (the stubs students
    start from), from ``labs/`` of the course; ``{}`` when no release is found."""
    for root in course_roots():
        path = root / "labs" / lab / f"{lab}.ipynb"
        if path.is_file():
            return solution_sources(load(path))
    return {}


def judge_notebook(
    notebook: str | Path | Mapping,
    lab: str | None = None,
    grade_ids: Iterable[str] | None = None,
    seed: int | None = None,
) -> dict[str, Verdict]:
    """Judge the exercises of a notebook outside any kernel.

    Args:
        notebook: a notebook file, or a notebook (dict / NotebookNode) in memory.
        lab: the lab name (default: the notebook file's name, e.g. ``lab01_data_parallel``).
        grade_ids: test cells to judge (default: every exercise of the lab).
        seed: fix the inputs (tests only); by default each run draws a fresh OS seed.

    Returns:
        ``grade_id -> Verdict``.

    Example:
        >>> v = judge_notebook("solutions/lab01_data_parallel/lab01_data_parallel.ipynb")
        ... # doctest: +SKIP
        >>> all(x.passed for x in v.values())                           # doctest: +SKIP
        True
    """
    if isinstance(notebook, (str, Path)):
        lab = lab or lab_of_notebook(notebook)
        notebook = load(notebook)
    if lab is None:
        raise ValueError("give lab= when judging a notebook held in memory")
    from ddp_lab.answers import hidden  # grader side only: never in a student's process

    table = exercises(lab)
    extras = hidden(lab)
    wanted = list(table) if grade_ids is None else list(grade_ids)
    sources = solution_sources(notebook)
    stubs = released_stubs(lab)
    hashes = package_hashes()
    verdicts: dict[str, Verdict] = {}
    started: dict[str, float] = {}
    items = []
    with tempfile.TemporaryDirectory(prefix="ddp_lab-grade-") as tmp_name:
        tmp = Path(tmp_name)
        private = tmp / "judge"
        private.mkdir()
        for gid in wanted:
            ex = table[gid]
            untouched = [
                c for c in ex.cells if c in stubs and sources.get(c, "").strip() == stubs[c].strip()
            ]
            if untouched:  # it would raise NotImplementedError: no need to start processes
                why = f"not attempted: {', '.join(untouched)} is still the released stub"
                verdicts[gid] = Verdict(gid, ex.title, False, why, 0.0)
                continue
            t0 = time.monotonic()
            item_seed = secrets.randbits(62) if seed is None else seed
            item, why = _run_student(ex, extras.get(gid), lab, sources, tmp, private, item_seed)
            started[gid] = time.monotonic() - t0
            if item is None:
                verdicts[gid] = Verdict(gid, ex.title, False, why, started[gid])
            else:
                items.append(item)
        if items:
            spec = private / "spec.json"
            spec.write_text(json.dumps({"lab": lab, "items": items, "package_hashes": hashes}))
            t0 = time.monotonic()
            run = proctree.run(
                [sys.executable, "-m", "ddp_lab.grading.judge", str(spec)],
                timeout=JUDGE_TIMEOUT_S,
                cwd=str(private),
                env=_student_env(),
            )
            judged = {}
            if run.returncode == 0 and run.stdout.strip():
                judged = json.loads(run.stdout.strip().splitlines()[-1])
            share = (time.monotonic() - t0) / len(items)
            for item in items:
                gid = item["grade_id"]
                v = judged.get(
                    gid,
                    {
                        "passed": False,
                        "message": "the judge failed: "
                        + (_last_lines(run.stderr, 4) or "no verdict"),
                    },
                )
                verdicts[gid] = Verdict(
                    gid, table[gid].title, bool(v["passed"]), v["message"], started[gid] + share
                )
    return {gid: verdicts[gid] for gid in wanted}


def hidden_test(grade_id: str, notebook: str | Path | None = None) -> None:
    """The hidden part of a test cell: ``hidden_test("test_ex2_data_parallel_step")``.

    Under ``nbgrader autograde`` it only says that the grader decides (the grader judges
    outside the kernel and overwrites this cell's outcome). Run by hand (an instructor in
    ``solutions/<lab>/``), it judges the *saved* notebook file now and raises on failure.

    Args:
        grade_id: the test cell's ``grade_id``.
        notebook: the notebook file (default: ``<folder name>.ipynb`` in the current folder,
            where a lab's notebook runs).

    Raises:
        CheckFailed: the saved notebook fails the exercise.
    """
    if os.environ.get("NBGRADER_EXECUTION") == "autograde":  # read here: nothing to patch
        print(f"{grade_id}: judged by the grader outside this kernel, on fresh inputs")
        return
    path = Path(notebook) if notebook else Path.cwd() / f"{Path.cwd().name}.ipynb"
    if not path.is_file():
        raise CheckFailed(
            f"{path.name} not found in {path.parent}: run the notebook from its folder"
        )
    v = judge_notebook(path, lab_of_notebook(path), [grade_id])[grade_id]
    if not v.passed:
        raise CheckFailed(f"{grade_id} (judged on the saved notebook): {v.message}")
    passed(f"{grade_id} (judged outside this kernel on the saved notebook): {v.message}")
