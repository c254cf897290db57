"""Lab 8 exercise 1 (instructor only): the exact check, the diagnoses, the typical mistakes
and the solution cell of ``step_breakdown``.

``explain`` looks at the three values in order (compute, communication, exposed) and, for
the first that is wrong, recomputes it the ways students get it wrong (:func:`variant`):
durations summed (nested operators twice), intervals not clipped to the step, operators of
every thread, the trainer's ``ddp_lab:`` ranges or every range of the thread as compute,
concurrent collectives summed, exposed as a difference of totals or as every gap. A
diagnosis names a mistake only when it reproduces the student's values on every trace.
"""

from __future__ import annotations

from ddp_lab.answers import Hidden, Mistake
from ddp_lab.answers.lab08.references_ex1 import step_breakdown
from ddp_lab.checks.failure import CheckFailed
from ddp_lab.checks.lab08 import ex1_step_breakdown as ex
from ddp_lab.checks.lab08.common import COLLECTIVE_PREFIXES, PHASES, PREFIX
from ddp_lab.checks.values import number

GID = "test_ex1_step_breakdown"
CELL = "ex1_step_breakdown"

# --- twins ---------------------------------------------------------------------------------


def _union(spans) -> float:
    total, reach = 0.0, None
    for a, b in sorted(s for s in spans if s[1] > s[0]):
        if reach is None or a > reach:
            total, reach = total + b - a, b
        elif b > reach:
            total, reach = total + b - reach, b
    return total


def _pick(events, mark, keep, clip: str):
    """The spans of the events ``keep`` accepts, chosen and cut as ``clip`` says: ``"clip"``
    (overlapping, clipped), ``"overlap"`` (overlapping, whole), ``"start"`` (starting inside,
    whole), ``"start_clipped"`` (starting inside, end clipped)."""
    lo, hi = mark["ts"], mark["ts"] + mark["dur"]
    out = []
    for e in events:
        a, b = e["ts"], e["ts"] + e["dur"]
        if not keep(e):
            continue
        if clip in ("clip", "overlap") and (a >= hi or b <= lo):
            continue
        if clip in ("start", "start_clipped") and not lo <= a < hi:
            continue
        if clip == "clip":
            a, b = max(a, lo), min(b, hi)
        elif clip == "start_clipped":
            b = min(b, hi)
        out.append((a, b))
    return out


def _compute_filter(mode: str, mark):
    tid = mark["tid"]
    phases = {PREFIX + p for p in PHASES}
    return {
        "ops": lambda e: e.get("cat") == "cpu_op" and e["tid"] == tid,
        "all_threads": lambda e: e.get("cat") == "cpu_op",
        "phases": lambda e: e["name"] in phases and e["tid"] == tid,
        "thread": lambda e: e["tid"] == tid,
    }[mode]


def variant(
    events,
    compute: str = "ops",
    clip: str = "clip",
    nested: str = "union",
    comm: str = "union",
    exposed: str = "overlap",
) -> list[dict]:
    """``step_breakdown`` computed one of the wrong ways (the defaults: the right way)."""
    rows = []
    marks = sorted(
        (e for e in events if e["name"].startswith("ProfilerStep#")), key=lambda e: e["ts"]
    )
    for mark in marks:
        ops = _pick(events, mark, _compute_filter(compute, mark), clip)
        comms = _pick(events, mark, lambda e: e["name"].startswith(COLLECTIVE_PREFIXES), clip)
        busy = sum(b - a for a, b in ops) if nested == "sum" else _union(ops)
        talk = sum(b - a for a, b in comms) if comm == "sum" else _union(comms)
        if exposed == "subtract":
            hidden_not = max(0.0, talk - busy)
        elif exposed == "raw_subtract":
            hidden_not = talk - busy
        elif exposed == "idle":
            hidden_not = mark["dur"] - busy
        else:
            hidden_not = _union(ops + comms) - _union(ops)
        rows.append(
            {
                "step": int(mark["name"].split("#", 1)[1]),
                "step_ms": mark["dur"] / 1e3,
                "compute_ms": busy / 1e3,
                "comm_ms": talk / 1e3,
                "exposed_ms": hidden_not / 1e3,
            }
        )
    return rows


