"""Lab 8 exercise 2's notebook cells (instructor only): the straggler of a data-parallel job.

``CELLS`` is the section as the lead assembles it into the notebook: prose, the solution
cell, the test cell, a predict-then-explain question, the demo it refers to (one real job on
3 gloo ranks, rank 1 slowed in its forward pass, drawn as a timeline with each rank's phase
table) and the written answer (2 points).
"""

from __future__ import annotations

from ddp_lab.answers.lab08.ex2 import SOLUTION_CELL
from ddp_lab.grading.authoring import code, md, solution, test, written

_INTRO = r"""
## 2. Who makes everybody wait

Data-parallel training is *synchronous*: at every step each rank's gradients are averaged
with every other rank's, in an all-reduce that can only finish once every rank has joined
it. A rank that is late, because its data loading stalls, its GPU runs slower, or it does
something the others do not, holds the all-reduce up for everyone. Nobody can run ahead:
every rank's step lasts as long as the slowest rank's.

A trace records this synchronisation in its own way. On the CPU each all-reduce is a
`gloo:all_reduce` event on one of gloo's own threads, and it cannot end before the last rank
has joined. A phase's range (`ddp_lab: data / forward / backward / optimizer`) holds whatever
the training thread did inside it: computing, or waiting for a collective to finish (on GPUs
the waiting shows in the NCCL kernels instead). And not every slow moment is a straggler: a
rank that pauses once (a logging step, a garbage collection, a checkpoint) makes the others
wait once, but it is not what slows the job down step after step.

Where, in each rank's trace, does a straggler's slowness show, and where does the others'
waiting show? It depends on the phase the straggler is slow in. Working that out, for each
of the four phases, is the exercise, and the written answer below.

### Exercise 2 (3 points): `find_straggler`

Write `find_straggler(traces)`; the docstring is the contract. `traces` holds every rank's
events of one job, rank 0 first; the answer is the slow rank and its slow phase.

The grader records real jobs when it grades: eight small data-parallel jobs on 2 and on 3
gloo ranks, profiled over 3 steps, each with one rank slowed in one phase (every phase, a
straggler that is rank 0 and one that is not, the slowdown drawn: 25 to 37.5 ms more per
step). Some jobs hold a hiccup too: another rank pauses once, for 200 ms, in one phase of one
step (the first step, the last step's optimizer, a middle step). Your function sees the
traces only.
"""

_TEST = """# Checks find_straggler on 8 jobs recorded now (every phase slowed, on 2 and 3 ranks,
# with one-off pauses on other ranks): about 12 s.
checks.straggler(find_straggler)
### BEGIN HIDDEN TESTS
from ddp_lab.grading.verdict import hidden_test
hidden_test("test_ex2_straggler")
### END HIDDEN TESTS"""

_QUESTION = r"""
**Predict, then explain (written answer, 2 points).** The next cell records one job on 3
gloo ranks in which **rank 1's forward pass** is slowed by 30 ms at every step (a sleep
inside its `ddp_lab: forward` range), draws one step of every rank as a timeline, and prints
each rank's phase table: the median over the profiled steps of each phase's range and of
the rank's collectives, in ms, as `phase_times` measures them.

Before you run it, predict: which rank shows the **longest all-reduce time**, and which the
shortest? Then run the cell and explain from the timeline and the table: where each rank's
all-reduce starts and ends, what the ranks do meanwhile, and which of the numbers in the
table are work and which are waiting.
"""

_DEMO = r"""
import statistics
import tempfile

from ddp_lab.checks.lab08.straggler_jobs import run_jobs, spec
from ddp_lab.figures.profile import step_timeline
from ddp_lab.workloads.lab8 import phase_times

if not checks.GRADING:  # (the grader skips the demonstrations: it judges the exercises)
    job = spec(world=3, rank=1, phase="forward", slow_ms=30.0)
    ranks = run_jobs([job])[0]  # every rank's events (one launch of 3 processes, ~10 s)
    folder = Path(tempfile.mkdtemp(prefix="lab08-straggler-"))
    paths = []
    for rank, events in enumerate(ranks):
        paths.append(folder / f"trace-rank{rank}.json")
        paths[-1].write_text(json.dumps({"traceEvents": events}))
    display(step_timeline(paths, title="rank 1's forward slowed by 30 ms: one step"))
    columns = ("step", "data", "forward", "backward", "optimizer", "collectives")
    print("median ms   " + "".join(f"{c:>12}" for c in columns))
    for rank, events in enumerate(ranks):
        rows = phase_times(events)
        cells = [statistics.median(r[f"{c}_ms"] for r in rows) for c in columns]
        print(f"rank {rank}      " + "".join(f"{v:12.1f}" for v in cells))
    try:
        print("find_straggler says:", find_straggler(ranks))
    except NotImplementedError:
        print("finish exercise 2 first")
"""

_ANSWER = r"""### BEGIN SOLUTION
**Model answer.** Ranks 0 and 2 show the longest all-reduce time (about 30 ms each, the
slowdown), and rank 1, the slow one, the shortest (a few milliseconds: the bytes' transfer,
plus what noise a shared CPU adds). In the timeline,
ranks 0 and 2 finish their forward pass after about a millisecond, go through their backward
operators and start the all-reduce early; its `gloo:all_reduce` bar then stretches until
rank 1 arrives, 30 ms later, and their `ddp_lab: backward` range stretches with it: they
are idle (no operator runs), waiting. Rank 1 spends those 30 ms inside its
`ddp_lab: forward` range, then computes its backward pass and joins an all-reduce the others
are already in, so its all-reduce completes almost at once. Every rank's step lasts about as
long (the step column is the same on every rank, about 30 ms plus the work): nobody can run
ahead of the slowest rank.

In the table, the forward of rank 1 is work (its own, 30 ms more than the others'); the
long backward and collectives of ranks 0 and 2 are waiting: subtract the collectives' time
from their backward and what is left is the same short backward as rank 1's. So the long
all-reduce points at the victims, not at the culprit: the straggler is the rank whose *own*
work in one phase is longer than the others', with the *short* collectives.

**Rubric (2 points).**
- 1 point: the prediction (ranks 0 and 2 longest, rank 1 shortest), or a wrong prediction
  corrected from what the cell showed, with the reason: the others reach the all-reduce
  first and wait in it for rank 1; an all-reduce finishes only when every rank has joined.
- 1 point: read from the trace: ranks 0 and 2's long backward range and all-reduce are
  waiting (no operator runs; the time equals the slowdown), rank 1's forward is its own
  work; every rank's step is equally long. "The slow rank's all-reduce is slowest" kept
  after seeing the table: 0.
### END SOLUTION"""

CELLS = [
    md("ex2_md", _INTRO),
    solution("ex2_straggler", SOLUTION_CELL),
    test("test_ex2_straggler", _TEST, points=3),
    md("ex2_q_victims", _QUESTION),
    code("ex2_demo_straggler", _DEMO),
    written("ex2_a_victims", "ex2_q_victims", _ANSWER, 2),
]
