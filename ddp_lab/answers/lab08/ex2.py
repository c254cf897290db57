"""Lab 8 exercise 2 (``find_straggler``), instructor only: the exact check, the named
misreadings, the typical mistakes and the solution cell.

The kit's judge already compares every job's answer with the truth of its construction, so
the exact check only adds the reference's own answer where it differs (it never does on the
case set: ``tests/test_lab08_ex2.py``). ``explain`` names the misreading that every wrong
answer of a run fits, in this order:

- one step read alone (the first profiled step: a hiccup there passes for the straggler);
- the data phase left out (every wrong answer is on a job slowed in its data loading);
- the rank with the most time in collectives, and a phase it spent waiting (a victim that
  waited, not the culprit);
- a phase taken by its raw length (most of it spent waiting in collectives);
- the rank with the longest step (``ProfilerStep``) and its longest phase (a rank's step
  lasts as long as the slowest rank's; a hiccup at the last step's optimizer makes that rank's
  steps longest, and that optimizer is no waiting).
"""

from __future__ import annotations

import statistics

from ddp_lab.answers import Hidden, Mistake
from ddp_lab.answers.lab08 import references_ex2 as ref
from ddp_lab.checks.contract import SEALED
from ddp_lab.checks.failure import CheckFailed
from ddp_lab.checks.lab08 import ex2_straggler as ex2

GRADE_ID = ex2.GRADE_ID
CELL = "ex2_straggler"


def _check(inputs: dict, outputs: dict) -> None:
    for i, (job, got) in enumerate(zip(inputs["jobs"], outputs["answers"], strict=True)):
        if got != ref.find_straggler(job["traces"]):
            raise CheckFailed(f"job {i + 1}: your answer differs from the reference's")


# --- the misreadings -------------------------------------------------------------------------


def _sum(events, prefix) -> float:
    return sum(e["dur"] for e in events if e["name"].startswith(prefix))


def _longest_step(job, got, truth) -> bool:
    traces = job["traces"]
    steps = [_sum(t, "ProfilerStep#") for t in traces]
    r = got["rank"]
    raw = {p: _sum(traces[r], "ddp_lab: " + p) for p in ref.PHASES}
    rest = [s for q, s in enumerate(steps) if q != r]
    return steps[r] > max(rest) and raw[got["phase"]] == max(raw.values()) > 0


def _victim(job, got, truth) -> bool:
    comm = [_sum(t, ref.COLLECTIVES) for t in job["traces"]]
    rest = [c for q, c in enumerate(comm) if q != got["rank"]]
    return got["rank"] != truth["rank"] and comm[got["rank"]] > max(rest)


def _waiting(job, got, truth) -> bool:
    """The named phase spends more than half its time, at the median step, in collectives."""
    events = job["traces"][got["rank"]]
    own = statistics.median(ref.own_times(events)[got["phase"]])
    name = "ddp_lab: " + got["phase"]
    marks = [e for e in events if e["name"].startswith("ProfilerStep#")]
    raw = statistics.median(
        sum(
            e["dur"]
            for e in events
            if e["name"] == name and m["ts"] <= e["ts"] < m["ts"] + m["dur"]
        )
        for m in marks
    )
    return raw > 0 and own < raw / 2


_NOT_WORK = "time spent waiting in collectives is not work"

_READINGS = (
    (
        lambda job, got, truth: got == ref.straggler(job["traces"], steps=[0]),
        "one step is not enough: on the first profiled step another rank paused once (a "
        "hiccup: a logging step, a GC pause) and looked slower than the straggler; the "
        "straggler is slow on every step: compare the ranks over all profiled steps (the "
        "median ignores a one-off pause)",
    ),
    (
        lambda job, got, truth: truth["phase"] == "data",
        "the jobs you got wrong are all slowed in their data loading: the data phase is a "
        "phase of the step too (the others wait for that rank all the same)",
    ),
    (
        lambda job, got, truth: _victim(job, got, truth) and _waiting(job, got, truth),
        "you named the rank that spent the most time in collectives: a rank whose all-reduce "
        "waits for a slow rank's is a victim, not the culprit (the straggler arrives last, "
        f"with short collectives); {_NOT_WORK}",
    ),
    (
        _waiting,
        "the phase you named spends most of its time waiting in collectives on that rank "
        f"(its all-reduce waits for the straggler), and {_NOT_WORK}: subtract the "
        "collectives' time from a phase before you compare it with the other ranks'",
    ),
    (
        _longest_step,
        "you named the rank with the longest step: in a synchronous job every rank's step "
        "lasts as long as the slowest rank's, so the step's length does not tell who is slow "
        "(here one rank's last step was longest because it paused once after its last "
        "all-reduce)",
    ),
)


