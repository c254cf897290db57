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


_COUNT = "        return epoch * (steps + steps // every) + step + step // every\n"

DIAGNOSE_MISTAKES = [
    Mistake(
        CELL,
        "first_error",  # the first error read as the whole story: DETAIL's fingerprints only
        """def diagnose_hang(logs, job):
    # DETAIL says who ran what: each rank's message starts with its own collective
    seq = 0
    for rank in sorted(logs):
        for line in logs[rank].splitlines():
            if "Detected mismatch" not in line:
                continue
            mine = line.split("but Rank")[0]
            seq = int(mine.split("SequenceNumber=")[1].split(",")[0].split("OpType")[0])
            kind = mine.split("OpType=")[1].split(",")[0].split(")")[0]
            if kind != "ALLREDUCE":
                return {"rank": rank, "collective": seq, "cause": "rank_only"}
            if "TensorDtypes=Double" not in mine:
                return {"rank": rank, "collective": seq, "cause": "dtype"}
            sizes = (f"TensorShape=[{job['features'] + 2}]", "TensorShape=[]")
            if not any(size in mine for size in sizes):
                return {"rank": rank, "collective": seq, "cause": "shape"}
    return {"rank": 0, "collective": seq, "cause": "shape"}
""",
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
