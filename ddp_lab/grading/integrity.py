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
attribute names after a dot (``dist.all_reduce`` stays an API call), numbers become ``N``
and strings ``S``. The fingerprints of a source are the hashes of its runs of :data:`K`
consecutive normalised tokens. Fingerprints of the released scaffolding (the stub every
student starts from) are removed first. :func:`containment` is the share of one source's
fingerprints found in another; :func:`similarity` is the share of the smaller one's found
in the larger one (1.0 for a renamed copy).
"""

from __future__ import annotations

import builtins
import io
import keyword
import textwrap
import tokenize
from collections.abc import Iterable

from ddp_lab.checks.runner import split_magics

#: Tokens per fingerprint: shorter runs match everywhere, longer ones miss edited copies.
K = 10
#: A source with fewer fingerprints than this is too short to judge (score 0).
MIN_FINGERPRINTS = 8
#: Scores at or above this are flagged in ``make autograde``'s integrity report.
FLAG_AT = 0.9

_KEEP = set(keyword.kwlist) | set(keyword.softkwlist) | set(dir(builtins))
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
        ['V', '=', 'V', '.', 'stack', '(', 'V', ')', '.', 'sum', '(', 'N', ')']
        >>> normalized_tokens("s = x.sum(0)") == normalized_tokens("acc=y.sum( 1 )")
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
                out.append("N")
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
        >>> solution_region("def f():\\n    ### BEGIN SOLUTION\\n    return 1\\n    ### END SOLUTION")
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