_UNCLIPPED = ("overlap", "start", "start_clipped")
_NESTED = (
    "nested operators counted twice: a parent operator's interval already holds its "
    "children's (aten::linear holds aten::addmm), so durations do not add up; take the "
    "union of the intervals"
)
_CLIP = (
    "intervals not clipped to the step: an operator or a collective that starts before the "
    "ProfilerStep range or ends after it counts only for its part inside the step"
)
_TWINS = {
    "compute_ms": [
        *[({"nested": "sum", "clip": c}, _NESTED) for c in ("clip", *_UNCLIPPED)],
        *[({"clip": c}, f"compute_ms: {_CLIP}") for c in _UNCLIPPED],
        (
            {"compute": "all_threads"},
            "compute_ms counts operators of other threads (a data loader's, gloo's): the "
            "step's compute is what the training thread, the ProfilerStep mark's tid, runs",
        ),
        (
            {"compute": "phases"},
            "compute_ms from the trainer's ddp_lab ranges: 'ddp_lab: backward' lasts until "
            "DDP's wait for the last buckets is over, so it covers time the training thread "
            "spends waiting, running no operator; count the operators (cat 'cpu_op')",
        ),
        (
            {"compute": "thread"},
            "compute_ms counts ranges that are not operators (the ProfilerStep range itself, "
            "the user annotations): only events with cat 'cpu_op' are operators",
        ),
    ],
    "comm_ms": [
        *[
            (
                {"comm": "sum", "clip": c},
                "concurrent collectives counted twice: gloo runs buckets on several worker "
                "threads at once, so the collectives' durations overlap each other; take the "
                "union of their intervals",
            )
            for c in ("clip", *_UNCLIPPED)
        ],
        *[({"clip": c}, f"comm_ms: {_CLIP}") for c in _UNCLIPPED],
    ],
    "exposed_ms": [
        *[
            (
                {"exposed": e},
                "exposed_ms as totals subtracted (comm minus compute): what matters is when "
                "they run, the part of the communication's time during which no operator runs",
            )
            for e in ("subtract", "raw_subtract")
        ],
        (
            {"exposed": "idle"},
            "exposed_ms counts every gap of the training thread: only the gaps during "
            "which a collective runs are exposed communication",
        ),
        (
            {"compute": "phases", "exposed": "overlap"},
            "exposed_ms measured against the trainer's ddp_lab ranges: 'ddp_lab: backward' "
            "covers DDP's wait, which is exactly the exposed time; measure against operators",
        ),
        (
            {"compute": "all_threads", "exposed": "overlap"},
            "exposed_ms hidden under operators of other threads: only the training thread's "
            "operators hide communication from the step",
        ),
    ],
}


def _field(results, field: str):
    return [[number(row.get(field)) for row in got] for got in results]


def _matches(values, rows: list[dict], field: str) -> bool:
    return len(values) == len(rows) and all(
        ex.close(v, r[field]) for v, r in zip(values, rows, strict=True)
    )


def _explain(inputs: dict, outputs: dict) -> str | None:
    results = outputs.get("results") if isinstance(outputs, dict) else None
    cases = inputs["cases"]
    if not isinstance(results, list) or len(results) != len(cases):
        return None
    if not all(isinstance(g, list) and all(isinstance(r, dict) for r in g) for g in results):
        return None
    truth = [ex.oracle(c["events"]) for c in cases]
    for field, twins in _TWINS.items():
        got = _field(results, field)
        if all(_matches(g, t, field) for g, t in zip(got, truth, strict=True)):
            continue
        for kwargs, reason in twins:
            twin = [variant(c["events"], **kwargs) for c in cases]
            if all(_matches(g, t, field) for g, t in zip(got, twin, strict=True)):
                return f"step_breakdown: {reason}"
        return None
    return None


