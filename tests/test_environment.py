"""The course environment is pinned, and pinned the same way everywhere."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

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
