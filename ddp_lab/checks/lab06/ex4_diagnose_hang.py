"""Exercise 4: ``diagnose_hang(logs, job)``: which rank, which collective, which cause.

The checker runs real jobs (``ddp_lab.checks.lab06.hang_jobs``): the notebook's data-parallel
loop on 2 and on 3 gloo ranks with ``TORCH_DISTRIBUTED_DEBUG=DETAIL``, each with one
divergence drawn at grading time from a family of real causes (a collective only one rank
calls, one rank with more steps, a rank that skips a step, another shape, another dtype),
with the odd rank, the step, the sizes and the logging interval drawn too. Every grading run
holds every cause on 2 and on 3 ranks (10 jobs, one launch of about 6 s). The student's
function gets each job's per-rank logs and its settings, and returns
``{"rank", "collective", "cause"}``; the judge compares with the truth, known by
construction and kept from the student's process (``inputs[SEALED]``).

Where the sequences part is not always where the first error is: ``DETAIL`` compares every
collective's fingerprint, so a rank that skips a step or takes one more step pairs its
all-reduces with the next step's on the other ranks (same shape: no error) until the kinds
or shapes differ, several collectives later, or until the final barrier.
"""

from __future__ import annotations

import torch

from ddp_lab.checks.contract import SEALED, Exercise
from ddp_lab.checks.failure import CheckFailed
from ddp_lab.checks.lab06 import hang_jobs
from ddp_lab.checks.values import plain


def make_inputs(gen: torch.Generator) -> dict:
    """Every cause on 2 and on 3 ranks, in a drawn order; the jobs run now (one launch)."""
    specs, truths = [], []
    for world in (2, 3):
        for cause in hang_jobs.CAUSES:
            spec, truth = hang_jobs.draw(gen, world, cause)
            specs.append(spec)
            truths.append(truth)
    order = torch.randperm(len(specs), generator=gen).tolist()
    specs, truths = [specs[i] for i in order], [truths[i] for i in order]
    logs = hang_jobs.run_jobs(specs)
    jobs = [
        {"job": {k: spec[k] for k in hang_jobs.JOB_KEYS}, "logs": log}
        for spec, log in zip(specs, logs, strict=True)
    ]
    return {"jobs": jobs, SEALED: {"truths": truths}}


def run(ns: dict, inputs: dict, workdir) -> dict:
    """The student's diagnosis of every job (copies in, plain values out)."""
    fn = ns["diagnose_hang"]
    return {
        "diagnoses": [
            plain(fn({int(r): str(t) for r, t in j["logs"].items()}, dict(j["job"])))
            for j in inputs["jobs"]
        ]
    }


def _field(got, name: str, kind):
    value = got.get(name) if isinstance(got, dict) else None
    if kind is int and isinstance(value, bool):
        return None
    return value if isinstance(value, kind) else None


def problem(job: dict, got, truth: dict, i: int, n: int) -> str | None:
    """What is wrong with one diagnosis, or None (the truth itself is not printed)."""
    world = job["job"]["world_size"]
    at = f"job {i + 1} of {n} ({world} ranks)"
    rank, where = _field(got, "rank", int), _field(got, "collective", int)
    cause = _field(got, "cause", str)
    if rank is None or where is None or cause is None:
        return (
            f"{at}: diagnose_hang returned {got!r:.80}; expected a dict "
            '{"rank": int, "collective": int, "cause": str}'
        )
    if cause not in hang_jobs.CAUSES:
        return f"{at}: cause {cause!r} is none of {', '.join(map(repr, hang_jobs.CAUSES))}"
    if cause != truth["cause"]:
        return (
            f"{at}: the cause is not {cause!r}; read every rank's log, not only the first "
            "error: where did each rank's sequence of collectives differ from the others'?"
        )
    if rank != truth["rank"]:
        return f"{at}: the cause {cause!r} is right, but rank {rank} is not the rank that departs"
    if where != truth["collective"]:
        return (
            f"{at}: cause and rank are right, but the sequences do not part at collective "
            f"{where} (0-based, in the rank's sequence of collectives on the job's group)"
        )
    return None


def judge(inputs: dict, outputs: dict) -> str:
    """Every job's diagnosis against the truth of its construction."""
    jobs, truths = inputs["jobs"], inputs[SEALED]["truths"]
    got = outputs.get("diagnoses") if isinstance(outputs, dict) else None
    if not isinstance(got, list) or len(got) != len(jobs):
        raise CheckFailed(f"expected one diagnosis per job ({len(jobs)})")
    for i, (job, g, truth) in enumerate(zip(jobs, got, truths, strict=True)):
        if why := problem(job, g, truth, i, len(jobs)):
            raise CheckFailed(why)
    return (
        f"diagnose_hang named the rank, the collective and the cause of {len(jobs)} jobs "
        f"({len(hang_jobs.CAUSES)} causes, on 2 and 3 ranks) from their logs"
    )


EXERCISE = Exercise(
    "test_ex4_diagnose_hang",
    ("ex4_diagnose_hang",),
    "a hang diagnosed from its logs",
    make_inputs,
    judge,
    run=run,
    timeout=60,
)
