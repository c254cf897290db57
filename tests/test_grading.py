"""Grading is tested like code: the release, the metadata, and real autograde runs.

- ``labs/`` is exactly what ``make release`` makes from ``solutions/`` and leaks nothing;
- every graded cell is well-formed and has an out-of-kernel exercise;
- under real ``nbgrader autograde`` (in a temporary copy of the course): the solutions get
  full marks, the release 0, one typical mistake per exercise loses that exercise, a
  cheating student (no-op stubs, monkeypatched comparisons and checks, forged files, edited
  test cells) gets 0, a hanging torchrun job is stopped and leaves no process behind.
"""

from __future__ import annotations

import csv
import json
import shutil
import sys
from pathlib import Path

import pytest
from _harness import leftover_processes, run_tree

from ddp_lab.answers import lab_answers
from ddp_lab.checks.contract import exercises
from ddp_lab.grading import sample_class
from ddp_lab.grading.notebook import (
    is_solution,
    is_test,
    is_written,
    load,
    nbgrader_meta,
    source_of,
)

ROOT = Path(__file__).resolve().parent.parent
LABS = sorted(p.name for p in (ROOT / "solutions").iterdir() if p.is_dir())
NBGRADER = str(Path(sys.executable).with_name("nbgrader"))
MARKERS = ("BEGIN SOLUTION", "END SOLUTION", "BEGIN HIDDEN TESTS", "END HIDDEN TESTS")
PER_STUDENT_BUDGET_S = 120


def _cells(folder: str, lab: str) -> list[dict]:
    return load(ROOT / folder / lab / f"{lab}.ipynb")["cells"]


