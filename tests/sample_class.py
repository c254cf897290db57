"""A sample class of students, made from the release and the solutions, for grading tests.

    python tests/sample_class.py grading/submitted      # what `make sample-class` runs

Students (one folder each, every lab in ``labs/``):

- ``perfect``: the solutions;
- ``blank``: the release as handed out;
- ``mistake``: the release with one typical wrong answer per exercise (``tests/mistakes.py``);
- ``hang``: the solutions, except that a distributed exercise deadlocks (labs with one);
- ``cheat``: the release with no-op stubs, a cell that monkeypatches every comparison and
  every public check function, test cells edited to print success, and result files
  forged where the lab writes any.

``expected_scores(lab)`` says what each student must score.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mistakes  # noqa: E402

from ddp_lab.grading.authoring import dumps  # noqa: E402
from ddp_lab.grading.notebook import is_solution, is_test, load, nbgrader_meta  # noqa: E402

STUDENTS = ("perfect", "blank", "mistake", "hang", "cheat")

CHEAT_CELL = """
# A student who wants the points without the work.
import numpy, torch, torch.testing, importlib, pkgutil, json
torch.allclose = lambda *a, **k: True
torch.equal = lambda *a, **k: True
torch.testing.assert_close = lambda *a, **k: None
numpy.allclose = lambda *a, **k: True
numpy.testing.assert_allclose = lambda *a, **k: None
import ddp_lab.checks
for info in pkgutil.iter_modules(ddp_lab.checks.__path__):
    mod = importlib.import_module("ddp_lab.checks." + info.name)
    for name in dir(mod):
        if not name.startswith("_") and callable(getattr(mod, name)):
            setattr(mod, name, lambda *a, **k: None)
for name in dir(ddp_lab.checks):
    if not name.startswith("_") and callable(getattr(ddp_lab.checks, name)):
        setattr(ddp_lab.checks, name, lambda *a, **k: None)
ddp_lab.checks.CheckFailed = type("Never", (Exception,), {})
try:
    import ddp_lab.grading.verdict as _v
    _v.judge_notebook = lambda *a, **k: {}
except Exception:
    pass
"""


def labs() -> list[str]:
    """The released labs (folder names under ``labs/``)."""
    return sorted(p.name for p in (ROOT / "labs").iterdir() if p.is_dir())


def _notebook(kind: str, lab: str) -> dict:
    folder = "solutions" if kind == "solution" else "labs"
    return load(ROOT / folder / lab / f"{lab}.ipynb")


def _replace_solutions(nb: dict, sources: dict[str, str]) -> dict:
    for cell in nb["cells"]:
        gid = nbgrader_meta(cell).get("grade_id")
        if is_solution(cell) and gid in sources:
            cell["source"] = sources[gid]
    return nb


def _strip_hidden_tests(nb: dict) -> dict:
    """A submission never holds hidden tests: start from the solutions, drop the tests' text."""
    release = {
        nbgrader_meta(c).get("grade_id"): c for c in _notebook("release", nb["_lab"])["cells"]
    }
    for cell in nb["cells"]:
        gid = nbgrader_meta(cell).get("grade_id")
        if is_test(cell) and gid in release:
            cell["source"] = release[gid]["source"]
    return nb


def make_student(kind: str, lab: str) -> tuple[dict, dict[str, str]] | None:
    """The notebook (and extra files) a student of ``kind`` submits, or None (no submission)."""
    if kind == "perfect":
        nb = _notebook("solution", lab)
        return _strip_hidden_tests({**nb, "_lab": lab}), {}
    if kind == "blank":
        return _notebook("release", lab), {}
    if kind == "mistake":
        return _replace_solutions(_notebook("release", lab), mistakes.MISTAKES[lab]), {}
    if kind == "hang":
        hang = mistakes.HANGS.get(lab)
        nb = _strip_hidden_tests({**_notebook("solution", lab), "_lab": lab})
        return (_replace_solutions(nb, hang) if hang else nb), {}
    if kind == "cheat":
        nb = _notebook("release", lab)
        for cell in nb["cells"]:
            if is_solution(cell):
                src = (
                    "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
                )
                cell["source"] = src.replace("raise NotImplementedError()", "pass")
        first_test = next(i for i, c in enumerate(nb["cells"]) if is_test(c))
        nb["cells"].insert(
            first_test,
            {
                "cell_type": "code",
                "execution_count": None,
                "id": "cheat",
                "metadata": {},
                "outputs": [],
                "source": CHEAT_CELL.strip(),
            },
        )
        return nb, dict(mistakes.FORGED_FILES.get(lab, {}))
    raise ValueError(kind)


def write_class(submitted: Path, students=STUDENTS, only_labs: list[str] | None = None) -> None:
    """Write ``submitted/<student>/<lab>/<lab>.ipynb`` (and forged files) for the class."""
    for lab in only_labs or labs():
        for kind in students:
            made = make_student(kind, lab)
            if made is None:
                continue
            nb, files = made
            nb.pop("_lab", None)
            folder = submitted / kind / lab
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"{lab}.ipynb").write_text(dumps(nb))
            for name, text in files.items():
                (folder / name).write_text(text)


def max_points(lab: str) -> dict[str, float]:
    """``test grade_id -> points`` of a lab."""
    return {
        nbgrader_meta(c)["grade_id"]: float(nbgrader_meta(c)["points"])
        for c in _notebook("solution", lab)["cells"]
        if is_test(c)
    }


def expected_scores(lab: str) -> dict[str, dict[str, float]]:
    """``student -> {test grade_id -> points}`` each student must get in ``lab``."""
    full = max_points(lab)
    zero = dict.fromkeys(full, 0.0)
    hang = dict(full)
    for gid in mistakes.HANG_LOSES.get(lab, ()):
        hang[gid] = 0.0
    return {"perfect": full, "blank": zero, "mistake": zero, "hang": hang, "cheat": zero}


if __name__ == "__main__":
    target = Path(sys.argv[1] if len(sys.argv) > 1 else "grading/submitted")
    write_class(target)
    print(
        json.dumps(
            {lab: {s: sum(v.values()) for s, v in expected_scores(lab).items()} for lab in labs()},
            indent=1,
        )
    )
    print(f"wrote {', '.join(STUDENTS)} into {target}/")
