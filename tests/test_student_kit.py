"""``make student-kit``: what students get holds everything they need and no answer.

- the kit built from this tree holds no file of ``solutions/``, ``tests/`` or the
  instructor's part of the package, no kit module imports that part, and no kit file holds a
  solution region or a reference function, even with renamed variables (the measure of
  ``ddp_lab.grading.integrity``), nor a hidden test line;
- built from a fresh clone, the kit installs into its own venv with its own install
  command; there every released notebook's setup cell imports, and one visible test cell per
  lab runs and fails on the stub with its friendly message; JupyterLab shows the Validate
  button but not the instructor's tools (formgrader, create assignment, course list) nor
  the Assignment List (students work in ``labs/``; ``make submit`` hands in that copy);
- in that kit's JupyterLab, driven in headless Chromium, lab 1's first check on the stub and
  on a wrong answer shows one readable message (no frame of the checker), and Validate lists
  that failure whole.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from _harness import ROOT, run_tree

from ddp_lab.grading import kit

SMOKE = r"""
import json, sys, traceback
from pathlib import Path

lab = sys.argv[1]
nb = json.loads(Path(f"{lab}.ipynb").read_text())
cells = {c.get("id"): "".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"}
first = next(c["id"] for c in nb["cells"]  # the first exercise (not a written answer)
             if c["cell_type"] == "code"
             and c.get("metadata", {}).get("nbgrader", {}).get("solution"))
ns = {"__name__": "__main__"}

def run(source):
    lines = source.split("\n")
    if lines[0].startswith("%%writefile"):
        Path(lines[0].split()[-1]).write_text("\n".join(lines[1:]))
        return
    code = "\n".join("" if l.lstrip().startswith(("%", "!")) else l for l in lines)
    exec(compile(code, "<cell>", "exec"), ns)

out = {}
try:
    run(cells["setup"])
    out["setup"] = "ok"
    run(cells[first])
    run(cells["test_" + first])
    out["check"] = "passed on the stub"
except Exception as err:
    out.setdefault("setup", f"{type(err).__name__}: {err}")
    out["check"] = f"{type(err).__name__}: {err}"
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    return kit.build(ROOT, tmp_path_factory.mktemp("dist"))


def test_the_kit_holds_no_answer(built):
    assert kit.leaks(built, ROOT) == []


def test_the_kit_holds_what_students_need_and_nothing_of_the_instructors(built):
    files = {p.relative_to(built).as_posix() for p in built.rglob("*") if p.is_file()}
    for need in (
        "README.md",
        "Makefile",
        "pyproject.toml",
        "constraints.txt",
        "environment.yml",
        "nbgrader_config.py",
        "LICENSE",
        "ddp_lab/train.py",
        "ddp_lab/workloads/lab3.py",
        "ddp_lab/launch/__init__.py",
        "ddp_lab/checks/runner.py",
        "cluster/lab3.sbatch",
    ):
        assert need in files, f"{need} is missing from the kit"
    for lab in kit.labs(ROOT):
        assert f"labs/{lab}/{lab}.ipynb" in files
    assert not [
        f
        for f in files
        if f.startswith(("solutions/", "tests/", "ddp_lab/grading/", "ddp_lab/answers/"))
        or f == "ddp_lab/bench.py"
    ]
    readme = (built / "README.md").read_text()
    for words in ("make install", "make lab", "make lab3", "make submit"):
        assert words in readme, f"the student README does not explain `{words}`"
    assert "pytest" not in (built / "environment.yml").read_text()
    with tarfile.open(built.parent / f"{kit.KIT_NAME}.tar.gz") as tar:
        assert len([m for m in tar.getmembers() if m.isfile()]) == len(files)


def test_the_leak_check_finds_a_planted_answer_under_new_names(built, tmp_path):
    import shutil

    from _harness import solution_sources

    copy = tmp_path / "kit"
    shutil.copytree(built, copy)
    answer = solution_sources("lab01_data_parallel")["ex4_combine_shard_stats"]
    renamed = answer.replace("means", "mu").replace("counts", "k").replace("variances", "s2")
    (copy / "ddp_lab" / "helpers.py").write_text("# handy\n" + renamed)
    (copy / "ddp_lab" / "figures" / "extra.py").write_text("from ddp_lab.answers import lab01\n")
    problems = kit.leaks(copy, ROOT)
    assert any("helpers.py" in p and "ex4_combine_shard_stats" in p for p in problems), problems
    assert any("extra.py: imports ddp_lab.answers" in p for p in problems), problems


@pytest.fixture(scope="module")
def fresh_kit(tmp_path_factory) -> Path:
    """The kit built from a fresh clone of this repository and installed with its own
    ``make install``, once per test run (a few minutes): the tests below share it, also
    when xdist runs them on two workers at once (the second waits on a lock for the first
    one's install, then finds its marker file)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # shared by the workers of this run
    tmp = root / "fresh-kit"
    student = tmp / kit.KIT_NAME
    with open(root / "fresh-kit.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (tmp / "installed").is_file():
            _install_fresh_kit(tmp)
    return student


def _install_fresh_kit(tmp: Path) -> None:
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    clone = tmp / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    made = run_tree(
        [sys.executable, "-m", "ddp_lab.grading.kit", "--root", str(clone), "--out", str(tmp)],
        timeout=120,
    )
    assert made.returncode == 0, made.stdout + made.stderr
    student = tmp / kit.KIT_NAME
    base = Path(sys.base_prefix) / "bin" / "python3"
    install = run_tree(["make", "-C", str(student), "install", f"PYTHON={base}"], timeout=1200)
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    assert "BuildBackendWarning" not in install.stderr, "the first install is not clean"
    (tmp / "installed").write_text("make install finished\n")


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_a_kit_from_a_fresh_clone_installs_and_runs_the_labs(fresh_kit):
    student = fresh_kit
    bin_ = student / ".venv" / "bin"
    lab_ext = run_tree([str(bin_ / "jupyter"), "labextension", "list"], timeout=120)
    listing = lab_ext.stdout + lab_ext.stderr
    for hidden in ("formgrader", "create-assignment", "course-list", "assignment-list"):
        assert f"@jupyter/nbgrader:{hidden}" in listing, listing  # listed as disabled
    server = run_tree([str(bin_ / "jupyter"), "server", "extension", "list"], timeout=120)
    text = server.stdout + server.stderr
    for name, state in (
        ("formgrader", "disabled"),
        ("validate_assignment", "enabled"),
        ("assignment_list", "disabled"),
    ):
        line = next(ln for ln in text.splitlines() if f"nbgrader.server_extensions.{name} " in ln)
        assert state in line, line
    assert not (student / ".exchange").exists(), "one working copy per lab: labs/, no exchange"
    for lab in kit.labs(student):
        folder = student / "labs" / lab
        run = run_tree([str(bin_ / "python"), "-c", SMOKE, lab], timeout=300, cwd=str(folder))
        line = next((ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")), None)
        assert line, run.stdout[-2000:] + run.stderr[-2000:]
        result = json.loads(line[len("RESULT ") :])
        assert result["setup"] == "ok", (lab, result)
        assert (
            result["check"].startswith("CheckFailed")
            and "finish this exercise first" in (result["check"])
        ), (lab, result)


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_a_student_sees_one_readable_message_in_jupyterlab(fresh_kit, tmp_path):
    from _browser import student_session

    with student_session(fresh_kit, tmp_path) as seen:
        stub, wrong, dialog, menu = seen.stub, seen.wrong, seen.validate, seen.menu

    def flat(text: str) -> str:  # the message as one line (the notebook wraps it)
        return " ".join(text.split())

    for output in (stub, wrong):
        assert output.startswith("CheckFailed: split_batch"), output
        assert "Traceback" not in output and "ddp_lab/checks" not in output, output
        assert max(map(len, output.splitlines())) <= 80, output  # Validate cuts longer lines
    assert "finish this exercise first" in flat(stub), stub
    assert "finish this exercise first" not in flat(wrong), wrong
    assert "The following cell failed" in dialog and flat(wrong) in flat(dialog), dialog
    assert "ddp_lab/checks" not in dialog and "Traceback" not in dialog, dialog
    for hidden in ("Formgrader", "Assignment List", "Course List"):
        assert hidden not in menu, menu
    assert (seen.formgrader, seen.assignment_list) == (404, 404)
