"""Similarity of code, robust to renamed variables and reformatting: copy detection.

One measure serves two purposes:

- ``make autograde`` writes ``grading/integrity.csv``: for every graded solution cell of
  every student, the closest source among the instructor's solution, the reference code of
  the package (``ddp_lab/answers`` and the runtime modules that equal an exercise) and every
  other student's same cell, with its score; scores at or above :data:`FLAG_AT` are listed
  under the score table. Points never change: the instructor decides.
- the student-kit test proves that no kit file holds a solution region, line for line or
  with renamed variables.

The measure (in the spirit of MOSS and JPlag): Python source is tokenised; comments,
docstrings and layout are dropped; names become ``V`` except keywords, builtins and
attribute names after a dot (``dist.all_reduce`` stays an API call), and strings become ``S``
(numbers stay: a copier renames, but rarely changes constants). The fingerprints of a
source are the hashes of its runs of :data:`K` consecutive normalised tokens. Fingerprints
of the released scaffolding (the stub every student starts from) are removed first.
:func:`containment` is the share of one source's fingerprints found in another;
:func:`similarity` is the share of the smaller one's found in the larger one (1.0 for a
renamed copy).
"""

from __future__ import annotations

import builtins
import io
import keyword
import textwrap
import tokenize
from collections.abc import Iterable
from pathlib import Path

from ddp_lab.checks.runner import split_magics

#: Tokens per fingerprint: shorter runs match everywhere, longer ones miss edited copies.
K = 10
#: A source with fewer fingerprints than this is too short to judge (score 0).
MIN_FINGERPRINTS = 8
#: Scores at or above this are flagged in ``make autograde``'s integrity report.
FLAG_AT = 0.9

_KEEP = (set(keyword.kwlist) | set(keyword.softkwlist) | set(dir(builtins))) - {"_", "__"}
# f-strings are one STRING token up to Python 3.11, three kinds of token from 3.12 on
_STRING_START = {tokenize.STRING, getattr(tokenize, "FSTRING_START", tokenize.STRING)}
_STRING_REST = {
    getattr(tokenize, n) for n in ("FSTRING_MIDDLE", "FSTRING_END") if hasattr(tokenize, n)
}
_SKIP = {
    tokenize.COMMENT,
    tokenize.NL,
    tokenize.NEWLINE,
    tokenize.INDENT,
    tokenize.DEDENT,
    tokenize.ENCODING,
    tokenize.ENDMARKER,
}


def normalized_tokens(source: str) -> list[str]:
    """The normalised token stream of Python ``source`` (a ``%%writefile`` cell: its file).

    Example:
        >>> normalized_tokens("total = torch.stack(g).sum(0)  # add up")
        ['V', '=', 'V', '.', 'stack', '(', 'V', ')', '.', 'sum', '(', '0', ')']
        >>> normalized_tokens("s = x.sum(0)") == normalized_tokens("acc=y.sum( 0 )")
        True
    """
    code, files = split_magics(source)
    text = code if code.strip() else "\n".join(files.values())
    out: list[str] = []
    prev = None
    line_start = True
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type in _SKIP:
                if tok.type in (tokenize.NEWLINE, tokenize.NL, tokenize.INDENT, tokenize.DEDENT):
                    line_start = True
                continue
            if tok.type == tokenize.STRING and line_start:  # a docstring or bare string
                continue
            line_start = False
            if tok.type == tokenize.NAME:
                keep = tok.string in _KEEP or (prev is not None and prev.string == ".")
                out.append(tok.string if keep else "V")
            elif tok.type == tokenize.NUMBER:
                out.append(tok.string)  # copiers rename, they rarely change constants
            elif tok.type in _STRING_START:
                out.append("S")
            elif tok.type in _STRING_REST:
                continue
            else:
                out.append(tok.string)
            prev = tok
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass  # a partial cell: keep what was read
    return out


def fingerprints(source: str, k: int = K) -> set[int]:
    """Hashes of every run of ``k`` consecutive normalised tokens of ``source``.

    Example:
        >>> len(fingerprints("a = b + c")) == 0   # 5 tokens: shorter than one run
        True
    """
    toks = normalized_tokens(source)
    return {hash(tuple(toks[i : i + k])) for i in range(len(toks) - k + 1)}


def containment(part: set[int], whole: set[int], minimum: int = MIN_FINGERPRINTS) -> float:
    """Share of ``part``'s fingerprints found in ``whole`` (0 when ``part`` is too small).

    Example:
        >>> containment({1, 2, 3, 4}, {1, 2, 9}, minimum=1)
        0.5
    """
    if len(part) < minimum:
        return 0.0
    return len(part & whole) / len(part)


def similarity(a: set[int], b: set[int], minimum: int = MIN_FINGERPRINTS) -> float:
    """Share of the smaller set's fingerprints found in the larger (0 when either is small).

    Example:
        >>> similarity({1, 2, 3, 4}, {1, 2, 3, 4, 5, 6}, minimum=1)
        1.0
    """
    if min(len(a), len(b)) < minimum:
        return 0.0
    return len(a & b) / min(len(a), len(b))


