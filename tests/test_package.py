"""The package's rooms: no import cycle, no file over 500 lines, and a kit part that never
reaches into the instructor's part (the grader, the answers, the benchmark)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "ddp_lab"
MAX_LINES = 500
INSTRUCTOR = ("ddp_lab.grading", "ddp_lab.answers", "ddp_lab.bench")


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The ddp_lab module an import name refers to (its longest existing prefix)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in MODULES:
            return candidate
        parts.pop()
    return None


def imports_of(module: str) -> set[str]:
    """ddp_lab modules ``module`` imports (anywhere in its code, lazy imports included)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names = [f"{base}.{a.name}" for a in node.names] or [base]
        for name in names:
            target = _resolve(name)
            if target and target != module and target != "ddp_lab":
                found.add(target)
    return found


GRAPH = {m: imports_of(m) for m in MODULES}


def _cycle() -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(GRAPH[m]):
            if state.get(n) == 1:
                return [*stack[stack.index(n) :], n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(GRAPH):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_cycle_inside_the_package():
    cycle = _cycle()
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle():
    GRAPH["ddp_lab.errors"].add("ddp_lab.dist")  # dist imports errors: a cycle now
    try:
        assert _cycle() is not None
    finally:
        GRAPH["ddp_lab.errors"].discard("ddp_lab.dist")


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_file_over_500_lines(module):
    lines = len(MODULES[module].read_text().splitlines())
    assert lines <= MAX_LINES, f"{MODULES[module]} has {lines} lines: split it where its ideas are"


def test_the_kit_part_never_imports_the_instructors_part():
    offenders = [
        f"{m} imports {n}"
        for m, targets in GRAPH.items()
        if not m.startswith(INSTRUCTOR)
        for n in targets
        if n.startswith(INSTRUCTOR)
    ]
    assert not offenders, offenders
