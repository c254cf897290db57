"""The GPU check script stays runnable where it is meant to run (a GPU machine whose plain
``python3`` has torch but no nbgrader, no venv, maybe no torchvision): checked here on the
CPU, without a GPU. Its Python compiles and its bash parses; what it imports loads with
nbgrader, torchvision and the instructor's part blocked; and on a machine without a GPU it
stops at once with one clear line."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from _harness import run_tree

GPU = Path(__file__).resolve().parent
SCRIPTS = sorted(p for p in GPU.glob("*.py") if not p.name.startswith("test_"))

# Run in a fresh interpreter: refuse the modules a GPU machine may lack, then import what the
# GPU scripts import and run the preflight (it imports the trainer and picks the model).
BLOCKED = r"""
import runpy, sys
for name in ("nbgrader", "torchvision", "jupyter", "notebook", "ddp_lab.grading",
             "ddp_lab.answers"):
    sys.modules[name] = None  # import fails, find_spec says absent: as if not installed
for module in sys.argv[1:]:
    __import__(module)
from ddp_lab.models import build_model
build_model("cnn")
sys.argv = ["checks.py", "--preflight"]
runpy.run_path("tests/gpu/checks.py", run_name="__main__")
"""


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
    return found - {"__future__"}


def test_gpu_scripts_compile_and_parse():
    assert SCRIPTS, "no Python files in tests/gpu"
    for path in SCRIPTS:
        proc = run_tree([sys.executable, "-m", "py_compile", str(path)], timeout=60)
        assert proc.returncode == 0, proc.stderr
    proc = run_tree(["bash", "-n", str(GPU / "run.sh")], timeout=30)
    assert proc.returncode == 0, proc.stderr


def test_gpu_imports_need_no_nbgrader_torchvision_or_answers():
    modules = sorted(set().union(*map(_imports, SCRIPTS)) | {"ddp_lab.bench", "ddp_lab.train"})
    proc = run_tree([sys.executable, "-c", BLOCKED, *modules], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["0", "cnn"], proc.stdout  # no GPU here; cnn w/o torchvision
    assert "trainer and bench runs use the cnn (resnet18 needs torchvision)" in proc.stderr


def test_run_sh_without_a_gpu_says_so_and_stops(tmp_path):
    """Called from elsewhere (it finds the repository itself): the preflight line, then one
    FAIL line; a missing Python is one line too."""
    script = str(GPU / "run.sh")
    proc = run_tree(["bash", script], env={"PY": sys.executable}, cwd=str(tmp_path), timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "FAIL no CUDA GPU visible" in proc.stdout and ", torch " in proc.stderr, out
    proc = run_tree(["bash", script], env={"PY": "/nonexistent/python"}, timeout=30)
    assert proc.returncode == 1 and "FAIL no Python at /nonexistent/python" in proc.stdout
