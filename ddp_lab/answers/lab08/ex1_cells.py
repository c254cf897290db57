"""Lab 8 exercise 1's notebook cells (instructor only): where a profiled step's time goes.

``CELLS`` is the section as the lead assembles it into the notebook: prose, the solution
cell, the test cell, a predict-then-explain question, the demo it refers to (real DDP jobs
recorded with the profiler, drawn as timelines, broken down by the student's function) and
the written answer (2 points).
"""

from __future__ import annotations

from ddp_lab.answers.lab08.ex1 import SOLUTION_CELL
from ddp_lab.grading.authoring import code, md, solution, test, written

_INTRO = r"""
## 1. Where a step's time goes

`torch.profiler` records what each thread of a process did, and when. Its Chrome trace
(what `--profile` writes, one file per rank) is a list of *events*: each has a `name`, a
start `ts` and a duration `dur` in microseconds, the thread that ran it (`tid`) and a
category (`cat`). `load_events` keeps the complete ones (`"ph": "X"`). Three kinds matter
here:

- **operators** (`cat == "cpu_op"`): `aten::addmm`, `aten::mm`,
  `autograd::engine::evaluate_function: AddmmBackward0`, ... They *nest*: `aten::linear` calls
  `aten::addmm`, the autograd engine's node calls `AddmmBackward0`, which calls `aten::mm`,
  and each of them is an event whose interval holds its children's;
- **ranges** (`cat == "user_annotation"`): the profiler's `ProfilerStep#k`, one per recorded
  step, and the trainer's `ddp_lab: data / forward / backward / optimizer`. They say which
  part of the loop the thread was in, not that it was computing;
- **collectives**: `gloo:all_reduce`, recorded on one of gloo's own worker threads (not the
  training thread), from the moment gloo starts moving a bucket until it is done (on GPUs,
  the NCCL kernels, on a CUDA stream).

DDP overlaps: its autograd hooks hand a bucket to the backend as soon as all of the bucket's
gradients are ready, and the backward pass goes on computing the next layers' gradients
while gloo moves the bytes. At the end of `backward()`, DDP waits for every bucket's
all-reduce to finish. While it waits, the training thread runs no operator: the wait is a
*gap* between operators, still inside the `ddp_lab: backward` range.

So per step three numbers tell the story: the **compute** (the time the training thread runs
operators), the **communication** (the time some collective is in flight), and the
**exposed communication**, the part of the communication during which the training thread
computes nothing. Exposed communication is what a faster link, or better overlap, would
save; hidden communication costs nothing.

### Exercise 1 (4 points): `step_breakdown`

Write `step_breakdown(events)`; the docstring is the contract. Think in intervals on a time
line, not in durations: overlapping intervals of one kind cover some time once, an event may
start before its step or end after it, and *exposed* is about when things happen, not about
how long they last in total.

The grader records real traces when it grades: several DDP jobs on 2 and 3 gloo ranks, with
one bucket and with several, on a plain and on a slowed link (every rank's trace), and adds
made-up traces for the cases real ones do not always show: operators nested 3 deep,
collectives of two gloo threads at once, events across a step's edges, a step without
communication, communication fully hidden and fully exposed, operators of other threads, and
events out of time order. Its oracle cuts each step's window into the pieces between
consecutive interval ends and counts what covers each piece; your values must agree within
1 microsecond.
"""

_TEST = """# Checks step_breakdown on made-up traces: nested operators, events across the steps'
# edges, other threads, hidden and exposed communication (the grader adds real traces).
checks.step_breakdown(step_breakdown)
### BEGIN HIDDEN TESTS
from ddp_lab.grading.verdict import hidden_test
hidden_test("test_ex1_step_breakdown")
### END HIDDEN TESTS"""

_QUESTION = r"""
**Predict, then explain (written answer, 2 points).** The next cell records three small DDP
jobs on 2 gloo ranks (the same MLP, 2 MB of gradients) and breaks every rank's steps down
with your function:

- **A**: buckets of about 0.4 MB (several buckets), a plain link;
- **B**: the same buckets, a link 5 times slower (each all-reduce moves 6 times the bytes);
- **C**: one bucket (`bucket_cap_mb=25`), the plain link.

Before you run it, predict: (a) from A to B, does the exposed communication grow by less
than, about as much as, or more than the communication itself? (b) From A to C, what happens
to the exposed share of the communication, and why? Then run the cell and explain what the
timelines show: where in the backward pass each job's first collective starts, and what the
training thread does while the last one runs.
"""