def _explain(inputs: dict, outputs: dict) -> str | None:
    truths = inputs[SEALED]["truths"]
    got = outputs.get("answers") if isinstance(outputs, dict) else None
    if not isinstance(got, list) or len(got) != len(truths):
        return None
    n = len(truths)
    wrong = [
        (job, g, t)
        for i, (job, g, t) in enumerate(zip(inputs["jobs"], got, truths, strict=True))
        if ex2.problem(job, g, t, i, n)
    ]
    if not wrong or any(ex2.answer_problem(g, job["world_size"]) for job, g, _ in wrong):
        return None
    for fits, why in _READINGS:
        if all(_holds(fits, job, g, t) for job, g, t in wrong):
            return f"{len(wrong)} of {n} jobs answered wrong: {why}"
    return None


def _holds(fits, job, got, truth) -> bool:
    """``fits`` on one wrong answer; a trace it cannot read (no steps) fits no reading."""
    try:
        return bool(fits(job, got, truth))
    except (ValueError, KeyError, TypeError, IndexError):  # statistics.StatisticsError too
        return False


HIDDEN = {GRADE_ID: Hidden(check=_check, explain=_explain)}

# --- the solution cell and the mistakes ------------------------------------------------------

_CONTRACT = '''def find_straggler(traces):
    """The straggler of a synchronous data-parallel job: ``{"rank": r, "phase": p}``.

    Args:
        traces: every rank's trace, rank 0 first: a list of complete events (dicts with
            "name", "ph", "ts" and "dur" in microseconds, "tid", "pid", "cat"), as
            load_events returns them, of a few profiled steps (one "ProfilerStep#k" range
            each); the phases are the "ddp_lab: data", "ddp_lab: forward",
            "ddp_lab: backward" and "ddp_lab: optimizer" ranges, the backend's collectives
            are the events whose names start with one of COLLECTIVE_PREFIXES.

    Returns:
        the rank whose own work in one phase ("data", "forward", "backward" or "optimizer")
        is longer than every other rank's in that phase, step after step, and that phase.
        A phase's own time is its duration minus the time one of the rank's collectives ran
        within it (waiting for the others is not work). Another rank may pause once, on one
        step, for longer than the straggler's slowdown (a hiccup): that is not the straggler.
    """
'''

SOLUTION_CELL = (
    "import statistics\n\n"
    "from ddp_lab.profiling import COLLECTIVE_PREFIXES, PHASES\n\n\n"
    + _CONTRACT
    + '''    ### BEGIN SOLUTION
    def own(events):
        """{phase: [own time per profiled step]} of one rank."""
        busy = sorted(
            (e["ts"], e["ts"] + e["dur"])
            for e in events
            if e["name"].startswith(COLLECTIVE_PREFIXES)
        )
        steps = [e for e in events if e["name"].startswith("ProfilerStep#")]
        out = {p: [] for p in PHASES}
        for mark in sorted(steps, key=lambda e: e["ts"]):
            t0, t1 = mark["ts"], mark["ts"] + mark["dur"]
            for phase in PHASES:
                total = 0.0
                for e in events:
                    if e["name"] == "ddp_lab: " + phase and t0 <= e["ts"] < t1:
                        a, b = e["ts"], e["ts"] + e["dur"]
                        end, waited = a, 0.0  # the union of collectives within [a, b]
                        for x, y in busy:
                            x, y = max(x, end), min(y, b)
                            if y > x:
                                waited += y - x
                                end = y
                        total += e["dur"] - waited
                out[phase].append(total)
        return out

    typical = [{p: statistics.median(t) for p, t in own(ev).items()} for ev in traces]
    best = None
    for r, mine in enumerate(typical):
        for p in PHASES:
            others = max(t[p] for q, t in enumerate(typical) if q != r)
            if best is None or mine[p] - others > best[0]:
                best = (mine[p] - others, r, p)
    return {"rank": best[1], "phase": best[2]}
    ### END SOLUTION
'''
)

