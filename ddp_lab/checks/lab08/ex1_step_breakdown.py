"""Exercise 1, ``step_breakdown(events)``: per profiled step, the compute, the communication
and the *exposed* communication (the part no computation hides) of one rank's trace.

``events`` are one rank's complete Chrome-trace events (``ph`` ``"X"``; ``ts`` and ``dur``
in microseconds; ``name``, ``cat``, ``tid``, ``pid``), as
``ddp_lab.figures.profile.load_events`` returns them. For every ``ProfilerStep#k`` range
(the *mark*; its window is ``[ts, ts + dur)``), in time order, the student returns
``{"step": k, "step_ms", "compute_ms", "comm_ms", "exposed_ms"}``:

- ``step_ms``: the mark's ``dur``;
- ``compute_ms``: the length of the union of the intervals of the operators (``cat ==
  "cpu_op"``) whose ``tid`` is the mark's (the training thread), each clipped to the window:
  nested operators count once, other threads' operators not at all, and neither do the
  ``user_annotation`` ranges (``ProfilerStep#k``, ``ddp_lab: backward``, ...);
- ``comm_ms``: the length of the union of the intervals of the collectives (a ``name``
  starting with one of ``COLLECTIVE_PREFIXES``, ``gloo:all_reduce`` on gloo's worker
  threads), on any thread, clipped to the window: concurrent collectives count once;
- ``exposed_ms``: the length of the time in the window covered by a collective and by no
  operator of the training thread.

The judge's oracle rasterises each window exactly: it cuts the window at every clipped
interval's ends into elementary segments, counts with a running sum (``torch.cumsum``) how
many intervals of each set cover each segment, and adds the lengths of the covered segments.
No interval is merged. Every value must agree within 1e-3 ms (1 microsecond) plus 1e-6 of
itself.

Case set (every draw; the grading run records the real traces at grading time):

- real traces: 4 DDP jobs in one ``torchrun`` launch of 3 gloo ranks
  (:mod:`~ddp_lab.checks.lab08.trace_jobs`), every rank's trace: one bucket or several
  times a plain or a slow link, two of the jobs on 2 ranks and two on 3 (drawn), 2 or 3
  profiled steps each. Collectives across a step's edge and collectives of two gloo
  threads at once happen there, but not in every draw, hence
- synthetic traces built here, random times inside, events never in time order: nested
  operators and concurrent collectives over 3 steps; operators and collectives across each
  step's start (far into the step) and end (into the gap after it), over 2 steps; a step
  without communication (and a collective before every step); communication fully hidden
  under an operator; fully exposed (in a gap that the ``ddp_lab: backward`` range covers,
  as DDP's wait for the last bucket does); operators of other threads (a data loader's,
  gloo's) in the training thread's gaps.
"""

from __future__ import annotations

import math

import torch

from ddp_lab.checks import runner
from ddp_lab.checks.contract import Exercise
from ddp_lab.checks.failure import CheckFailed
from ddp_lab.checks.lab08 import trace_jobs
from ddp_lab.checks.lab08.common import COLLECTIVE_PREFIXES, LAB, PREFIX
from ddp_lab.checks.values import kind, number, plain, randint, uniform

KEYS = ("step", "step_ms", "compute_ms", "comm_ms", "exposed_ms")
ATOL_MS, RTOL = 1e-3, 1e-6
#: what each value is, for messages
MEANS = {
    "step_ms": "the ProfilerStep range's duration",
    "compute_ms": "the union of the training thread's operators, clipped to the step",
    "comm_ms": "the union of the collectives, clipped to the step",
    "exposed_ms": "the time a collective runs while the training thread runs no operator",
}
PID, MAIN, GLOO1, GLOO2, LOADER = 4242, 4242, 4260, 4261, 4270


# --- real traces ---------------------------------------------------------------------------