def _check(inputs: dict, outputs: dict) -> None:
    for i, (case, got) in enumerate(zip(inputs["cases"], outputs["results"], strict=True)):
        if ex.row_problem(got, step_breakdown(case["events"]), f"trace {i + 1}"):
            raise CheckFailed(f"trace {i + 1} ({case['label']}) differs from the reference")


HIDDEN = {GID: Hidden(check=_check, explain=_explain)}

# --- the solution cell ---------------------------------------------------------------------

HEADER = '''def step_breakdown(events):
    """Where each profiled step's time went on one rank: compute, communication, and the
    communication that no computation hides.

    events: one rank's complete trace events (dicts with "name", "ph" == "X", "ts" and
    "dur" in microseconds, "tid", "pid", "cat"), in any order, as load_events returns them.

    For every ProfilerStep#k range (the "mark"), its window being [ts, ts + dur):
    - compute: the operators of the training thread, that is the events with
      cat == "cpu_op" whose tid is the mark's tid; other threads' events and the
      "user_annotation" ranges (ProfilerStep#k itself, "ddp_lab: backward", ...) are
      not operators of the step;
    - communication: the collectives, the events whose name starts with one of
      COLLECTIVE_PREFIXES (e.g. "gloo:all_reduce", on gloo's own threads), on any thread;
    - every interval is clipped to the window (what lies outside the step does not count),
      and time covered by several intervals of the same kind counts once.

    Returns:
        One dict per ProfilerStep range, in time order:
        {"step": k (int), "step_ms": the mark's dur,
         "compute_ms": the time in the window covered by at least one operator,
         "comm_ms": the time in the window covered by at least one collective,
         "exposed_ms": the time in the window covered by a collective and by no operator},
        all times in milliseconds (floats).

    Example:
        >>> events = [
        ...     {"name": "ProfilerStep#3", "ph": "X", "ts": 0, "dur": 10_000, "tid": 1,
        ...      "pid": 1, "cat": "user_annotation"},
        ...     {"name": "aten::linear", "ph": "X", "ts": 1_000, "dur": 4_000, "tid": 1,
        ...      "pid": 1, "cat": "cpu_op"},
        ...     {"name": "aten::addmm", "ph": "X", "ts": 1_500, "dur": 3_000, "tid": 1,
        ...      "pid": 1, "cat": "cpu_op"},
        ...     {"name": "gloo:all_reduce", "ph": "X", "ts": 4_000, "dur": 4_000, "tid": 2,
        ...      "pid": 1, "cat": "user_annotation"},
        ... ]
        >>> step_breakdown(events)
        [{'step': 3, 'step_ms': 10.0, 'compute_ms': 4.0, 'comm_ms': 4.0, 'exposed_ms': 3.0}]
    """
'''

_BODY = """
    def merged(spans):  # disjoint intervals covering the same time, in order
        out = []
        for start, end in sorted(s for s in spans if s[1] > s[0]):
            if out and start <= out[-1][1]:
                out[-1][1] = max(out[-1][1], end)
            else:
                out.append([start, end])
        return out

    def length(spans):
        return sum(end - start for start, end in spans)

    marks = [e for e in events if e["name"].startswith("ProfilerStep#")]
    rows = []
    for mark in sorted(marks, key=lambda e: e["ts"]):
        t0, t1 = mark["ts"], mark["ts"] + mark["dur"]
        ops, comms = [], []
        for e in events:
            span = (max(e["ts"], t0), min(e["ts"] + e["dur"], t1))  # clipped to the step
            if e.get("cat") == "cpu_op" and e["tid"] == mark["tid"]:
                ops.append(span)
            elif e["name"].startswith(COLLECTIVE_PREFIXES):
                comms.append(span)
        compute, comm = merged(ops), merged(comms)
        both = merged(compute + comm)
        rows.append({
            "step": int(mark["name"].split("#", 1)[1]),
            "step_ms": mark["dur"] / 1e3,
            "compute_ms": length(compute) / 1e3,
            "comm_ms": length(comm) / 1e3,
            # the time the collectives add to the operators: comm under no operator
            "exposed_ms": (length(both) - length(compute)) / 1e3,
        })
    return rows
"""