_DEMO = r"""
import tempfile

from ddp_lab.checks.lab08.trace_jobs import run_jobs
from ddp_lab.figures.profile import step_timeline

if not checks.GRADING:  # (the grader skips the demonstrations: it judges the exercises)
    jobs = {
        "A: several buckets, plain link": {"cap": 0.4, "slow": 0.0},
        "B: several buckets, slow link": {"cap": 0.4, "slow": 5.0},
        "C: one bucket, plain link": {"cap": 25.0, "slow": 0.0},
    }
    specs = [{"world_size": 2, "active": 3, "seed": 0, **s} for s in jobs.values()]
    traces = run_jobs(specs)  # per job, every rank's events (one launch of 2 processes)
    folder = Path(tempfile.mkdtemp(prefix="lab08-traces-"))
    for (label, _), ranks in zip(jobs.items(), traces):
        paths = []
        for rank, events in enumerate(ranks):
            paths.append(folder / f"{label[0]}-rank{rank}.json")
            paths[-1].write_text(json.dumps({"traceEvents": events}))
        print(f"job {label}: per rank and step, in ms")
        display(step_timeline(paths, title=f"job {label}, the last recorded step"))
        try:
            for rank, events in enumerate(ranks):
                rows = step_breakdown(events)
                print(f"  rank {rank}: " + " | ".join(
                    f"compute {r['compute_ms']:.1f}, comm {r['comm_ms']:.1f}, "
                    f"exposed {r['exposed_ms']:.1f} ms" for r in rows))
        except NotImplementedError:
            print("  finish exercise 1 first")
"""

_ANSWER = r"""### BEGIN SOLUTION
**Model answer.** (a) From A to B the exposed communication grows, by most of what the
communication grows but not by all of it, and never by more. What can hide a collective is
the backward computation left after it starts (and what the thread computes while the last
collective is still running), and that does not change with the link: the same operators,
the same first launch. In A the all-reduces are short and most of them end before the
backward pass does, so part of that computation hides nothing; in B they last about 6
times longer, first fill that computation (the hidden part grows), then run on while the
training thread sits in DDP's wait, a gap inside `ddp_lab: backward`, with no operator left
to run. On a 2-core CPU, A: about 12 to 14 ms of communication per step, 4 to 5 exposed;
B: 26 to 36, 13 to 16 exposed. Once the computation is filled, every further millisecond of
communication is exposed, one for one.

(b) From A to C the exposed *share* goes to nearly all of the communication. With one
bucket, DDP can launch the all-reduce only when the model's last gradient is ready, at the
very end of the backward pass: in C's timeline the collective starts where the last
backward operator ends, and the training thread runs no operator until it is over (then
the optimizer). In A the first small bucket (the last layers' gradients, ready first)
starts early in the backward pass and overlaps the rest of it; only the last bucket's tail
is exposed. Bigger buckets mean fewer and later launches: less overlap. (C's communication is
shorter in total here, one message instead of several, and gloo's threads then do not
compete with the backward pass for the CPU cores, which is also why A's compute is
longer than C's; but what there is of it is all exposed.)

**Rubric (2 points).**
- 1 point: (a) the exposed time grows with the link's slowness, by up to (not more than)
  what the communication grows, because the hidden part is bounded by the computation left
  after the first launch, which the link does not change; read from the timeline (B's
  training thread idle inside the backward range while collectives run). A right
  prediction without the reason: 0.5.
- 1 point: (b) one bucket is launched only when the whole backward pass is over, so
  (almost) nothing overlaps and the exposed share goes to nearly 100 %, read from the
  timeline (the collective after the last backward operator, the training thread idle
  meanwhile). "Bigger buckets are more efficient, so less is exposed" without the launch
  time: 0.
### END SOLUTION"""

CELLS = [
    md("ex1_md", _INTRO),
    solution("ex1_step_breakdown", SOLUTION_CELL),
    test("test_ex1_step_breakdown", _TEST, points=4),
    md("ex1_q_exposed", _QUESTION),
    code("ex1_demo_jobs", _DEMO),
    written("ex1_a_exposed", "ex1_q_exposed", _ANSWER, 2),
]
