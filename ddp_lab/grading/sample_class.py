"""A sample class of students, made from the release and the solutions: try the grading
workflow on a new machine, and test it.

Run from the course root (an instructor's checkout)::

    python -m ddp_lab.grading.sample_class grading/submitted        # `make sample-class`
    make autograde && make grades
    python -m ddp_lab.grading.sample_class --compare grading/grades.csv
    python -m ddp_lab.grading.sample_class --write-expected tests/expected_grades.csv

Students (one folder each, every lab in ``labs/``):

- ``perfect``: the solutions;
- ``blank``: the release as handed out;
- ``mistake``: the release with one typical wrong answer per exercise (the first of each
  exercise in ``ddp_lab/answers/labNN/mistakes.py``);
- ``hang``: the solutions, except that a distributed exercise deadlocks (``HANG_LABS``);
- ``copycat``: a classmate's (``perfect``'s) notebook with its local variables renamed and
  its layout changed: full marks, and flagged by the integrity report of ``make autograde``
  (:mod:`ddp_lab.grading.integrity`) together with the classmate;
- ``hog``, ``forker``, ``scribbler`` (``HOSTILE_LABS`` only): the solutions, except that one
  exercise also allocates twice the memory limit, starts processes in a loop (at most a few
  thousand), or writes a file twice the size limit (``ddp_lab.grading.limits``): each loses
  that exercise's points with a clear message, and nobody else loses anything;
- ``cheat`` (``CHEAT_LABS`` only): the release with no-op stubs that try to copy the
  instructor's answers from ``solutions/`` at run time, a cell that monkeypatches every
  comparison and every public check function, test cells edited to print success, and
  result files forged where the lab writes any.

``expected_scores(lab)`` says what each student must score.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

from ddp_lab.answers import lab_answers, typical
from ddp_lab.grading.authoring import dumps
from ddp_lab.grading.notebook import is_solution, is_test, is_written, load, nbgrader_meta

#: The course root: the folder that holds ``labs/`` and ``solutions/`` next to ``ddp_lab``.
ROOT = Path(__file__).resolve().parents[2]

STUDENTS = ("perfect", "blank", "mistake", "hang", "cheat", "copycat", "hog", "forker", "scribbler")
#: Whom the copycat copies.
COPIED_FROM = "perfect"
# The hang student submits this lab only (a ring all-reduce whose torchrun job deadlocks):
# the timeout path is the same for every lab, and each hang costs a full exercise timeout.
# A deadlock is also tested directly in tests/test_lab02.py and tests/test_lab04.py.
HANG_LABS = ("lab02_collectives",)
# The hostile students submit this lab only (its exercises run in one process: quick).
HOSTILE_LABS = ("lab01_data_parallel",)
#: hostile student -> (solution cell it spoils, its function, what the function does first)
HOSTILE = {
    "hog": (
        "ex1_split_batch",
        "split_batch",
        """import resource, torch
    soft = resource.getrlimit(resource.RLIMIT_DATA)[0]
    limit = soft if soft != resource.RLIM_INFINITY else 4 * 1024**3
    hoard = torch.ones(2 * limit // 4)  # twice the memory limit (float32)""",
    ),
    "forker": (
        "ex2_data_parallel_step",
        "data_parallel_step",
        """import subprocess
    children = [subprocess.Popen(["sleep", "30"]) for _ in range(3000)]  # bounded""",
    ),
    "scribbler": (
        "ex3_data_parallel_forward",
        "data_parallel_forward",
        """import resource
    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    size = 2 * soft if soft != resource.RLIM_INFINITY else 512 * 1024**2
    with open("scribble.log", "wb") as f:
        for _ in range(size // 2**20 + 1):
            f.write(b"x" * 2**20)""",
    ),
}
# The cheat submits these labs only: functions the grader runs in one process (lab 1), files
# that every rank runs (labs 2 and 3), and the labs whose cheat forges result files (2 and
# 3, ``FORGED_FILES``; tests/test_grading.py requires every such lab here). The rest of what
# it tries (the solutions read at run time, comparisons and checks monkeypatched in the
# kernel, test cells edited) meets the same sandbox, the same out-of-kernel verdicts and the
# same restored test cells in every lab; labs 4-9 cost about a minute of CI each to show it
# again.
CHEAT_LABS = ("lab01_data_parallel", "lab02_collectives", "lab03_ddp")
#: Students who submit only some labs.
ONLY_IN = {
    "hang": HANG_LABS,
    "cheat": CHEAT_LABS,
    **dict.fromkeys(HOSTILE, HOSTILE_LABS),
}


