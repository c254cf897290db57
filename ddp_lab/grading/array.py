"""Grading a whole course on a cluster: ``make autograde`` as a SLURM job array.

At about 40 s per submission and lab on a 2-core machine, 400 students x 7 labs is some 30
hours; a job array spreads it over nodes. Three steps, all run from the course root:

``python -m ddp_lab.grading.array plan --tasks N``
    splits the ``(student, lab)`` submissions of ``grading/submitted`` into ``N`` tasks
    (students stay together) and writes ``grading/array/plan.json``.
``python -m ddp_lab.grading.array task [--index I]``
    (one array task; ``I`` defaults to ``$SLURM_ARRAY_TASK_ID``) copies the course's
    configuration, releases and sources and the task's submissions into a scratch copy of
    its own (``grading/array/task-I``, or under ``--scratch``), with its own gradebook, and
    runs ``make autograde`` there (sandboxed and time-limited as usual). Tasks never touch
    the course's gradebook, so any number can run at once.
``python -m ddp_lab.grading.array merge``
    imports every task's autograded notebooks and grades (scores, comments, flags) into the
    course's gradebook, as if ``make autograde`` had run here, prints the score table and
    writes the copy-detection report (``grading/integrity.csv``).

``cluster/autograde.sh`` submits the array and the merge (``--dependency=afterok``).
:func:`projection` turns measured seconds per submission into the wall time of a course on
``N`` nodes (``plan --project``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

from ddp_lab.grading import autograde, integrity

PROG = "ddp_lab.grading.array"
#: What a task's scratch copy takes from the course root (besides its submissions).
COURSE_PARTS = ("nbgrader_config.py", "labs", "solutions")


def _array_dir(root: Path) -> Path:
    return root / "grading" / "array"


def plan(root: Path, tasks: int, labs: list[str] | None = None) -> list[list[list[str]]]:
    """Split the submissions into ``tasks`` groups of whole students, balanced by count.

    Returns:
        ``[[[student, lab], ...], ...]``, one list per task (written to ``plan.json``).

    Raises:
        ValueError: ``tasks < 1`` or no submissions.
    """
    if tasks < 1:
        raise ValueError(f"--tasks must be at least 1, got {tasks}")
    pairs = autograde.submissions(root, labs, None)
    if not pairs:
        raise ValueError(f"no submissions under {root / 'grading' / 'submitted'}")
    by_student: dict[str, list[list[str]]] = {}
    for student, lab in pairs:
        by_student.setdefault(student, []).append([student, lab])
    groups: list[list[list[str]]] = [[] for _ in range(min(tasks, len(by_student)))]
    for work in sorted(by_student.values(), key=len, reverse=True):  # largest first
        min(groups, key=len).extend(work)
    folder = _array_dir(root)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "plan.json").write_text(json.dumps({"tasks": groups}, indent=1))
    return groups


def _scratch(root: Path, index: int, scratch: Path | None) -> Path:
    base = scratch if scratch is not None else _array_dir(root)
    return base / f"task-{index}"


def run_task(root: Path, index: int, scratch: Path | None = None, extra: list[str] = ()) -> int:
    """Grade task ``index`` of the plan in its own scratch copy; return the exit status."""
    tasks = json.loads((_array_dir(root) / "plan.json").read_text())["tasks"]
    if not 0 <= index < len(tasks):
        print(f"{PROG}: task {index} is not in the plan (0..{len(tasks) - 1})", file=sys.stderr)
        return 2
    copy = _scratch(root, index, scratch)
    if copy.exists():
        shutil.rmtree(copy)
    copy.mkdir(parents=True)
    for part in COURSE_PARTS:
        src = root / part
        if src.is_dir():
            shutil.copytree(src, copy / part, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
        elif src.is_file():
            shutil.copy2(src, copy / part)
    for student, lab in tasks[index]:
        src = root / "grading" / "submitted" / student / lab
        shutil.copytree(src, copy / "grading" / "submitted" / student / lab)
    print(f"{PROG}: task {index}: {len(tasks[index])} submission(s) in {copy}", flush=True)
    status = autograde.main(["--root", str(copy), *extra])
    (copy / "task.json").write_text(json.dumps({"index": index, "status": status}))
    return status


def _copy_grades(course_gb, task_gb, lab: str, student: str) -> None:
    """Put ``student``'s submission of ``lab`` from a task's gradebook into the course's."""
    old = task_gb.find_submission(lab, student)
    course_gb.update_or_create_student(student)
    try:
        course_gb.remove_submission(lab, student)
    except Exception:  # noqa: BLE001 - nothing to replace
        course_gb.db.rollback()
    new = course_gb.add_submission(lab, student, timestamp=old.timestamp)
    new.extension = old.extension
    old_notebooks = {nb.name: nb for nb in old.notebooks}
    for nb in new.notebooks:
        src = old_notebooks[nb.name]
        nb.flagged = src.flagged
        nb.late_submission_penalty = src.late_submission_penalty
        grades = {g.name: g for g in src.grades}
        for grade in nb.grades:
            g = grades[grade.name]
            grade.auto_score, grade.manual_score = g.auto_score, g.manual_score
            grade.extra_credit, grade.needs_manual_grade = g.extra_credit, g.needs_manual_grade
        comments = {c.name: c for c in src.comments}
        for comment in nb.comments:
            c = comments[comment.name]
            comment.auto_comment, comment.manual_comment = c.auto_comment, c.manual_comment
    course_gb.db.commit()


