"""The course environment is pinned, and pinned the same way everywhere."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _pyproject_pins() -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = project["dependencies"] + [
        r for v in project["optional-dependencies"].values() for r in v
    ]
    pins = {}
    for req in reqs:
        name, _, version = req.partition("==")
        assert version, f"{req} is not pinned with =="
        pins[name.lower()] = version
    return pins


def test_every_dependency_is_pinned_and_torch_is_the_course_version():
    pins = _pyproject_pins()
    assert pins["torch"] == "2.14.1" and pins["torchvision"] == "0.29.1"
    for tool in (
        "jupyterlab",
        "nbgrader",
        "nbclient",
        "matplotlib",
        "tqdm",
        "tensorboard",
        "pytest",
        "pytest-timeout",
        "pytest-xdist",
        "ruff",
    ):
        assert tool in pins, tool


def test_environment_yml_matches_pyproject():
    text = (ROOT / "environment.yml").read_text()
    conda = {m[0].lower(): m[1] for m in re.findall(r"-\s+([A-Za-z0-9_.-]+)==(\S+)", text)}
    assert conda == _pyproject_pins()


def test_constraints_agree_with_pyproject():
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    locked = {
        n.lower().replace("_", "-"): v
        for n, _, v in (line.partition("==") for line in lines if "==" in line)
    }
    for name, version in _pyproject_pins().items():
        assert locked.get(name.replace("_", "-")) == version, name


_GROUPED = """
import pytest


@pytest.hookimpl(tryfirst=True)  # as tests/conftest.py marks the suite's groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(pytest.mark.xdist_group(item.path.stem))
"""

_WORKER = """
import os


def test_{i}():
    with open("{out}", "a") as f:
        f.write(__name__ + " " + os.environ["PYTEST_XDIST_WORKER"] + "\\n")
"""


@pytest.mark.timeout(120)
def test_make_tests_groups_keep_a_group_on_one_worker(tmp_path):
    """`make test`'s --dist loadgroup holds: each group's tests run on one worker. pytest
    9.2.0 with pytest-xdist 3.8.0 drops the groups without a word (xdist marks a group in
    the nodeid's legacy field, which pytest 9.2 no longer reads: pytest-dev/pytest-xdist#1386),
    and every test then runs wherever a worker is free."""
    out = tmp_path / "seen.txt"
    (tmp_path / "conftest.py").write_text(_GROUPED)
    for module in ("test_a", "test_b"):
        body = "".join(_WORKER.format(i=i, out=out) for i in range(4))
        (tmp_path / f"{module}.py").write_text(body)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", *"-n 2 --dist loadgroup -q -p no:cacheprovider".split()]
        + [str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=100,
        env={**os.environ, "PYTEST_ADDOPTS": ""},
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    workers: dict[str, set[str]] = {}
    for line in out.read_text().splitlines():
        module, worker = line.split()
        workers.setdefault(module, set()).add(worker)
    assert workers.keys() == {"test_a", "test_b"}, workers
    assert all(len(w) == 1 for w in workers.values()), f"a group ran on two workers: {workers}"