PRELUDE = "from ddp_lab.profiling import COLLECTIVE_PREFIXES\n\n\n"
SOLUTION_CELL = PRELUDE + HEADER + "    ### BEGIN SOLUTION" + _BODY + "    ### END SOLUTION\n"

# --- mistakes ------------------------------------------------------------------------------

# the sample class's: a student's own first attempt (durations added up, start inside)
_TYPICAL = """
    steps = [e for e in events if e["name"].startswith("ProfilerStep")]
    steps.sort(key=lambda e: e["ts"])
    result = []
    for s in steps:
        begin = s["ts"]
        finish = s["ts"] + s["dur"]
        busy = 0
        talking = 0
        for e in events:
            if e["ts"] < begin or e["ts"] >= finish:
                continue
            if e["cat"] == "cpu_op" and e["tid"] == s["tid"]:
                busy += e["dur"]
            elif e["name"].startswith(COLLECTIVE_PREFIXES):
                talking += e["dur"]
        idle = max(s["dur"] - busy, 0)
        result.append({
            "step": int(s["name"].split("#")[1]),
            "step_ms": s["dur"] / 1000,
            "compute_ms": busy / 1000,
            "comm_ms": talking / 1000,
            "exposed_ms": min(talking, idle) / 1000,
        })
    return result
"""

_UNION_STUDENT = """
    def union(spans):
        total, reach = 0.0, None
        for a, b in sorted(spans):
            if reach is None or a > reach:
                total, reach = total + b - a, b
            elif b > reach:
                total, reach = total + b - reach, b
        return total

    rows = []
    steps = sorted((e for e in events if e["name"].startswith("ProfilerStep#")),
                   key=lambda e: e["ts"])
    for s in steps:
        lo, hi = s["ts"], s["ts"] + s["dur"]

        def inside(e):
{clip}

        near = [e for e in events if e["ts"] < hi and e["ts"] + e["dur"] > lo]
        ops = [inside(e) for e in near if {is_op}]
        comms = [inside(e) for e in near if e["name"].startswith(COLLECTIVE_PREFIXES)]
        compute = union(ops)
        comm = {comm}
        exposed = {exposed}
        rows.append({{"step": int(s["name"].split("#")[1]), "step_ms": s["dur"] / 1e3,
                     "compute_ms": compute / 1e3, "comm_ms": comm / 1e3,
                     "exposed_ms": exposed / 1e3}})
    return rows
"""
_CLIPPED = '            return (max(e["ts"], lo), min(e["ts"] + e["dur"], hi))'
_WHOLE = '            return (e["ts"], e["ts"] + e["dur"])'
_OP = 'e["cat"] == "cpu_op" and e["tid"] == s["tid"]'
_PHASES = (
    'e["name"] in ("ddp_lab: data", "ddp_lab: forward", "ddp_lab: backward", '
    '"ddp_lab: optimizer") and e["tid"] == s["tid"]'
)


def _student(body: str) -> str:
    return PRELUDE + HEADER + body


def _union_student(
    clip=_CLIPPED, is_op=_OP, comm="union(comms)", exposed="union(ops + comms) - compute"
) -> str:
    return _student(_UNION_STUDENT.format(clip=clip, is_op=is_op, comm=comm, exposed=exposed))


MISTAKES = [
    Mistake(CELL, "typical", _student(_TYPICAL), "nested operators counted twice"),
    Mistake(
        CELL,
        "subtract",
        _union_student(exposed="max(0.0, comm - compute)"),
        "totals subtracted",
    ),
    Mistake(CELL, "no_clip", _union_student(clip=_WHOLE), "not clipped to the step"),
    Mistake(
        CELL,
        "all_threads",
        _union_student(is_op='e["cat"] == "cpu_op"'),
        "operators of other threads",
    ),
    Mistake(CELL, "backward_range", _union_student(is_op=_PHASES), "the trainer's ddp_lab ranges"),
    Mistake(
        CELL,
        "comm_sum",
        _union_student(comm="sum(b - a for a, b in comms)"),
        "concurrent collectives counted twice",
    ),
]
