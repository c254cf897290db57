"""``make student-kit``: what students get, built from this (the instructor's) repository.

``python -m ddp_lab.grading.kit [--out DIR] [--root DIR]`` writes ``DIR/ddp-lab-student-kit/``
and ``DIR/ddp-lab-student-kit.tar.gz`` (default ``DIR``: ``dist/``), holding

- ``labs/``: the released notebooks only (no solution, no hidden test, no output);
- ``ddp_lab/``: the runtime part of the package (what the notebooks, their visible checks,
  ``make lab3`` and the trainer use), that is everything but :data:`INSTRUCTOR_ONLY`;
- ``cluster/``: the SLURM templates;
- ``README.md``, ``Makefile``, ``nbgrader_config.py`` for students (``kit_files/``), the
  pins (``pyproject.toml``, ``constraints.txt``) and a student ``environment.yml``.

No nbgrader exchange: a student has one working copy of each lab, in ``labs/``, and
``make submit`` hands in that copy.

Then it checks the kit (:func:`leaks`) and refuses to finish when it finds any of: a file
of ``solutions/``, ``tests/`` or the instructor-only part (by path or by content); a kit
module importing the instructor-only part; a solution region of any lab, or a reference
function of ``ddp_lab/answers``, inside a kit file (token-normalised fingerprints,
:mod:`ddp_lab.grading.integrity`: renamed variables and reformatting do not hide a copy); a
line of a hidden test.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import shutil
import sys
import tarfile
from pathlib import Path

from ddp_lab.grading import integrity
from ddp_lab.grading.notebook import load, nbgrader_meta, solution_sources, source_of

PROG = "ddp_lab.grading.kit"
KIT_NAME = "ddp-lab-student-kit"
#: Parts of the package students never get: the grader, the answers, the benchmark.
INSTRUCTOR_ONLY = ("ddp_lab/grading", "ddp_lab/answers", "ddp_lab/bench.py")
#: Modules a kit module may not import.
INSTRUCTOR_MODULES = ("ddp_lab.grading", "ddp_lab.answers", "ddp_lab.bench")
#: A solution region (or reference function) whose fingerprints a kit file holds at this
#: share or more is a leak. Unrelated code shares well under 0.1 with a solution region.
LEAK_AT = 0.25
#: Top-level files copied as they are.
COPIED = ("pyproject.toml", "constraints.txt", "LICENSE")
#: Pins students do not need (developer tools).
DEV_ONLY = ("playwright", "pytest", "pytest-timeout", "pytest-xdist", "ruff")
#: The kit's own README, Makefile and nbgrader config, relative to the repository root.
FILES = Path("ddp_lab") / "grading" / "kit_files"
_SKIP_PARTS = {"__pycache__", ".ipynb_checkpoints"}


def _instructor_only(rel: Path) -> bool:
    text = rel.as_posix()
    return any(text == p or text.startswith(p + "/") for p in INSTRUCTOR_ONLY)


def runtime_files(root: Path) -> list[Path]:
    """The package files that go into the kit, relative to ``root``."""
    out = []
    for path in sorted((root / "ddp_lab").rglob("*")):
        rel = path.relative_to(root)
        if path.is_file() and not _SKIP_PARTS & set(rel.parts) and not _instructor_only(rel):
            if path.suffix in (".py", ".md", ".json", ".typed"):
                out.append(rel)
    return out


def labs(root: Path) -> list[str]:
    """The released labs (folders of ``labs/``)."""
    return sorted(p.name for p in (root / "labs").iterdir() if p.is_dir())


def _student_environment(root: Path) -> str:
    lines = (root / "environment.yml").read_text().splitlines()
    keep = [ln for ln in lines if not any(f"- {tool}==" in ln for tool in DEV_ONLY)]
    keep = [ln.replace("&& pip install -e .", "&& make jupyter-setup") for ln in keep]
    return "\n".join(keep) + "\n"


def build(root: Path, out: Path) -> Path:
    """Write the kit folder (replacing an old one) and its archive; return the folder."""
    kit = out / KIT_NAME
    if kit.exists():
        shutil.rmtree(kit)
    kit.mkdir(parents=True)
    for rel in runtime_files(root):
        (kit / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, kit / rel)
    for lab in labs(root):
        notebook = root / "labs" / lab / f"{lab}.ipynb"
        (kit / "labs" / lab).mkdir(parents=True)
        shutil.copy2(notebook, kit / "labs" / lab / notebook.name)
    if (root / "cluster").is_dir():
        shutil.copytree(root / "cluster", kit / "cluster")
    for name in COPIED:
        shutil.copy2(root / name, kit / name)
    for template in ("README.md", "Makefile", "nbgrader_config.py"):
        shutil.copy2(root / FILES / template, kit / template)
    (kit / "environment.yml").write_text(_student_environment(root))
    archive = out / f"{KIT_NAME}.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(kit, arcname=KIT_NAME)
    return kit


# --- the leak check ----------------------------------------------------------------------


def _kit_texts(kit: Path) -> dict[str, str]:
    """``relative path -> text`` of every kit file but the released notebooks."""
    out = {}
    for path in sorted(kit.rglob("*")):
        rel = path.relative_to(kit)
        if not path.is_file() or path.suffix == ".ipynb" or path.name.endswith(".tar.gz"):
            continue
        try:
            out[rel.as_posix()] = path.read_text()
        except UnicodeDecodeError:
            continue
    return out


def _imports(source: str) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names += [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
    return names


def _given(lab_notebook: dict) -> set[int]:
    """Fingerprints of everything a released notebook gives students (all its cells)."""
    prints: set[int] = set()
    for cell in lab_notebook["cells"]:
        if cell["cell_type"] == "code":
            prints |= integrity.fingerprints(source_of(cell))
    return prints


def _body(text: str, node: ast.FunctionDef | ast.ClassDef) -> str:
    """A function's or class's code without its signature and docstring: what it *does*
    (a shared signature, ``def f(n: int, rank: int) -> list[int]``, is no leak)."""
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    return "\n".join(ast.get_source_segment(text, stmt) or "" for stmt in body)


def _reference_functions(root: Path) -> dict[str, str]:
    """``file:function -> body`` of every public top-level function and class of the
    answers' reference modules (private helpers such as ``_rank_and_size`` are plumbing
    that any distributed code shares, not an exercise's answer)."""
    out = {}
    for path in sorted((root / "ddp_lab" / "answers").rglob("references*.py")):
        text = path.read_text()
        for node in ast.parse(text).body:
            public = not node.name.startswith("_") if hasattr(node, "name") else False
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and public:
                out[f"{path.relative_to(root)}:{node.name}"] = _body(text, node)
    return out