def draw_jobs(gen: torch.Generator) -> list[dict]:
    """One bucket and several, a plain and a slow link: the four pairings, each on a drawn
    world size (two jobs on 2 ranks, two on 3)."""
    worlds = [[2, 2, 3, 3][i] for i in torch.randperm(4, generator=gen).tolist()]
    specs = []
    for i, (one, slow) in enumerate([(True, False), (True, True), (False, False), (False, True)]):
        specs.append(
            {
                "world_size": worlds[i],
                "cap": uniform(gen, 8.0, 25.0) if one else uniform(gen, 0.25, 0.5),
                "slow": uniform(gen, 3.0, 6.0) if slow else 0.0,
                "active": randint(gen, 2, 3),
                "seed": randint(gen, 0, 10_000),
            }
        )
    return specs


def _job_label(spec: dict, rank: int) -> str:
    buckets = "one DDP bucket" if spec["cap"] > 2 * trace_jobs.model_mb() else "several buckets"
    link = "a slow link" if spec["slow"] else "a plain link"
    return f"a real trace ({spec['world_size']} ranks, {buckets}, {link}), rank {rank}"


def real_cases(specs: list[dict]) -> list[dict]:
    """Every rank's trace of the jobs, recorded now."""
    traces = trace_jobs.run_jobs(specs)
    return [
        {"label": _job_label(spec, r), "events": events}
        for spec, ranks in zip(specs, traces, strict=True)
        for r, events in enumerate(ranks)
    ]


# --- synthetic traces ----------------------------------------------------------------------


class _Trace:
    """Events of a made-up trace, times in microseconds from a drawn origin."""

    def __init__(self, gen: torch.Generator):
        self.gen, self.events = gen, []
        self.origin = uniform(gen, 1e12, 6e12)

    def add(self, name: str, start: float, end: float, tid: int = MAIN, cat: str = "cpu_op"):
        ts = round(self.origin + start, 3)
        self.events.append(
            {"name": name, "ph": "X", "ts": ts, "dur": round(end - start, 3), "tid": tid,
             "pid": PID, "cat": cat}
        )  # fmt: skip

    def comm(self, start: float, end: float, tid: int = GLOO1):
        self.add("gloo:all_reduce", start, end, tid, "user_annotation")

    def phase(self, phase: str, start: float, end: float):
        self.add(PREFIX + phase, start, end, MAIN, "user_annotation")

    def step(self, k: int, start: float, end: float):
        self.add(f"ProfilerStep#{k}", start, end, MAIN, "user_annotation")

    def u(self, low: float, high: float) -> float:
        return uniform(self.gen, low, high)

    def shuffled(self) -> list[dict]:
        order = torch.randperm(len(self.events), generator=self.gen).tolist()
        out = [self.events[i] for i in order]
        times = [e["ts"] for e in out]
        return out[::-1] if times == sorted(times) else out  # never in time order


def _nested(gen) -> list[dict]:
    """3 steps: operators nested 3 deep, two gloo threads' collectives overlapping, the
    last bucket's wait a gap inside the backward range."""
    t, at, first = _Trace(gen), 0.0, randint(gen, 2, 9)
    for k in range(first, first + 3):
        n = t.u(4000, 5000)
        t.step(k, at, at + n)
        t.phase("data", at + 10, at + 200)
        t.add("aten::randn", at + 20, at + t.u(120, 180))
        t.phase("forward", at + 210, at + 1200)
        t.add("aten::linear", at + 220, at + 700)
        t.add("aten::addmm", at + 230, at + t.u(600, 690))
        t.add("aten::relu", at + 710, at + t.u(740, 790))
        t.phase("backward", at + 1210, at + n - 600)
        t.add("autograd::engine::evaluate_function: AddmmBackward0", at + 1220, at + 2000)
        t.add("AddmmBackward0", at + 1225, at + 1990)
        t.add("aten::mm", at + 1230, at + t.u(1500, 1600))
        t.add("aten::mm", at + 1610, at + t.u(1900, 1980))
        t.add("aten::copy_", at + 2100, at + t.u(2300, 2400))
        t.comm(at + t.u(1450, 1550), at + t.u(2250, 2350), GLOO1)
        t.comm(at + t.u(1750, 1850), at + t.u(2800, 2950), GLOO2)
        t.comm(at + t.u(2960, 3000), at + n - t.u(660, 700), GLOO1)
        t.add("torch.distributed.ddp.reducer::copy_bucket_to_grad", at + n - 650, at + n - 610)
        t.phase("optimizer", at + n - 590, at + n - 40)
        t.add("aten::add_", at + n - 580, at + n - t.u(300, 320))
        t.add("aten::add_", at + n - 290, at + n - t.u(50, 60))
        at += n + t.u(20, 80)
    return t.shuffled()


