"""Grading a course as a SLURM job array (ddp_lab.grading.array, cluster/autograde.*),
run on this machine with a stand-in ``sbatch`` that starts the array's tasks at once and the
merge after them: the merged gradebook gives the sample class the grades a local
``make autograde`` gives it (tests/test_grading.py proves those equal the expected ones)."""

from __future__ import annotations

import csv
import os
import sys
from pathlib import Path

import pytest
from _harness import ROOT, run_tree
from test_grading import NBGRADER, make_course

from ddp_lab.grading import array, sample_class

LAB = "lab01_data_parallel"
# the mistake student adds nothing to the array's mechanics (tests/test_grading.py grades it);
# two tasks for three students: one task grades two of them, one after the other
STUDENTS = ("perfect", "blank", "copycat")

# A stand-in for SLURM's sbatch: an array starts every task at once (in the background);
# a job with --dependency waits for them (afterany) and runs its --wrap command, so the
# submission script returns when the merge is done (real sbatch returns at once).
SBATCH = r"""#!/bin/bash
set -u
array= wrap= script= dep=
while [ $# -gt 0 ]; do
  case "$1" in
    --array=*) array=${1#--array=} ;;
    --wrap) shift; wrap=$1 ;;
    --wrap=*) wrap=${1#--wrap=} ;;
    --dependency=*) dep=${1#--dependency=} ;;
    --parsable|--job-name=*|--output=*|--partition=*) ;;
    -*) ;;
    *) script=$1 ;;
  esac
  shift
done
log=$SBATCH_LOG_DIR
if [ -n "$array" ]; then
  lo=${array%-*}; hi=${array#*-}
  for i in $(seq "$lo" "$hi"); do
    SLURM_ARRAY_TASK_ID=$i SLURM_SUBMIT_DIR=$PWD SLURM_CPUS_PER_TASK=2 \
      bash "$script" > "$log/task-$i.log" 2>&1 &
    echo $! >> "$log/pids"
  done
  echo 4242
else
  for pid in $(cat "$log/pids"); do while kill -0 "$pid" 2>/dev/null; do sleep 0.5; done; done
  echo "dependency $dep satisfied" > "$log/merge.log"
  bash -c "$wrap" >> "$log/merge.log" 2>&1
  echo 4243
fi
"""


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_job_array_grades_like_a_local_autograde(tmp_path):
    course = make_course(tmp_path, [LAB])
    sample_class.write_class(course / "grading" / "submitted", STUDENTS, [LAB])
    bin_dir, logs = tmp_path / "bin", tmp_path / "logs"
    bin_dir.mkdir()
    logs.mkdir()
    (bin_dir / "sbatch").write_text(SBATCH)
    (bin_dir / "sbatch").chmod(0o755)
    env = {
        "PATH": os.pathsep.join(
            [str(bin_dir), str(Path(sys.executable).parent), os.environ["PATH"]]
        ),
        "DDP_LAB_PYTHON": sys.executable,
        "SBATCH_LOG_DIR": str(logs),
        "TMPDIR": str(tmp_path),
    }
    submitted = run_tree(
        ["bash", str(ROOT / "cluster" / "autograde.sh"), "2"], env=env, cwd=str(course), timeout=600
    )
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    assert "array job 4242 (2 tasks), merge job 4243" in submitted.stdout
    merge_log = (logs / "merge.log").read_text()
    tasks = "".join(p.read_text() for p in sorted(logs.glob("task-*.log")))
    assert "merged 3 submission(s) from 2 task(s)" in merge_log, merge_log + tasks
    exported = run_tree(
        [NBGRADER, "export", "--to", str(tmp_path / "grades.csv")], cwd=str(course), timeout=120
    )
    assert exported.returncode == 0, exported.stderr[-2000:]
    assert sample_class.compare(tmp_path / "grades.csv", only_labs=[LAB]) == []
    with open(tmp_path / "grades.csv") as f:
        graded = {r["student_id"] for r in csv.DictReader(f) if r["assignment"] == LAB}
    assert set(STUDENTS) <= graded
    for student in STUDENTS:  # feedback needs the autograded notebooks in the course
        assert (course / "grading" / "autograded" / student / LAB / f"{LAB}.ipynb").is_file()
    report = (course / "grading" / "integrity.csv").read_text()
    assert "copycat" in report and "student:perfect" in report


def test_plan_keeps_students_together_and_balances_tasks(tmp_path):
    for student in ("a", "b", "c"):
        for lab in ("lab01_x", "lab02_y") if student != "c" else ("lab01_x",):
            (tmp_path / "grading" / "submitted" / student / lab).mkdir(parents=True)
    groups = array.plan(tmp_path, 2)
    assert sorted(len(g) for g in groups) == [2, 3]
    for g in groups:
        assert len({s for s, _ in g}) == len({s for s, _ in g})
        students = {s for s, _ in g}
        assert all(sum(1 for s2, _ in grp if s2 in students) == 0 for grp in groups if grp is not g)
    with pytest.raises(ValueError, match="at least 1"):
        array.plan(tmp_path, 0)


def test_projection_of_a_course():
    p = array.projection([40.0, 38.0, 60.0], students=400, labs=7, nodes=10, jobs=2)
    assert p["submissions"] == 2800
    assert p["hours_one_node"] == pytest.approx(1400 * 40 / 3600)
    assert p["hours"] == pytest.approx(140 * 40 / 3600)
