"""What the grader adds to exercise 4's judge (``diagnose_hang``): the typical misreading
named, when every wrong diagnosis of the run fits it.

- positions counted from 1 (every wrong position one more than the truth);
- the first error taken for the divergence: a skipped or an extra step read as the mismatch
  ``DETAIL`` reported later (the cause wrong), or its ``SequenceNumber`` taken as the
  position;
- the logging ``all_reduce`` left out of the count of collectives before a step;
- for uneven shards, a rank with fewer steps named instead of the one with more.
"""

from __future__ import annotations

import re

from ddp_lab.checks.contract import SEALED
from ddp_lab.checks.lab06 import ex4_diagnose_hang as ex4

_SEQ = re.compile(r"Rank (\d+) is running collective: CollectiveFingerPrint\(SequenceNumber=(\d+)")
_STEPS = re.compile(r"(\d+) steps per epoch")
_SKIP = re.compile(r"epoch (\d+) step (\d+): loss is nan, skipping")


def _own_seq(job: dict, rank: int) -> int | None:
    """The SequenceNumber of the call ``DETAIL`` stopped ``rank`` in."""
    for m in _SEQ.finditer(job["logs"].get(rank, "")):
        if int(m.group(1)) == rank:
            return int(m.group(2))
    return None


def _uncounted_logs(job: dict, truth: dict) -> int | None:
    """The position with only the steps' all-reduces counted (skip and uneven)."""
    logs = job["logs"]
    if truth["cause"] == "uneven":
        return min(int(_STEPS.search(t).group(1)) for t in logs.values())
    m = _SKIP.search(logs[truth["rank"]])
    steps = int(_STEPS.search(logs[truth["rank"]]).group(1))
    return int(m.group(1)) * steps + int(m.group(2)) if m else None


_READINGS = (
    (
        lambda job, got, t: t["cause"] in ("skip", "uneven") and got.get("cause") != t["cause"],
        "the first error is not the first divergence: a rank that skips a step, or takes one "
        "step more, pairs its all-reduces with the others' next ones (same shape and dtype, so "
        "DETAIL lets them pass) until a later call differs; read what each rank printed",
    ),
    (
        lambda job, got, t: (
            t["cause"] in ("skip", "uneven") and got.get("collective") == _own_seq(job, t["rank"])
        ),
        "that position is where DETAIL noticed, not where the sequences parted: with a skipped "
        "or an extra step they part at that step; count the collectives every rank calls "
        "before it",
    ),
    (
        lambda job, got, t: (
            got.get("cause") == t["cause"]
            and got.get("rank") == t["rank"]
            and got.get("collective") == t["collective"] + 1
        ),
        "positions count from 0: SequenceNumber=0 is a rank's first collective on the group",
    ),
    (
        lambda job, got, t: (
            t["cause"] in ("skip", "uneven") and got.get("collective") == _uncounted_logs(job, t)
        ),
        "a logging step calls the logging all_reduce too: count it among the collectives "
        "before the step",
    ),
    (
        lambda job, got, t: (
            t["cause"] == got.get("cause") == "uneven" and got.get("rank") != t["rank"]
        ),
        "with uneven shards the rank that departs is the one with more steps per epoch: its "
        "extra step's all-reduce is the call no other rank makes there",
    ),
)


def diagnose_explain(inputs: dict, outputs: dict) -> str | None:
    """The misreading every wrong diagnosis fits, or None."""
    truths = inputs[SEALED]["truths"]
    got = outputs.get("diagnoses") if isinstance(outputs, dict) else None
    if not isinstance(got, list) or len(got) != len(truths):
        return None
    wrong = [
        (job, g, t)
        for i, (job, g, t) in enumerate(zip(inputs["jobs"], got, truths, strict=True))
        if ex4.problem(job, g, t, i, len(truths))
    ]
    if not wrong or not all(isinstance(g, dict) for _, g, _ in wrong):
        return None
    for fits, why in _READINGS:
        if all(fits(job, g, t) for job, g, t in wrong):
            return f"{len(wrong)} of {len(truths)} jobs diagnosed wrong: {why}"
    return None