def _edges(gen) -> list[dict]:
    """2 steps: an operator and a collective across each edge of each step (those across a
    start reach far into the step, those across an end stop in the gap after it)."""
    t = _Trace(gen)
    a1, gap = t.u(3000, 4000), t.u(300, 400)
    b0, b1 = a1 + gap, a1 + gap + t.u(3000, 4000)
    k = randint(gen, 2, 9)
    t.step(k, 0, a1)
    t.step(k + 1, b0, b1)
    t.add("aten::copy_", -t.u(200, 400), t.u(1100, 1300))
    t.comm(-t.u(300, 600), t.u(1000, 1300))
    t.add("aten::mm", 1500, t.u(2000, 2200))
    t.add("aten::add_", a1 - t.u(150, 250), a1 + t.u(50, 150))
    t.comm(a1 - t.u(300, 500), a1 + t.u(100, 250), GLOO2)
    t.add("aten::mul_", b0 - t.u(50, 150), b0 + t.u(1000, 1300))
    t.comm(b0 - t.u(50, 150), b0 + t.u(1000, 1300))
    t.add("aten::mm", b0 + 1500, b0 + t.u(2000, 2200))
    t.add("aten::addmm", b1 - t.u(300, 400), b1 + t.u(100, 300))
    t.comm(b1 - t.u(300, 500), b1 + t.u(100, 300), GLOO2)
    return t.shuffled()


def _no_comm(gen) -> list[dict]:
    """2 steps, the first without communication; a collective before every step."""
    t = _Trace(gen)
    k = randint(gen, 2, 9)
    t.comm(-t.u(900, 1200), -t.u(200, 400))
    n = t.u(2000, 3000)
    t.step(k, 0, n)
    t.add("aten::linear", 100, t.u(900, 1100))
    t.add("aten::addmm", 120, t.u(700, 880))
    t.add("aten::add_", 1300, t.u(1500, 1700))
    b = n + t.u(50, 100)
    t.step(k + 1, b, b + n)
    t.add("aten::mm", b + 100, b + t.u(800, 900))
    t.comm(b + t.u(850, 950), b + t.u(1500, 1700))
    t.add("aten::add_", b + 1750, b + t.u(1800, 1900))
    return t.shuffled()


def _hidden(gen) -> list[dict]:
    """1 step: both collectives under one long operator (nothing exposed)."""
    t = _Trace(gen)
    n = t.u(3000, 4000)
    t.step(randint(gen, 2, 9), 0, n)
    t.phase("backward", 50, n - 100)
    t.add("autograd::engine::evaluate_function: MmBackward0", 100, n - t.u(200, 400))
    t.add("aten::mm", 110, n - t.u(500, 700))
    t.comm(t.u(300, 500), t.u(1200, 1500))
    t.comm(t.u(1000, 1100), t.u(1800, 2200), GLOO2)
    return t.shuffled()