def submits(student: str, lab: str) -> bool:
    """Whether ``student`` of the sample class submits ``lab``."""
    return lab in ONLY_IN.get(student, (lab,))


def hostile(kind: str, lab: str) -> dict:
    """The notebook of a hostile student: the solutions, one function doing harm first."""
    cell, name, harm = HOSTILE[kind]
    nb = _strip_hidden_tests({**_notebook("solution", lab), "_lab": lab})
    for c in nb["cells"]:
        if nbgrader_meta(c).get("grade_id") == cell:
            src = "".join(c["source"]) if isinstance(c["source"], list) else c["source"]
            c["source"] = (
                src.rstrip("\n")
                + f"\n\n\n_honest_{name} = {name}\n\n\ndef {name}(*args, **kwargs):\n"
                + f"    {harm}\n    return _honest_{name}(*args, **kwargs)\n"
            )
    return nb


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


# Copies the instructor's answer for this cell from solutions/ (next to the ddp_lab package)
# at run time; does nothing when that fails. The grading sandbox hides solutions/.
STEAL = """
try:
    import json as _json, pathlib as _pl, ddp_lab as _d
    _nb = _json.loads(
        (_pl.Path(_d.__file__).resolve().parents[1] / "solutions" / {lab!r} / {nb!r}).read_text()
    )
    _meta = lambda c: c.get("metadata", {{}}).get("nbgrader", {{}})
    _src = "".join(next(c["source"] for c in _nb["cells"] if _meta(c).get("grade_id") == {gid!r}))
    exec(_src.split("\\n", 1)[1] if _src.startswith("%%writefile") else _src)
except Exception:
    pass
"""


def steal(lab: str, gid: str, stub: str) -> str:
    """The cheat's version of a solution cell: the released stub made a no-op, then an
    attempt to run the instructor's cell over it."""
    noop = stub.replace("raise NotImplementedError()", "pass")
    return (
        noop.rstrip("\n") + "\n" + STEAL.format(lab=lab, nb=f"{lab}.ipynb", gid=gid).strip() + "\n"
    )


def _answers_attr(lab: str, name: str, default):
    module = lab_answers(lab)
    return getattr(module, name, default) if module is not None else default


def mistakes_of(lab: str) -> dict[str, str]:
    """``cell -> source`` of the typical mistake of each exercise of ``lab``."""
    return typical(_answers_attr(lab, "MISTAKES", []))


def hangs_of(lab: str) -> tuple[dict[str, str], list[str]]:
    """``(cell -> deadlocking source, test cells that costs)`` of ``lab``."""
    return dict(_answers_attr(lab, "HANGS", {})), list(_answers_attr(lab, "HANG_LOSES", []))


def forged_files_of(lab: str) -> dict[str, str]:
    """``filename -> text`` of the result files the cheat of ``lab`` writes by hand."""
    return dict(_answers_attr(lab, "FORGED_FILES", {}))