def without(prints: set[int], base: Iterable[set[int]]) -> set[int]:
    """``prints`` minus every fingerprint of the ``base`` sources (the given scaffolding)."""
    out = set(prints)
    for b in base:
        out -= b
    return out


def solution_region(source: str) -> str:
    """The part of an instructor's solution cell between ``### BEGIN SOLUTION`` and ``###
    END SOLUTION`` (every such part, joined), or the whole cell when it has none.

    Example:
        >>> cell = "def f():\\n    ### BEGIN SOLUTION\\n    return 1\\n    ### END SOLUTION"
        >>> solution_region(cell)
        'return 1'
    """
    if "### BEGIN SOLUTION" not in source:
        return source
    parts = []
    for chunk in source.split("### BEGIN SOLUTION")[1:]:
        body = chunk.split("### END SOLUTION")[0]
        lines = body.split("\n")[1:-1] if "\n" in body else [body]
        parts.append(textwrap.dedent("\n".join(lines)))
    return "\n".join(parts)


# --- the report of ``make autograde`` --------------------------------------------------------

#: Columns of ``grading/integrity.csv``.
REPORT_FIELDS = ("student", "lab", "exercise", "closest", "score", "flagged", "also")


def _given_prints(release: dict) -> set[int]:
    """Fingerprints of every code cell a released notebook gives students."""
    from ddp_lab.grading.notebook import source_of

    out: set[int] = set()
    for cell in release["cells"]:
        if cell["cell_type"] == "code":
            out |= fingerprints(source_of(cell))
    return out


def reference_sources(package: Path) -> dict[str, set[int]]:
    """``"file:function" -> fingerprints`` of the code students may not copy: every
    top-level function and class of the answers' modules and of the runtime package (the
    trainer, process-group set-up and evaluation are the answers of lab 3, for instance)."""
    import ast

    out = {}
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package.parent).as_posix()
        if rel.startswith("ddp_lab/grading/") or "__pycache__" in rel:
            continue
        text = path.read_text()
        try:
            body = ast.parse(text).body
        except SyntaxError:
            continue
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                prints = fingerprints(ast.get_source_segment(text, node) or "")
                if len(prints) >= MIN_FINGERPRINTS:
                    out[f"{rel}:{node.name}"] = prints
    return out


def class_report(root: Path, labs: list[str] | None = None) -> list[dict]:
    """One row per graded solution cell of every submission under ``grading/submitted``.

    For each cell (its fingerprints minus the released scaffolding), the closest source among
    ``instructor`` (the solution), ``reference:<file:function>`` (code of the package) and
    ``student:<id>`` (the same cell of every other submission), with the score: the share
    of the cell found in that source (:func:`containment`) for the instructor and the
    references, :func:`similarity` between two students. Rows at or above :data:`FLAG_AT`
    are ``flagged``; ``also`` lists the other sources at or above it.
    """
    from ddp_lab.grading.notebook import load, solution_sources

    submitted = root / "grading" / "submitted"
    refs = reference_sources(root / "ddp_lab")
    rows = []
    lab_names = sorted({p.parent.name for p in submitted.glob("*/*/*.ipynb")})
    for lab in [name for name in lab_names if not labs or name in labs]:
        release_path = root / "labs" / lab / f"{lab}.ipynb"
        solution_path = root / "solutions" / lab / f"{lab}.ipynb"
        if not release_path.is_file() or not solution_path.is_file():
            continue
        given = _given_prints(load(release_path))
        solution = {
            c: without(fingerprints(solution_region(s)), [given])
            for c, s in solution_sources(load(solution_path)).items()
        }
        students = {}
        for nb_path in sorted(submitted.glob(f"*/{lab}/{lab}.ipynb")):
            try:
                cells = solution_sources(load(nb_path))
            except (OSError, ValueError, KeyError):
                continue
            students[nb_path.parent.parent.name] = {
                c: without(fingerprints(cells[c]), [given]) for c in solution if c in cells
            }
        for student, cells in students.items():
            for cell, prints in cells.items():
                scores = {"instructor": containment(prints, solution[cell])}
                for name, ref in refs.items():
                    scores[f"reference:{name}"] = containment(prints, ref)
                for other, their in students.items():
                    if other != student and cell in their:
                        scores[f"student:{other}"] = similarity(prints, their[cell])
                ranked = sorted(scores, key=lambda k: (-scores[k], k))
                closest, score = ranked[0], scores[ranked[0]]
                also = [k for k in ranked[1:] if scores[k] >= FLAG_AT]
                rows.append(
                    {
                        "student": student,
                        "lab": lab,
                        "exercise": cell,
                        "closest": closest if score > 0 else "",
                        "score": f"{score:.2f}",
                        "flagged": "yes" if score >= FLAG_AT else "",
                        "also": " ".join(also[:8]),
                    }
                )
    return rows


def write_report(rows: list[dict], path: Path) -> None:
    """Write the rows of :func:`class_report` as CSV."""
    import csv

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=REPORT_FIELDS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
