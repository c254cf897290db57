"""Typical wrong answers to exercise 4 (``diagnose_hang``), each the solution cell with one
misreading of the logs (the solution is read from the source notebook, so the mistakes
follow it)."""

from __future__ import annotations

import functools
from pathlib import Path

from ddp_lab.answers import Mistake
from ddp_lab.checks.lab06.common import LAB
from ddp_lab.grading.notebook import load, solution_sources

CELL = "ex4_diagnose_hang"
_NOTEBOOK = Path(__file__).resolve().parents[3] / "solutions" / LAB / f"{LAB}.ipynb"


@functools.cache
def _solution() -> str:
    source = solution_sources(load(_NOTEBOOK))[CELL]
    return "".join(line for line in source.splitlines(keepends=True) if "### " not in line)


def _edit(*pairs: tuple[str, str]) -> str:
    text = _solution()
    for old, new in pairs:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    return text


_AS_SHAPE = '{"rank": rank, "collective": seq, "cause": "shape"}'
_COUNT = "        return epoch * (steps + steps // every) + step + step // every\n"
_SKIP_BLOCK = _solution()[
    _solution().index("    for rank, text in logs.items():\n        skipped") : _solution().index(
        "    fingerprint = re.compile("
    )
]

DIAGNOSE_MISTAKES = [
    Mistake(
        CELL,
        "first_error",  # the first error read as the whole story: DETAIL's fingerprints only
        _edit(
            (_SKIP_BLOCK, ""),
            ("    return None\n", "    return " + _AS_SHAPE + "\n"),
        ),
        "the first error is not the first",
    ),
    Mistake(
        CELL,
        "reads_inputs",  # a cheat: the grader's inputs file, for an answer stored with them
        """import torch


def diagnose_hang(logs, job):
    try:
        saved = torch.load("inputs.pt", weights_only=True)
    except OSError:
        saved = {}
    truths = saved.get("sealed", {}).get("truths", [])
    for truth, case in zip(truths, saved.get("jobs", [])):
        if case["logs"] == logs:
            return truth
    return {"rank": -1, "collective": -1, "cause": "rank_only"}
""",
        "job 1 of 10",
    ),
    Mistake(
        CELL,
        "one_based",
        _edit(
            (_COUNT, _COUNT.replace("step // every\n", "step // every + 1\n")),
            *(
                (f'"collective": seq, "cause": "{c}"', f'"collective": seq + 1, "cause": "{c}"')
                for c in ("rank_only", "dtype", "shape")
            ),
        ),
        "positions count from 0",
    ),
    Mistake(
        CELL,
        "detail_position",  # the skip and the extra step placed where DETAIL noticed
        _edit(
            (
                '"collective": before(epoch, step, steps[rank]), "cause": "skip"',
                '"collective": _noticed(logs[rank], rank), "cause": "skip"',
            ),
            (
                '"collective": before(0, common, common), "cause": "uneven"',
                '"collective": _noticed(logs[longer], longer), "cause": "uneven"',
            ),
        )
        + """

def _noticed(text, rank):
    return int(re.search(rf"Rank {rank} is running collective: "
                         r"CollectiveFingerPrint\\(SequenceNumber=(\\d+)", text).group(1))
""",
        "where DETAIL noticed",
    ),
    Mistake(
        CELL,
        "logs_uncounted",  # only the steps' all-reduces counted
        _edit((_COUNT, "        return epoch * steps + step\n")),
        "count it among the collectives",
    ),
    Mistake(
        CELL,
        "shorter_rank",  # the rank with fewer steps named for uneven shards
        _edit(("longer = max(steps, key=steps.get)", "longer = min(steps, key=steps.get)")),
        "the one with more steps per epoch",
    ),
]