def disguise(source: str) -> str:
    """A copy of a solution cell as a copier would hand it in: local variables renamed
    (``x`` -> ``x_val``), a comment on top, blank lines doubled. Names other code relies
    on stay: top-level functions and classes, parameters (callers pass them by keyword),
    imports, module-level names, attributes and keyword arguments.

    Example:
        >>> print(disguise("def f(a):\\n    total = a + 1\\n    return total"))
        # my solution
        def f(a):
            total_val = a + 1
            return total_val
    """
    import ast
    import io
    import tokenize

    magic, body = "", source
    if source.startswith("%%writefile"):
        first, _, body = source.partition("\n")
        magic = first + "\n"
    try:
        tree = ast.parse(body)
    except SyntaxError:
        return source
    keep = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    keep |= {
        t.id
        for n in tree.body
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Name)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.arguments):
            args = [*node.posonlyargs, *node.args, *node.kwonlyargs, node.vararg, node.kwarg]
            keep |= {a.arg for a in args if a is not None}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            keep |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.JoinedStr):  # names inside f-strings are not tokens (3.11)
            keep |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
    stored = {
        n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
    }
    rename = {name: f"{name}_val" for name in stored - keep}
    lines = body.split("\n")
    edits: list[tuple[int, int, int, str]] = []
    prev, depth = None, 0
    for tok in tokenize.generate_tokens(io.StringIO(body).readline):
        if tok.type == tokenize.OP and tok.string in "([{)]}":
            depth += 1 if tok.string in "([{" else -1
        if (
            tok.type == tokenize.NAME
            and tok.string in rename
            and (prev is None or prev.string != ".")
        ):
            rest = tok.line[tok.end[1] :].lstrip()
            keyword_arg = depth > 0 and rest.startswith("=") and not rest.startswith("==")
            if not keyword_arg:
                edits.append((tok.start[0] - 1, tok.start[1], tok.end[1], rename[tok.string]))
        prev = tok
    for row, start, end, text in sorted(edits, reverse=True):
        lines[row] = lines[row][:start] + text + lines[row][end:]
    spaced = "\n".join(line if line.strip() else "\n" for line in lines)
    return f"{magic}# my solution\n{spaced}"


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
        return _replace_solutions(_notebook("release", lab), mistakes_of(lab)), {}
    if not submits(kind, lab):
        return None
    if kind in HOSTILE:
        return hostile(kind, lab), {}
    if kind == "hang":
        hang = hangs_of(lab)[0]
        nb = _strip_hidden_tests({**_notebook("solution", lab), "_lab": lab})
        return (_replace_solutions(nb, hang) if hang else nb), {}
    if kind == "copycat":
        nb, files = make_student(COPIED_FROM, lab)
        for cell in nb["cells"]:
            if is_solution(cell) and cell["cell_type"] == "code":
                src = (
                    "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
                )
                cell["source"] = disguise(src)
        return nb, files
    if kind == "cheat":
        nb = _notebook("release", lab)
        for cell in nb["cells"]:
            if is_solution(cell) and cell["cell_type"] == "code":
                src = (
                    "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
                )
                cell["source"] = steal(lab, nbgrader_meta(cell)["grade_id"], src)
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
        return nb, forged_files_of(lab)
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
    """``test grade_id -> points`` of a lab's autograded test cells."""
    return {
        nbgrader_meta(c)["grade_id"]: float(nbgrader_meta(c)["points"])
        for c in _notebook("solution", lab)["cells"]
        if is_test(c)
    }


def written_points(lab: str) -> dict[str, float]:
    """``grade_id -> points`` of a lab's manually graded written answers (0 until an
    instructor grades them: autograde leaves them for ``make feedback``'s formgrader)."""
    return {
        nbgrader_meta(c)["grade_id"]: float(nbgrader_meta(c)["points"])
        for c in _notebook("solution", lab)["cells"]
        if is_written(c)
    }


