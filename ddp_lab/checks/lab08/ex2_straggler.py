"""Exercise 2: ``find_straggler(traces)``: which rank is slow, and in which phase.

``traces`` is a list, rank 0 first, of every rank's complete events (``"ph": "X"``: name, ts
and dur in microseconds, tid, pid, cat; as ``ddp_lab.figures.profile.load_events`` returns
them) of one synchronous data-parallel job: the trainer's ``ddp_lab: data | forward |
backward | optimizer`` ranges, the ``ProfilerStep#k`` ranges of :data:`STEPS` profiled steps,
the operators, and the backend's collectives (names starting with ``gloo:`` on the CPU,
``COLLECTIVE_PREFIXES``), which run on a thread of their own. The function returns
``{"rank": r, "phase": p}``, ``p`` one of ``"data"``, ``"forward"``, ``"backward"``,
``"optimizer"``.

What the contract promises: ONE rank (the straggler) does more work in ONE phase on every
profiled step: at least :data:`~ddp_lab.checks.lab08.straggler_jobs.SLOW_MS` ms more per
step than the other ranks do in that phase (at most ``SLOW_MAX_MS``). A phase's *own* time
on a rank is its range's duration minus the time within it during which one of that rank's
collectives was running: what the rank spent waiting for the others is not its work. Besides
the straggler, a job may hold one *hiccup*: another rank pauses once, in one phase of one
profiled step, for ``HICCUP_MS`` (8 times ``SLOW_MS``); a hiccup is not a straggler (it is
slow on one step, not on every step). Ranks that wait show it as long collectives inside
their backward pass (the gradients' all-reduce cannot finish before the straggler's joins).

The case set, every grading run: real jobs recorded now (``straggler_jobs``, one torchrun
launch of 3 ranks, 10 to 15 s on 2 shared cores): every phase slowed on 2 ranks and on 3
ranks (8 jobs, in a drawn order), the straggler's rank drawn (rank 0 in one job at least,
another rank in one at least), the slowdown drawn; one job with a hiccup in the optimizer of
the last profiled step, one (not a data job) with a hiccup in the first profiled step, and
more hiccups in a middle step by chance. The truth of each job is kept from the student's
process (``inputs[SEALED]``); the judge compares with it.
"""

from __future__ import annotations

import copy

import torch

from ddp_lab.checks import runner
from ddp_lab.checks.contract import SEALED, Exercise
from ddp_lab.checks.failure import CheckFailed
from ddp_lab.checks.lab08 import straggler_jobs as jobs
from ddp_lab.checks.lab08.common import LAB, PHASES
from ddp_lab.checks.values import plain, randint

GRADE_ID = "test_ex2_straggler"
#: profiled steps of every job
STEPS = jobs.SCHEDULE[2]
WORLDS = (2, 3)


def _others(gen: torch.Generator, world: int, rank: int) -> int:
    """A rank of ``range(world)`` other than ``rank``, drawn."""
    return [r for r in range(world) if r != rank][randint(gen, 0, world - 2)]