def make_course(tmp: Path, labs: list[str] = LABS) -> Path:
    """A temporary copy of the course (config + solutions), ``labs`` released there by
    nbgrader."""
    course = tmp / "course"
    course.mkdir()
    shutil.copy(ROOT / "nbgrader_config.py", course)
    shutil.copytree(
        ROOT / "solutions",
        course / "solutions",
        ignore=shutil.ignore_patterns(".ipynb_checkpoints"),
    )
    for lab in labs:
        proc = run_tree(
            [NBGRADER, "generate_assignment", lab, "--force", "--create", "--log-level=WARN"],
            cwd=str(course),
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
    return course


@pytest.fixture(scope="session")  # once per test worker: tests of other files run between
def released(tmp_path_factory) -> Path:
    return make_course(tmp_path_factory.mktemp("release"))


def test_nbgrader_commands_start_without_torch():
    """Every nbgrader command loads nbgrader_config.py; only autograde's judging needs torch
    (1.3-1.7 s of CPU per command: 14 s of each course build)."""
    probe = (
        "import runpy, sys; runpy.run_path(sys.argv[1], init_globals={'get_config': lambda: "
        "__import__('traitlets.config').config.Config()}); print(sorted({'torch', "
        "'ddp_lab.checks.contract', 'ddp_lab.grading.verdict'} & set(sys.modules)))"
    )
    proc = run_tree([sys.executable, "-c", probe, str(ROOT / "nbgrader_config.py")], timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout


@pytest.mark.timeout(300)
def test_labs_equal_a_fresh_release_of_solutions(released):
    fresh = sorted(
        p.relative_to(released / "labs") for p in (released / "labs").rglob("*") if p.is_file()
    )
    committed = sorted(
        p.relative_to(ROOT / "labs") for p in (ROOT / "labs").rglob("*") if p.is_file()
    )
    assert fresh == committed, "labs/ and a fresh release hold different files: make release"
    for rel in fresh:
        assert (released / "labs" / rel).read_bytes() == (ROOT / "labs" / rel).read_bytes(), (
            f"labs/{rel} differs from what `make release` makes from solutions/"
        )


@pytest.mark.parametrize("lab", LABS)
def test_release_leaks_nothing(lab):
    folder = ROOT / "labs" / lab
    files = [p.name for p in folder.rglob("*") if p.is_file()]
    assert files == [f"{lab}.ipynb"], f"run artefacts in the release: {files}"
    solutions = {
        nbgrader_meta(c)["grade_id"]: source_of(c)
        for c in _cells("solutions", lab)
        if is_solution(c)
    }
    for cell in _cells("labs", lab):
        src = source_of(cell)
        for marker in MARKERS:
            assert marker not in src, f"{marker} left in released cell {cell.get('id')}"
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [] and cell["execution_count"] is None
        gid = nbgrader_meta(cell).get("grade_id")
        if is_solution(cell):
            body = solutions[gid].split("### BEGIN SOLUTION")[1].split("### END SOLUTION")[0]
            for line in body.strip().splitlines():
                if line.strip() and not line.strip().startswith("#") and len(line.strip()) > 12:
                    assert line not in src, f"solution line leaked into {gid}: {line!r}"
        if is_test(cell):
            hidden = [
                c for c in _cells("solutions", lab) if nbgrader_meta(c).get("grade_id") == gid
            ][0]
            part = source_of(hidden).split("### BEGIN HIDDEN TESTS")
            if len(part) > 1:
                for line in part[1].split("### END HIDDEN TESTS")[0].strip().splitlines():
                    assert line not in src, f"hidden test leaked into {gid}: {line!r}"


@pytest.mark.parametrize("lab", LABS)
def test_cell_metadata_is_well_formed(lab):
    cells = _cells("solutions", lab)
    ids = [nbgrader_meta(c)["grade_id"] for c in cells if nbgrader_meta(c)]
    assert len(ids) == len(set(ids)), "duplicate grade_id"
    assert [c["id"] for c in cells] == [c.get("id") for c in _cells("labs", lab)]
    tests = [c for c in cells if is_test(c)]
    assert 3 <= len(tests) <= 6, f"{len(tests)} graded exercises; a lab has 3 to 6"
    written = [c for c in cells if is_written(c)]
    total = sum(nbgrader_meta(c)["points"] for c in tests + written)
    assert 15 <= total <= 25, f"{total} points; a lab is worth 15 to 25 (COURSE.md)"
    for cell in written:  # a written answer carries its model answer and rubric (source only)
        assert "### BEGIN SOLUTION" in source_of(cell) and nbgrader_meta(cell)["points"] > 0
    for cell in tests:
        meta = nbgrader_meta(cell)
        assert meta.get("points", 0) > 0, f"{meta['grade_id']} has no points"
        assert meta.get("locked"), f"{meta['grade_id']} is not locked"
    for cell in cells:
        if is_solution(cell):
            src = source_of(cell)
            assert "### BEGIN SOLUTION" in src and "### END SOLUTION" in src
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [] and cell["execution_count"] is None, (
                f"{cell['id']}: notebooks are committed without outputs"
            )


@pytest.mark.parametrize("lab", LABS)
def test_every_test_cell_has_an_out_of_kernel_exercise(lab):
    cells = _cells("solutions", lab)
    tests = {nbgrader_meta(c)["grade_id"] for c in cells if is_test(c)}
    solutions = {nbgrader_meta(c)["grade_id"] for c in cells if is_solution(c)}
    table = exercises(lab)
    assert tests == set(table), "test cells and ddp_lab.checks exercises disagree"
    for ex in table.values():
        assert set(ex.cells) <= solutions, f"{ex.grade_id} names unknown solution cells"
        src = source_of(next(c for c in cells if nbgrader_meta(c).get("grade_id") == ex.grade_id))
        assert f'hidden_test("{ex.grade_id}")' in src.split("### BEGIN HIDDEN TESTS")[-1], (
            f"{ex.grade_id}: its hidden part must call hidden_test({ex.grade_id!r})"
        )


# --- real autograde runs ---------------------------------------------------------------


def autograde_class(course: Path, lab: str, students, extra_args=(), jobs: int = 1) -> str:
    """``make autograde`` on ``course``; every temporary file (and so every grading
    process's command line) lives under ``course/tmp``, to find what survives.

    One submission at a time by default: ``make test`` runs two tests at once (2 cores).
    """
    submitted = course / "grading" / "submitted"
    sample_class.write_class(submitted, students=students, only_labs=[lab])
    (course / "tmp").mkdir(exist_ok=True)
    proc = run_tree(
        [
            sys.executable,
            "-m",
            "ddp_lab.grading.autograde",
            "--root",
            str(course),
            "--lab",
            lab,
            "--jobs",
            str(jobs),
            *extra_args,
        ],
        timeout=1200,
        env={"TMPDIR": str(course / "tmp")},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def cell_scores(course: Path, lab: str) -> dict[str, dict[str, float]]:
    from nbgrader.api import Gradebook

    with Gradebook(f"sqlite:///{course / 'grading' / 'gradebook.db'}") as gb:
        out = {}
        for sub in gb.find_assignment(lab).submissions:
            out[sub.student.id] = {g.name: g.score for nb in sub.notebooks for g in nb.grades}
        return out


@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("lab", LABS)
def test_autograde_scores_the_sample_class(released, lab, tmp_path):
    course = tmp_path / "course"
    shutil.copytree(released, course)
    # the copycat is a renamed copy of `perfect` (same points): its report is tested in
    # tests/test_integrity.py, grading it again would cost a minute and prove nothing new
    students = [s for s in sample_class.STUDENTS if sample_class.submits(s, lab) and s != "copycat"]
    # lab01 (one-process exercises: light) is graded 2 submissions at a time, like
    # `make autograde`; the other labs one at a time, beside the other test worker
    out = autograde_class(course, lab, students, jobs=2 if lab == LABS[0] else 1)
    print(out)
    got = cell_scores(course, lab)
    expected = sample_class.expected_scores(lab)
    for student in students:
        assert got[student] == expected[student], (
            f"{student} in {lab}: expected {expected[student]}, got {got[student]}"
        )
    for line in out.splitlines():
        if " s  graded" in line:
            seconds = float(line.split(" s  graded")[0].split()[-1])
            budget = PER_STUDENT_BUDGET_S * (2 if line.split()[0] == "hang" else 1)
            assert seconds < budget, f"grading took too long: {line}"
    # the solutions ran top to bottom without an error in any cell, graded or not
    perfect = load(course / "grading" / "autograded" / "perfect" / lab / f"{lab}.ipynb")
    for cell in perfect["cells"]:
        errors = [o for o in cell.get("outputs", []) if o["output_type"] == "error"]
        assert not errors, f"{cell.get('id')} raised in the solution notebook: {errors[0]}"
    # `make grades`: the CSV export holds every student's total
    export = run_tree(
        [NBGRADER, "export", "--to", "grades.csv", "--log-level=WARN"], cwd=str(course), timeout=120
    )
    assert export.returncode == 0, export.stderr[-2000:]
    problems = sample_class.compare(course / "grades.csv", only_labs=[lab])
    assert not problems, problems
    exported = {
        r["student_id"]
        for r in sample_class.read_rows(course / "grades.csv")
        if r["assignment"] == lab
    }
    assert exported == set(students), f"exported {sorted(exported)}, submitted {students}"
    # the typical mistakes lost their exercises for their own reasons (the verdicts are in
    # the autograded notebook, where the student's feedback comes from)
    wrong = load(course / "grading" / "autograded" / "mistake" / lab / f"{lab}.ipynb")
    said = {
        nbgrader_meta(c).get("grade_id"): json.dumps(c.get("outputs", [])) for c in wrong["cells"]
    }
    typical = {}
    for m in lab_answers(lab).MISTAKES:
        typical.setdefault(m.cell, m)
    for cell, m in typical.items():
        assert json.dumps(m.reason)[1:-1] in said[f"test_{cell}"], (
            cell,
            m.reason,
            said[f"test_{cell}"],
        )
    assert (course / "grading" / "integrity.csv").is_file()
    # students who ran into a resource limit read which one, in that exercise's feedback
    hit = {"hog": "memory limit", "forker": "processes at once", "scribbler": "larger than"}
    for kind, (cell, _, _) in sample_class.HOSTILE.items():
        if sample_class.submits(kind, lab):
            nb = load(course / "grading" / "autograded" / kind / lab / f"{lab}.ipynb")
            out = next(
                json.dumps(c["outputs"]) for c in nb["cells"] if c.get("id") == f"test_{cell}"
            )
            assert hit[kind] in out, (kind, out[-600:])
    # the cheater's edited test cells were restored from the source before grading
    if sample_class.submits("cheat", lab):
        cheated = load(course / "grading" / "autograded" / "cheat" / lab / f"{lab}.ipynb")
        source = {
            nbgrader_meta(c)["grade_id"]: source_of(c)
            for c in _cells("solutions", lab)
            if is_test(c)
        }
        for cell in cheated["cells"]:
            if is_test(cell):
                assert source_of(cell) == source[nbgrader_meta(cell)["grade_id"]]
    assert not leftover_processes(str(course)), "a process of the grading run survived"


def test_every_lab_whose_cheat_forges_files_is_graded_with_the_cheat():
    """The sample class's cheat grades CHEAT_LABS only; a lab whose cheat forges result files
    must be one of them (or its forged files are never graded)."""
    forging = [lab for lab in LABS if sample_class.forged_files_of(lab)]
    assert forging, "no lab forges files: the cheat's forged files are tested nowhere"
    assert set(forging) <= set(sample_class.CHEAT_LABS), forging
    assert set(sample_class.CHEAT_LABS) <= set(LABS), sample_class.CHEAT_LABS


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_autograde_on_a_fresh_clone_registers_the_labs_itself(released, tmp_path):
    """A fresh clone has no gradebook: `make autograde` puts the lab into it, then grades."""
    lab = LABS[0]
    course = tmp_path / "course"
    shutil.copytree(released, course)
    (course / "grading" / "gradebook.db").unlink()
    out = autograde_class(course, lab, ["blank"])
    assert f"{lab} is not in the gradebook yet" in out, out
    assert cell_scores(course, lab)["blank"] == sample_class.expected_scores(lab)["blank"]


def test_expected_grades_csv_is_up_to_date():
    """tests/expected_grades.csv (what `make autograde` must export for the sample class)
    says what the notebooks' points and the mistakes files say."""
    committed = sample_class.read_rows(sample_class.EXPECTED_CSV)
    assert committed == sample_class.expected_rows(), (
        "regenerate: python -m ddp_lab.grading.sample_class "
        "--write-expected tests/expected_grades.csv"
    )


def test_expected_grades_comparison_reports_a_wrong_score(tmp_path):
    rows = sample_class.expected_rows()
    rows[0] = {**rows[0], "score": "1"}
    path = tmp_path / "grades.csv"
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*sample_class.CSV_FIELDS, "raw_score"])
        writer.writeheader()
        writer.writerows(rows)
    problems = sample_class.compare(path)
    assert (
        len(problems) == 1 and f"expected {sample_class.expected_rows()[0]['score']}" in problems[0]
    )
    assert sample_class.compare(sample_class.EXPECTED_CSV) == []


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cheating_student_would_pass_an_in_kernel_grader(released, tmp_path):
    """Why verdicts come from outside: plain nbgrader gives the cheater points."""
    lab = LABS[0]
    course = tmp_path / "course"
    shutil.copytree(released, course)
    sample_class.write_class(course / "grading" / "submitted", students=["cheat"], only_labs=[lab])
    # nbgrader's own pipeline: the same config without the out-of-kernel verdicts
    config = course / "nbgrader_config.py"
    text = config.read_text()
    assert "    OutOfKernelVerdicts,\n" in text
    config.write_text(text.replace("    OutOfKernelVerdicts,\n", ""))
    proc = run_tree(
        [NBGRADER, "autograde", lab, "--create", "--force"], cwd=str(course), timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    scores = cell_scores(course, lab)["cheat"]
    print(f"cheat under an in-kernel grader: {sum(scores.values()):g} points: {scores}")
    assert sum(scores.values()) > 0, "the cheat does not even fool an in-kernel grader"
