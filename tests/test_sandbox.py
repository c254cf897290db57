"""The grading sandbox: student code sees the course read-only, without its answers, without
other students' work and without the gradebook; its own folder stays writable."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ddp_lab.grading import sandbox

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="mount namespaces are Linux-only"
)

PROBE = r"""
import os, sys
from pathlib import Path
root = Path(sys.argv[1])
def can_read(p):
    try:
        return Path(p).read_text() != ""
    except OSError:
        return False
def can_write(p):
    try:
        Path(p).write_text("x")
    except OSError:
        return False
    return True
import ddp_lab
pkg = Path(ddp_lab.__file__).resolve().parent
report = {
    "solution": can_read(root / "solutions/lab/lab.ipynb"),
    "peer_submitted": can_read(root / "grading/submitted/peer/lab/lab.ipynb"),
    "peer_autograded": can_read(root / "grading/autograded/peer/lab/lab.ipynb"),
    "gradebook_read": can_read(root / "grading/gradebook.db"),
    "gradebook_write": can_write(root / "grading/gradebook.db"),
    "course_write": can_write(root / "labs/new.py"),
    "package_write": can_write(pkg / "__sandbox_probe__"),
    "own_read": can_read("lab.ipynb"),
    "own_write": can_write("result.json"),
    "tmp_write": can_write(Path(os.environ.get("TMPDIR", "/tmp")) / f"probe-{os.getpid()}"),
}
print(report)
"""


def _course(tmp_path):
    root = tmp_path / "course"
    files = {
        "nbgrader_config.py": "",
        "solutions/lab/lab.ipynb": "the answers",
        "labs/lab/lab.ipynb": "the release",
        "grading/gradebook.db": "grades",
        "grading/submitted/peer/lab/lab.ipynb": "peer's work",
        "grading/autograded/peer/lab/lab.ipynb": "peer's work",
        "grading/autograded/me/lab/lab.ipynb": "my work",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def _probe(root, confined=True):
    own = root / "grading/autograded/me/lab"
    cmd = [sys.executable, "-c", PROBE, str(root)]
    cmd = sandbox.confine(cmd, roots=[root], keep=[own]) if confined else cmd
    proc = subprocess.run(cmd, cwd=own, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return eval(proc.stdout.strip().splitlines()[-1])  # a dict of booleans we printed


def test_sandbox_is_available_here():
    assert sandbox.available(), "no mount namespace: `unshare -m` (root) or `unshare -rm` failed"


def test_confined_code_sees_no_answers_and_writes_only_its_folder(tmp_path):
    root = _course(tmp_path)
    got = _probe(root)
    try:
        assert got == {
            "solution": False,
            "peer_submitted": False,
            "peer_autograded": False,
            "gradebook_read": False,
            "gradebook_write": True,  # into /dev/null: the real gradebook is untouched
            "course_write": False,
            "package_write": False,
            "own_read": True,
            "own_write": True,
            "tmp_write": True,
        }
    finally:
        probe = sandbox.PACKAGE_DIR / "__sandbox_probe__"
        probe.unlink(missing_ok=True)
    assert (root / "grading/gradebook.db").read_text() == "grades"
    assert (root / "grading/autograded/me/lab/result.json").read_text() == "x"
    assert not (root / "labs/new.py").exists()


def test_unconfined_code_could_do_all_of_it(tmp_path):
    # the probe is able to tell: without the sandbox every answer is readable
    root = _course(tmp_path)
    got = _probe(root, confined=False)
    (sandbox.PACKAGE_DIR / "__sandbox_probe__").unlink(missing_ok=True)
    assert got["solution"] and got["peer_autograded"] and got["gradebook_read"]
    assert got["course_write"] and got["package_write"]


def test_switched_off_it_leaves_the_command_alone(monkeypatch):
    monkeypatch.setenv(sandbox.ENV_SWITCH, "off")
    assert not sandbox.available()
    assert sandbox.confine(["true"]) == ["true"]


def test_a_failing_mount_is_a_clear_error_not_an_unconfined_run(tmp_path):
    cmd = sandbox.confine(["true"], roots=[tmp_path / "missing"])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 70 and "cannot confine" in proc.stderr, proc.stderr
