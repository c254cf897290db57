"""``make autograde``: grade every submission, each student in a time-limited sandbox.

``python -m ddp_lab.grading.autograde [--jobs N] [--timeout S] [--lab LAB] [--student S]``
finds ``grading/submitted/<student>/<lab>/``, runs ``nbgrader autograde LAB --student S``
for each pair, at most ``--jobs`` at a time, each with a wall-clock limit after which its
whole process tree is killed (the student then has no autograded notebook and the summary
says so). Where the platform allows it (Linux with ``unshare``), each run has no network
but its own loopback (``--network off``, the default where available), and the student's
kernel and exercise processes are confined (``--sandbox``, see
:mod:`ddp_lab.grading.sandbox`): the course read-only, its answers and the gradebook hidden.

What this protects, and what it does not, is in the README ("Grading sandbox").

Afterwards it compares every graded solution cell with the instructor's solution, the
package's code and every other student's same cell (:mod:`ddp_lab.grading.integrity`),
writes ``grading/integrity.csv`` and lists the flagged ones under the score table. That
never changes points: the instructor decides.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ddp_lab import proctree
from ddp_lab.grading import integrity, limits
from ddp_lab.grading import sandbox as files_sandbox

PROG = "ddp_lab.grading.autograde"


@functools.cache
def network_sandbox() -> list[str] | None:
    """The command prefix that runs a command without network (but with loopback), or None.

    Tries ``unshare -n`` (root) and ``unshare -rn`` (an unprivileged user namespace).
    """
    if not sys.platform.startswith("linux") or not shutil.which("unshare"):
        return None
    lo_up = 'ip link set lo up 2>/dev/null || true; exec "$@"'
    for flags in (["-n"], ["-rn"]):
        prefix = ["unshare", *flags, "sh", "-c", lo_up, "sandbox"]
        try:
            probe = subprocess.run([*prefix, "true"], capture_output=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            continue
        if probe.returncode == 0:
            return prefix
    return None


def submissions(root: Path, labs: list[str] | None, students: list[str] | None):
    """``(student, lab)`` pairs found under ``root/grading/submitted``."""
    base = root / "grading" / "submitted"
    pairs = []
    for student_dir in sorted(p for p in base.glob("*") if p.is_dir()):
        if students and student_dir.name not in students:
            continue
        for lab_dir in sorted(p for p in student_dir.glob("*") if p.is_dir()):
            if labs and lab_dir.name not in labs:
                continue
            pairs.append((student_dir.name, lab_dir.name))
    return pairs


def grade_one(
    root: Path,
    student: str,
    lab: str,
    timeout: float,
    sandbox: list[str] | None,
    confine: bool = True,
    student_limits: limits.Limits = limits.DEFAULT,
):
    """Autograde one submission; return ``(student, lab, status, seconds)``."""
    nbgrader = Path(sys.executable).with_name("nbgrader")
    cmd = [str(nbgrader), "autograde", lab, "--student", student, "--create", "--force"]
    env = {**os.environ, "PATH": os.pathsep.join([str(nbgrader.parent), os.environ["PATH"]])}
    env[limits.ENV] = student_limits.to_env()  # the kernel's and the exercises' processes
    if not confine:
        env[files_sandbox.ENV_SWITCH] = "off"
    run = proctree.run([*(sandbox or []), *cmd], timeout=timeout, cwd=str(root), env=env)
    if run.timed_out:
        status = f"TIMEOUT after {timeout:g} s (killed {run.killed} process(es))"
    elif run.returncode != 0:
        tail = [line for line in run.stderr.splitlines() if "ERROR" in line][-2:]
        status = f"nbgrader failed (exit {run.returncode}) {' | '.join(tail)}"
    else:
        status = "graded"
    return student, lab, status, run.seconds


def register_missing(root: Path, labs: set[str]) -> list[str]:
    """Put the labs the gradebook does not know yet into it (``nbgrader generate_assignment``,
    what ``make release`` runs: it rewrites ``labs/<lab>`` identically); return them.

    nbgrader can only grade an assignment whose cells the gradebook knows, and a fresh
    clone has no gradebook.
    """
    from nbgrader.api import Gradebook

    with Gradebook(f"sqlite:///{root / 'grading' / 'gradebook.db'}") as gb:
        known = {a.name for a in gb.assignments}
    missing = sorted(labs - known)
    nbgrader = Path(sys.executable).with_name("nbgrader")
    for lab in missing:
        print(
            f"{PROG}: {lab} is not in the gradebook yet: nbgrader generate_assignment", flush=True
        )
        subprocess.run(
            [str(nbgrader), "generate_assignment", lab, "--force", "--create", "--log-level=WARN"],
            cwd=str(root),
            check=True,
        )
    return missing


def scores(root: Path) -> dict[tuple[str, str], tuple[float, float]]:
    """``(student, lab) -> (score, max_score)`` from the gradebook."""
    from nbgrader.api import Gradebook

    out = {}
    with Gradebook(f"sqlite:///{root / 'grading' / 'gradebook.db'}") as gb:
        for assignment in gb.assignments:
            for sub in assignment.submissions:
                out[(sub.student.id, assignment.name)] = (sub.score, sub.max_score)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--root", default=".", help="course root (holds nbgrader_config.py)")
    p.add_argument("--lab", action="append", help="only this lab (repeatable)")
    p.add_argument("--student", action="append", help="only this student (repeatable)")
    p.add_argument(
        "--jobs",
        type=int,
        default=max(1, min(2, (os.cpu_count() or 2) // 2)),
        help="students graded at once",
    )
    p.add_argument("--timeout", type=float, default=900, help="seconds per student and lab")
    p.add_argument(
        "--network",
        choices=["auto", "off", "on"],
        default="auto",
        help="off: no network for student code (fails where impossible); "
        "auto: off where the platform allows it",
    )
    p.add_argument(
        "--sandbox",
        choices=["auto", "on", "off"],
        default="auto",
        help="confine student code (course read-only; solutions/, other submissions and the "
        "gradebook hidden): on insists, auto does where the platform allows it",
    )
    d = limits.DEFAULT
    p.add_argument("--memory-mb", type=int, default=d.memory_mb, help="memory per student process")
    p.add_argument(
        "--max-processes",
        type=int,
        default=d.processes,
        help="processes at once per student process tree (the kernel, or one exercise)",
    )
    p.add_argument("--file-mb", type=int, default=d.file_mb, help="largest file a student writes")
    p.add_argument("--cpu-s", type=int, default=d.cpu_s, help="CPU seconds per student process")
    args = p.parse_args(argv)
    root = Path(args.root).resolve()
    student_limits = limits.Limits(args.memory_mb, args.max_processes, args.file_mb, args.cpu_s)
    confine = args.sandbox != "off" and files_sandbox.available()
    if args.sandbox == "on" and not confine:
        print(
            f"{PROG}: error: cannot confine student code here (no mount namespaces: needs "
            "Linux with root or unprivileged user namespaces); grade inside a container "
            "(see README) or use --sandbox off",
            file=sys.stderr,
        )
        return 2
    sandbox = None
    if args.network != "on":
        sandbox = network_sandbox()
        if sandbox is None and args.network == "off":
            print(
                f"{PROG}: error: cannot cut the network here (no usable `unshare`); "
                "use --network on, or grade inside a container (see README)",
                file=sys.stderr,
            )
            return 2
    pairs = submissions(root, args.lab, args.student)
    if not pairs:
        print(f"{PROG}: no submissions under {root / 'grading' / 'submitted'}", file=sys.stderr)
        return 1
    net = "no network" if sandbox else "network on"
    files = "student code confined" if confine else "student code NOT confined"
    per_tree = "per tree" if limits.pids_cgroups_available() else "per tree, by watching"
    print(
        f"{PROG}: {len(pairs)} submission(s), {args.jobs} at a time, "
        f"{args.timeout:g} s each, {net}, {files}; limits: {args.memory_mb} MiB and "
        f"{args.cpu_s} s CPU per process, {args.max_processes} processes {per_tree}, "
        f"files up to {args.file_mb} MiB",
        flush=True,
    )
    if not confine:
        print(
            f"{PROG}: warning: student code can read solutions/ and other submissions and "
            "write to the course; grade in a container (README, 'Grading sandbox')",
            file=sys.stderr,
        )
    (root / "grading").mkdir(exist_ok=True)
    register_missing(root, {lab for _, lab in pairs})
    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        results = list(
            pool.map(
                lambda sl: grade_one(root, *sl, args.timeout, sandbox, confine, student_limits),
                pairs,
            )
        )
    limits.sweep()  # the per-tree cgroups of the processes that have ended
    table = scores(root)
    failed = 0
    for student, lab, status, seconds in results:
        score = table.get((student, lab))
        shown = f"{score[0]:g}/{score[1]:g}" if score and status == "graded" else "-"
        failed += status != "graded"
        print(f"  {student:<16} {lab:<24} {shown:>8}  {seconds:6.1f} s  {status}")
    rows = integrity.class_report(root, args.lab)
    report = root / "grading" / "integrity.csv"
    integrity.write_report(rows, report)
    flagged = [r for r in rows if r["flagged"]]
    print(
        f"{PROG}: integrity: {len(flagged)} of {len(rows)} solution cells at or above "
        f"{integrity.FLAG_AT:g} similarity (points unchanged; details in {report})"
    )
    for r in flagged:
        where = f"{r['student']:<16} {r['lab']:<24} {r['exercise']:<32}"
        print(f"  FLAG {where} {r['score']}  {r['closest']}")
    print(f"{PROG}: done in {time.monotonic() - t0:.1f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