_TYPICAL = '''def find_straggler(traces):
    """The slowest rank makes everybody wait for it, so it has to be the rank that spends
    the most time communicating; its slow phase is the one where that time shows up."""
    comm = []
    for events in traces:
        comm.append(sum(e["dur"] for e in events if e["name"].startswith(("gloo:", "nccl:"))))
    rank = comm.index(max(comm))
    lengths = {}
    for e in traces[rank]:
        name = e["name"].replace("ddp_lab: ", "")
        if e["name"].startswith("ddp_lab: ") and name in ("data", "forward", "backward",
                                                           "optimizer"):
            lengths.setdefault(name, []).append(e["dur"])
    # the middle value of each phase, so one odd step does not decide
    phase = max(lengths, key=lambda p: sorted(lengths[p])[len(lengths[p]) // 2])
    return {"rank": rank, "phase": phase}
'''

_LONGEST_STEP = """def find_straggler(traces):
    def total(events, name):
        return sum(e["dur"] for e in events if e["name"].startswith(name))

    step_time = [total(events, "ProfilerStep#") for events in traces]
    slow = step_time.index(max(step_time))  # the straggler's steps take longest
    phases = ["data", "forward", "backward", "optimizer"]
    times = [total(traces[slow], "ddp_lab: " + p) for p in phases]
    return {"rank": slow, "phase": phases[times.index(max(times))]}
"""


def _edit(*pairs: tuple[str, str]) -> str:
    text = "".join(line for line in SOLUTION_CELL.splitlines(keepends=True) if "### " not in line)
    for old, new in pairs:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    return text


_LONGEST_PHASE = """import statistics


def find_straggler(traces):
    # the slow phase is the longest phase anywhere: the rank it is on is the straggler
    best = None
    for rank, events in enumerate(traces):
        steps = [e for e in events if e["name"].startswith("ProfilerStep#")]
        for phase in ("data", "forward", "backward", "optimizer"):
            lengths = []
            for s in steps:
                t0, t1 = s["ts"], s["ts"] + s["dur"]
                name = "ddp_lab: " + phase
                lengths.append(sum(e["dur"] for e in events
                                   if e["name"] == name and t0 <= e["ts"] < t1))
            typical = statistics.median(lengths)  # one odd step does not count
            if best is None or typical > best[0]:
                best = (typical, rank, phase)
    return {"rank": best[1], "phase": best[2]}
"""

MISTAKES = [
    Mistake(CELL, "victim", _TYPICAL, "a victim, not the culprit"),
    Mistake(CELL, "longest_step", _LONGEST_STEP, "you named the rank with the longest step"),
    Mistake(CELL, "longest_phase", _LONGEST_PHASE, _NOT_WORK),
    Mistake(
        CELL,
        "one_step",  # the first profiled step alone
        _edit(
            (
                '        for mark in sorted(steps, key=lambda e: e["ts"]):\n',
                '        for mark in sorted(steps, key=lambda e: e["ts"])[:1]:  # one step\n',
            )
        ),
        "one step is not enough",
    ),
    Mistake(
        CELL,
        "no_data",  # data loading is not the model's work: left out
        _edit(
            (
                "    for r, mine in enumerate(typical):\n        for p in PHASES:\n",
                "    for r, mine in enumerate(typical):\n"
                '        for p in ("forward", "backward", "optimizer"):\n',
            )
        ),
        "the data phase is a phase of the step too",
    ),
]