def merge(root: Path, scratch: Path | None = None) -> int:
    """Import every task's results into the course; print the table; return 1 on failures."""
    from nbgrader.api import Gradebook

    tasks = json.loads((_array_dir(root) / "plan.json").read_text())["tasks"]
    labs = sorted({lab for work in tasks for _, lab in work})
    autograde.register_missing(root, set(labs))
    missing, done = [], []
    course_url = f"sqlite:///{root / 'grading' / 'gradebook.db'}"
    with Gradebook(course_url) as course_gb:
        for index, work in enumerate(tasks):
            copy = _scratch(root, index, scratch)
            db = copy / "grading" / "gradebook.db"
            if not (copy / "task.json").is_file() or not db.is_file():
                missing.append(index)
                continue
            with Gradebook(f"sqlite:///{db}") as task_gb:
                for student, lab in work:
                    graded = copy / "grading" / "autograded" / student / lab
                    try:
                        task_gb.find_submission(lab, student)
                    except Exception:  # noqa: BLE001 - the task could not grade it
                        continue
                    _copy_grades(course_gb, task_gb, lab, student)
                    target = root / "grading" / "autograded" / student / lab
                    if target.exists():
                        shutil.rmtree(target)
                    if graded.is_dir():
                        shutil.copytree(graded, target)
                    done.append((student, lab))
    table = autograde.scores(root)
    for student, lab in sorted(p for work in tasks for p in map(tuple, work)):
        score = table.get((student, lab)) if (student, lab) in done else None
        shown = f"{score[0]:g}/{score[1]:g}" if score else "-"
        print(f"  {student:<16} {lab:<24} {shown:>8}  {'merged' if score else 'NOT GRADED'}")
    rows = integrity.class_report(root, labs)
    integrity.write_report(rows, root / "grading" / "integrity.csv")
    flagged = sum(bool(r["flagged"]) for r in rows)
    print(
        f"{PROG}: merged {len(done)} submission(s) from {len(tasks)} task(s); integrity: "
        f"{flagged} flagged cell(s) in grading/integrity.csv"
    )
    if missing:
        print(f"{PROG}: tasks without results: {missing} (rerun them, then merge)", file=sys.stderr)
    return 1 if missing or len(done) < sum(len(w) for w in tasks) else 0


def projection(seconds: list[float], students: int, labs: int, nodes: int, jobs: int) -> dict:
    """Wall time of grading a course from measured seconds per submission.

    Each node grades ``jobs`` submissions at a time; the median measured submission time is
    the cost of one. Returns hours for one node and for ``nodes``.

    Example:
        >>> round(projection([40.0], 400, 7, 10, 2)["hours"], 2)
        1.56
    """
    per = statistics.median(seconds)
    submissions = students * labs
    one = math.ceil(submissions / jobs) * per / 3600
    return {
        "seconds_per_submission": per,
        "submissions": submissions,
        "hours_one_node": one,
        "nodes": nodes,
        "hours": math.ceil(submissions / (jobs * nodes)) * per / 3600,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--root", default=".", help="course root (holds nbgrader_config.py)")
    p.add_argument("--scratch", default=None, help="where task copies go (default grading/array)")
    sub = p.add_subparsers(dest="step", required=True)
    pl = sub.add_parser("plan", help="split the submissions into tasks")
    pl.add_argument("--tasks", type=int, required=True)
    pl.add_argument("--lab", action="append")
    pl.add_argument(
        "--project",
        nargs=4,
        type=float,
        metavar=("SECONDS", "STUDENTS", "LABS", "NODES"),
        help="also print the projected wall time of a course",
    )
    tk = sub.add_parser("task", help="grade one task in its own scratch copy")
    tk.add_argument("--index", type=int, default=None, help="default: $SLURM_ARRAY_TASK_ID")
    tk.add_argument("autograde_args", nargs=argparse.REMAINDER, help="-- then autograde flags")
    sub.add_parser("merge", help="import every task's results into the course gradebook")
    args = p.parse_args(argv)
    root = Path(args.root).resolve()
    scratch = Path(args.scratch).resolve() if args.scratch else None
    if args.step == "plan":
        try:
            groups = plan(root, args.tasks, args.lab)
        except ValueError as err:
            print(f"{PROG}: error: {err}", file=sys.stderr)
            return 2
        print(
            f"{PROG}: {sum(map(len, groups))} submissions in {len(groups)} task(s): "
            f"sbatch --array=0-{len(groups) - 1} cluster/autograde.sbatch"
        )
        if args.project:
            sec, students, labs, nodes = args.project
            proj = projection([sec], int(students), int(labs), int(nodes), jobs=2)
            print(json.dumps(proj))
        return 0
    if args.step == "task":
        index = args.index
        if index is None:
            index = int(os.environ.get("SLURM_ARRAY_TASK_ID", "-1"))
        extra = [a for a in args.autograde_args if a != "--"]
        t0 = time.monotonic()
        status = run_task(root, index, scratch, extra)
        print(f"{PROG}: task {index} done in {time.monotonic() - t0:.1f} s (exit {status})")
        return status
    return merge(root, scratch)


if __name__ == "__main__":
    sys.exit(main())