def leaks(kit: Path, root: Path) -> list[str]:
    """Everything in ``kit`` that a student must not get (``[]``: none).

    Args:
        kit: the kit folder.
        root: the instructor's repository it was built from.
    """
    problems = []
    texts = _kit_texts(kit)
    for rel in texts:
        if rel.split("/")[0] in ("solutions", "tests") or _instructor_only(Path(rel)):
            problems.append(f"{rel}: an instructor's file is in the kit")
    digests = {hashlib.sha256(t.encode()).hexdigest(): r for r, t in texts.items() if t.strip()}
    private = [*INSTRUCTOR_ONLY, "solutions", "tests"]
    for part in private:
        base = root / part
        for path in [base] if base.is_file() else sorted(base.rglob("*.py")):
            if not path.is_file() or (root / FILES) in path.parents or not path.read_text().strip():
                continue
            digest = hashlib.sha256(path.read_text().encode()).hexdigest()
            if digest in digests:
                problems.append(f"{digests[digest]}: a copy of {path.relative_to(root)}")
    for rel, text in texts.items():
        if rel.endswith(".py"):
            for name in sorted({n for n in _imports(text) if n.startswith(INSTRUCTOR_MODULES)}):
                problems.append(f"{rel}: imports {name}, which the kit does not have")
    prints = {rel: integrity.fingerprints(text) for rel, text in texts.items()}
    for lab in labs(root):
        source = load(root / "solutions" / lab / f"{lab}.ipynb")
        given = _given(load(root / "labs" / lab / f"{lab}.ipynb"))
        for cell, text in solution_sources(source).items():
            region = integrity.without(
                integrity.fingerprints(integrity.solution_region(text)), [given]
            )
            for rel, fp in prints.items():
                share = integrity.containment(region, fp)
                if share >= LEAK_AT:
                    problems.append(f"{rel}: holds {share:.0%} of the solution of {lab} {cell}")
        for cell in source["cells"]:
            hidden = source_of(cell).split("### BEGIN HIDDEN TESTS")
            if len(hidden) < 2 or not nbgrader_meta(cell).get("grade"):
                continue
            for line in hidden[1].split("### END HIDDEN TESTS")[0].splitlines():
                if len(line.strip()) > 12:
                    for rel, text in texts.items():
                        if line.strip() in text:
                            problems.append(f"{rel}: holds a hidden test line of {lab}")
    for name, text in _reference_functions(root).items():
        ref = integrity.fingerprints(text)
        for rel, fp in prints.items():
            share = integrity.containment(ref, fp)
            if share >= LEAK_AT:
                problems.append(f"{rel}: holds {share:.0%} of the reference {name}")
    return list(dict.fromkeys(problems))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--root", default=".", help="the instructor's repository (default: here)")
    p.add_argument("--out", default="dist", help="where the kit folder and archive go")
    args = p.parse_args(argv)
    root = Path(args.root).resolve()
    kit = build(root, Path(args.out).resolve())
    problems = leaks(kit, root)
    files = [f for f in kit.rglob("*") if f.is_file()]
    size = sum(f.stat().st_size for f in files)
    if problems:
        for line in problems:
            print(f"{PROG}: LEAK {line}", file=sys.stderr)
        print(
            f"{PROG}: the kit is not fit for students ({len(problems)} problems)", file=sys.stderr
        )
        return 1
    print(f"{PROG}: {kit} ({len(files)} files, {size / 1e6:.1f} MB) and {kit}.tar.gz: no leaks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