def draw_specs(gen: torch.Generator) -> list[dict]:
    """The case set's jobs (every phase on 2 and on 3 ranks), in a drawn order."""
    cells = [(w, p) for p in PHASES for w in WORLDS]
    ranks = [randint(gen, 0, w - 1) for w, _ in cells]
    zero, other = randint(gen, 0, len(cells) - 1), randint(gen, 0, len(cells) - 1)
    ranks[zero] = 0  # a straggler that is rank 0, one that is not
    if other == zero:
        other = (other + 1) % len(cells)
    if ranks[other] == 0:
        ranks[other] = randint(gen, 1, cells[other][0] - 1)
    last = randint(gen, 0, len(cells) - 1)  # a hiccup in the last step's optimizer
    firsts = [i for i, (_, p) in enumerate(cells) if p != "data" and i != last]
    first = firsts[randint(gen, 0, len(firsts) - 1)]  # a hiccup in the first step
    specs = []
    for i, ((w, p), r) in enumerate(zip(cells, ranks, strict=True)):
        hiccup = None
        if i == last:
            hiccup = [_others(gen, w, r), "optimizer", STEPS - 1]
        elif i == first:
            hiccup = [_others(gen, w, r), PHASES[randint(gen, 0, 3)], 0]
        elif randint(gen, 0, 3) == 0:
            hiccup = [_others(gen, w, r), PHASES[randint(gen, 0, 3)], STEPS // 2]
        specs.append(jobs.draw(gen, w, p, r, hiccup))
    order = torch.randperm(len(specs), generator=gen).tolist()
    return [specs[i] for i in order]


def make_inputs(gen: torch.Generator) -> dict:
    """The case set; the jobs run now (one launch)."""
    specs = draw_specs(gen)
    traces = jobs.run_jobs(specs)
    return {
        "jobs": [
            {"world_size": s["world_size"], "traces": t} for s, t in zip(specs, traces, strict=True)
        ],
        SEALED: {
            "truths": [{"rank": s["rank"], "phase": s["phase"]} for s in specs],
            "specs": specs,
        },
    }


def run(ns: dict, inputs: dict, workdir) -> dict:
    """The student's answer for every job (a copy of the traces each time)."""
    fn = ns["find_straggler"]
    return {"answers": [plain(fn(copy.deepcopy(j["traces"]))) for j in inputs["jobs"]]}


def answer_problem(got, world: int) -> str | None:
    """What is wrong with the form of one answer, or None."""
    if not isinstance(got, dict) or set(got) != {"rank", "phase"}:
        return f'find_straggler returned {got!r:.80}; expected {{"rank": int, "phase": str}}'
    rank, phase = got["rank"], got["phase"]
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < world:
        return f"rank {rank!r} is not a rank of this job (0 to {world - 1})"
    if phase not in PHASES:
        return f"phase {phase!r} is none of {', '.join(map(repr, PHASES))}"
    return None


def problem(job: dict, got, truth: dict, i: int, n: int) -> str | None:
    """What is wrong with one answer, or None (the truth itself is not printed)."""
    world = job["world_size"]
    at = f"job {i + 1} of {n} ({world} ranks)"
    if why := answer_problem(got, world):
        return f"{at}: {why}"
    rank, phase = got["rank"], got["phase"]
    if rank == truth["rank"] and phase == truth["phase"]:
        return None
    if rank == truth["rank"]:
        return f"{at}: rank {rank} is the straggler, but {phase!r} is not the phase it is slow in"
    return (
        f"{at}: rank {rank} is not the straggler. A rank that waits for a slow one shows long "
        "collectives, and a long phase around them; the straggler is the rank whose own work "
        "in one phase is longer than the other ranks' in the same phase, on every step"
    )


def judge(inputs: dict, outputs: dict) -> str:
    """Every job's answer against the truth of its construction."""
    cases, truths = inputs["jobs"], inputs[SEALED]["truths"]
    got = outputs.get("answers") if isinstance(outputs, dict) else None
    if not isinstance(got, list) or len(got) != len(cases):
        raise CheckFailed(f"expected one answer per job ({len(cases)})")
    for i, (job, g, truth) in enumerate(zip(cases, got, truths, strict=True)):
        if why := problem(job, g, truth, i, len(cases)):
            raise CheckFailed(why)
    return (
        f"find_straggler named the slow rank and its phase in {len(cases)} recorded jobs "
        f"(every phase, on 2 and 3 ranks, with one-off hiccups on other ranks)"
    )


EXERCISE = Exercise(
    GRADE_ID,
    ("ex2_straggler",),
    "the straggler found in real traces",
    make_inputs,
    judge,
    run=run,
    timeout=60,
)


def visible(fn) -> None:
    """Visible check of exercise 2: eight jobs recorded now (about 12 s); under the grader the
    check is left to it (it records jobs of its own)."""
    if runner.grading():
        print("the straggler found in real traces: judged by the grader on jobs it records")
        return
    runner.visible(LAB, GRADE_ID, functions={"find_straggler": fn})