def _exposed(gen) -> list[dict]:
    """1 step: the collective in a gap of the training thread, inside the backward range
    (DDP waiting for its last bucket)."""
    t = _Trace(gen)
    n = t.u(3000, 4000)
    t.step(randint(gen, 2, 9), 0, n)
    t.phase("forward", 20, 600)
    t.add("aten::linear", 30, t.u(450, 580))
    t.phase("backward", 610, n - 300)
    t.add("aten::mm", 620, t.u(800, 1000))
    t.comm(t.u(1050, 1150), n - t.u(450, 550))
    t.add("torch.distributed.ddp.reducer::copy_bucket_to_grad", n - 420, n - t.u(320, 380))
    t.phase("optimizer", n - 290, n - 20)
    t.add("aten::add_", n - 280, n - t.u(30, 60))
    return t.shuffled()


def _threads(gen) -> list[dict]:
    """2 steps: a data loader's operators and gloo's in the training thread's gaps."""
    t = _Trace(gen)
    k, at = randint(gen, 2, 9), 0.0
    for step in (k, k + 1):
        n = t.u(3000, 4000)
        t.step(step, at, at + n)
        t.add("aten::mm", at + 50, at + t.u(900, 1100))
        t.comm(at + t.u(700, 800), at + t.u(2200, 2400))
        t.add("aten::copy_", at + t.u(1400, 1500), at + t.u(1700, 1800), GLOO1)
        t.add("aten::stack", at + t.u(1200, 1300), at + t.u(2000, 2100), LOADER)
        t.add("aten::add_", at + n - 500, at + n - t.u(50, 100))
        at += n + t.u(30, 60)
    return t.shuffled()


SYNTHETIC = {
    "nested operators and concurrent collectives, 3 steps": _nested,
    "operators and collectives across the steps' edges": _edges,
    "a step without communication": _no_comm,
    "communication hidden under an operator": _hidden,
    "communication exposed in a gap of the backward range": _exposed,
    "operators of other threads": _threads,
}


def synthetic_cases(gen: torch.Generator) -> list[dict]:
    return [
        {"label": f"a synthetic trace: {what}", "events": make(gen)}
        for what, make in SYNTHETIC.items()
    ]


def make_inputs(gen: torch.Generator) -> dict:
    """The real traces (recorded now, one launch) and the synthetic ones."""
    return {"cases": real_cases(draw_jobs(gen)) + synthetic_cases(gen)}


def visible_inputs(gen: torch.Generator) -> dict:
    """The synthetic traces only (no launch in the notebook's check)."""
    return {"cases": synthetic_cases(gen)}


def run(ns: dict, inputs: dict, workdir) -> dict:
    """The student's breakdown of every trace (copies in, plain values out)."""
    fn = ns["step_breakdown"]
    return {"results": [plain(fn([dict(e) for e in c["events"]])) for c in inputs["cases"]]}


# --- the oracle ----------------------------------------------------------------------------


def _segments(window, *interval_sets):
    """Cut ``window`` at every end of the intervals (clipped to it): the segments' lengths,
    and for each set a mask of the segments some interval of the set covers."""
    lo, hi = window
    cuts = [lo, hi]
    clipped = []
    for spans in interval_sets:
        kept = [(max(a, lo), min(b, hi)) for a, b in spans if min(b, hi) > max(a, lo)]
        clipped.append(kept)
        cuts += [x for span in kept for x in span]
    edges = torch.unique(torch.tensor(cuts, dtype=torch.float64))  # sorted
    masks = []
    for kept in clipped:
        count = torch.zeros(len(edges), dtype=torch.int64)
        if kept:
            starts = torch.searchsorted(
                edges, torch.tensor([a for a, _ in kept], dtype=torch.float64)
            )
            ends = torch.searchsorted(
                edges, torch.tensor([b for _, b in kept], dtype=torch.float64)
            )
            count.index_add_(0, starts, torch.ones_like(starts))
            count.index_add_(0, ends, -torch.ones_like(ends))
        masks.append(torch.cumsum(count, 0)[:-1] > 0)
    return edges.diff(), masks