def expected_scores(lab: str) -> dict[str, dict[str, float]]:
    """``student -> {grade_id -> points}`` each student must get in ``lab`` from autograde
    (written answers: 0, waiting for the instructor)."""
    full = {**max_points(lab), **dict.fromkeys(written_points(lab), 0.0)}
    zero = dict.fromkeys(full, 0.0)
    hang = dict(full)
    for gid in hangs_of(lab)[1]:
        hang[gid] = 0.0
    spoiled = {kind: {**full, f"test_{cell}": 0.0} for kind, (cell, _, _) in HOSTILE.items()}
    return {
        **spoiled,
        "perfect": full,
        "blank": zero,
        "mistake": zero,
        "hang": hang,
        "cheat": zero,
        "copycat": full,  # integrity reports never change points: the instructor decides
    }


EXPECTED_CSV = ROOT / "tests" / "expected_grades.csv"
CSV_FIELDS = ("assignment", "student_id", "score", "max_score")


def expected_rows() -> list[dict[str, str]]:
    """The rows ``nbgrader export`` must produce for the sample class (our columns only)."""
    rows = []
    for lab in labs():
        table = expected_scores(lab)
        top = sum(max_points(lab).values()) + sum(written_points(lab).values())
        for student in STUDENTS:
            if not submits(student, lab):
                continue
            score = sum(table[student].values())
            rows.append(
                {
                    "assignment": lab,
                    "student_id": student,
                    "score": f"{score:g}",
                    "max_score": f"{top:g}",
                }
            )
    return rows


def read_rows(path: Path) -> list[dict[str, str]]:
    """Our columns of a grades CSV (nbgrader's export or ``expected_grades.csv``), numbers
    normalised so that ``15.0`` and ``15`` compare equal."""
    with open(path, newline="") as f:
        return [
            {
                "assignment": r["assignment"],
                "student_id": r["student_id"],
                "score": f"{float(r['score']):g}",
                "max_score": f"{float(r['max_score']):g}",
            }
            for r in csv.DictReader(f)
        ]


def compare(
    exported: Path, expected: Path | None = None, only_labs: list[str] | None = None
) -> list[str]:
    """Differences between an exported grades CSV and the expected one (``[]``: equal).

    The (assignment, student) pairs present in the export are compared (of ``only_labs``
    when given: nbgrader exports every assignment of the gradebook, graded or not).
    """
    rows = expected_rows() if expected is None else read_rows(expected)
    want = {(r["assignment"], r["student_id"]): r for r in rows}
    problems = []
    got_rows = [r for r in read_rows(exported) if not only_labs or r["assignment"] in only_labs]
    if not got_rows:
        return [f"{exported} holds no grades"]
    for row in got_rows:
        key = (row["assignment"], row["student_id"])
        if key not in want:
            if row["score"] != "0":  # nbgrader exports 0 for a student without a submission
                problems.append(f"{key[1]} in {key[0]}: not in the sample class")
        elif row != want[key]:
            problems.append(
                f"{key[1]} in {key[0]}: expected {want[key]['score']}/{want[key]['max_score']}, "
                f"got {row['score']}/{row['max_score']}"
            )
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("target", nargs="?", default="grading/submitted", help="where to write")
    p.add_argument("--compare", metavar="CSV", help="check an `nbgrader export` CSV")
    p.add_argument("--write-expected", metavar="CSV", help="write the expected grades CSV")
    args = p.parse_args(argv)
    if args.compare:
        problems = compare(Path(args.compare))
        for line in problems:
            print(f"MISMATCH {line}")
        print("sample class: grades as expected" if not problems else "sample class: WRONG")
        return 1 if problems else 0
    if args.write_expected:
        rows = expected_rows()  # first: a lab that fails to load must not empty the file
        with open(args.write_expected, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, lineterminator="\n")
            writer.writeheader()
            writer.writerows(rows)
        print(f"wrote {args.write_expected}")
        return 0
    target = Path(args.target)
    write_class(target)
    print(
        json.dumps(
            {lab: {s: sum(v.values()) for s, v in expected_scores(lab).items()} for lab in labs()},
            indent=1,
        )
    )
    print(f"wrote {', '.join(STUDENTS)} into {target}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