def oracle(events: list[dict]) -> list[dict]:
    """The expected rows of one trace (see the module docstring)."""

    def span(e):
        return (float(e["ts"]), float(e["ts"]) + float(e["dur"]))

    marks = [e for e in events if str(e["name"]).startswith("ProfilerStep#")]
    rows = []
    for mark in sorted(marks, key=lambda e: e["ts"]):
        ops = [span(e) for e in events if e.get("cat") == "cpu_op" and e.get("tid") == mark["tid"]]
        comms = [span(e) for e in events if str(e["name"]).startswith(COLLECTIVE_PREFIXES)]
        length, (busy, talking) = _segments(span(mark), ops, comms)
        rows.append(
            {
                "step": int(str(mark["name"]).rsplit("#", 1)[1]),
                "step_ms": float(mark["dur"]) / 1e3,
                "compute_ms": float(length[busy].sum()) / 1e3,
                "comm_ms": float(length[talking].sum()) / 1e3,
                "exposed_ms": float(length[talking & ~busy].sum()) / 1e3,
            }
        )
    return rows


def close(got: float, want: float) -> bool:
    return math.isfinite(got) and abs(got - want) <= ATOL_MS + RTOL * abs(want)


def row_problem(got, want: list[dict], where: str) -> str | None:
    """What is wrong with one trace's result, or None."""
    if not isinstance(got, list):
        return (
            f"{where}: step_breakdown returned {kind(got)}; expected a list of dicts, one per step"
        )
    if len(got) != len(want):
        return f"{where}: expected {len(want)} rows (one per ProfilerStep range), got {len(got)}"
    for row, w in zip(got, want, strict=True):
        at = f"{where}, ProfilerStep#{w['step']}"
        if not isinstance(row, dict) or set(KEYS) - set(row):
            return f"{at}: each row must be a dict with keys {', '.join(KEYS)}, got {row!r:.100}"
        if number(row["step"]) != w["step"]:
            return f"{at}: 'step' should be {w['step']} (rows in time order), got {row['step']!r}"
        for key in KEYS[1:]:
            value = number(row[key])
            if not close(value, w[key]):
                shown = f"{value:.4f}" if math.isfinite(value) else f"{row[key]!r:.40}"
                return f"{at}: {key} should be {w[key]:.4f} ms ({MEANS[key]}), got {shown}"
    return None


def judge(inputs: dict, outputs: dict) -> str:
    """Every step of every trace against the rasterised oracle."""
    results = outputs.get("results") if isinstance(outputs, dict) else None
    cases = inputs["cases"]
    if not isinstance(results, list) or len(results) != len(cases):
        raise CheckFailed(f"expected one result per trace ({len(cases)})")
    for i, (case, got) in enumerate(zip(cases, results, strict=True)):
        where = f"trace {i + 1} of {len(cases)} ({case['label']})"
        if why := row_problem(got, oracle(case["events"]), where):
            raise CheckFailed(why)
    real = sum(c["label"].startswith("a real") for c in cases)
    kinds = f"{real} real, {len(cases) - real} synthetic" if real else "synthetic"
    return (
        f"step_breakdown gives every step's compute, communication and exposed communication "
        f"of {len(cases)} traces ({kinds}: nested operators, the steps' edges, other threads, "
        "hidden and exposed communication)"
    )


EXERCISE = Exercise(
    "test_ex1_step_breakdown",
    ("ex1_step_breakdown",),
    "a profiled step's compute, communication and exposed communication",
    make_inputs,
    judge,
    run=run,
    visible_inputs=visible_inputs,
    timeout=60,
)


def visible(fn) -> None:
    """Visible check of exercise 1: the synthetic traces (nested operators, edges, other
    threads, hidden and exposed communication), against the rasterised oracle."""
    runner.visible(LAB, "test_ex1_step_breakdown", functions={"step_breakdown": fn})
