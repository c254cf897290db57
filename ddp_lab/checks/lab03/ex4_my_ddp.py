"""Exercise 4: ``MyDDP`` in ``my_ddp.py``, a minimal DistributedDataParallel whose gradient
all-reduces run while backward goes on.

``MyDDP(model)`` broadcasts rank 0's parameters and buffers; a hook on every trainable
parameter starts ``dist.all_reduce(param.grad, async_op=True)`` as soon as the gradient is
ready; ``finish()``, called after ``loss.backward()``, waits for them and divides by the
world size. How it is trained and judged: :mod:`~ddp_lab.checks.lab03.own_ddp`.

Case set, in one torchrun job of 3 ranks: a float64 run on a group of ranks 0 and 1 (which
the student's code sees as its whole world; rank 2 waits), a float64 run on all 3 ranks,
and a timing run on all 3. Judged: rank 0's weights after wrapping, one all-reduce per
trainable parameter and step (counted by the checker's ``dist.all_reduce``), the big
batch's gradient after the first ``finish()``, the weights of DDP after 3 steps, and, on a
slowed link, a step measurably faster than the same code with every all-reduce blocking.
"""

from __future__ import annotations

import math
from collections import Counter

import torch
from torch.nn.parallel import DistributedDataParallel

from ddp_lab.checks import guards
from ddp_lab.checks.contract import Exercise
from ddp_lab.checks.failure import CheckFailed
from ddp_lab.checks.lab03 import own_ddp
from ddp_lab.checks.lab03.common import per_run, run_outputs
from ddp_lab.checks.lab03.network import SlowNetwork

FILE = "my_ddp.py"
NO_TORCH_DDP = (
    "your wrapper must not use torch's DistributedDataParallel: broadcast the parameters "
    "and all-reduce the gradients yourself"
)
#: Collectives a wrapper has no use for (the checker counts dist.all_reduce calls).
OTHERS = tuple(c for c in guards.COLLECTIVES if c not in ("all_reduce", "broadcast"))
WHY_NOT = "use dist.all_reduce for the gradients (and dist.broadcast in __init__)"


def make_inputs(gen: torch.Generator) -> dict:
    """One job of 3 ranks: float64 runs on 2 and 3 ranks, then a timing run on 3."""
    runs = [own_ddp.run_spec(gen, 2), own_ddp.run_spec(gen, 3), {"ranks": 3, **own_ddp.TIMING}]
    return {"cases": [{"world_size": 3, "runs": runs}]}


def visible_inputs(gen: torch.Generator) -> dict:
    """One job of 2 ranks: a float64 run and a timing run."""
    runs = [own_ddp.run_spec(gen, 2), {"ranks": 2, **own_ddp.TIMING}]
    return {"cases": [{"world_size": 2, "runs": runs}]}


def load(file: str, name: str, net: SlowNetwork):
    """The student's class from ``file``, loaded with the checker's network in place."""
    with net.installed(), guards.forbidden_calls(OTHERS, WHY_NOT):
        with guards.refused_class(DistributedDataParallel, NO_TORCH_DDP):
            return guards.load_student_file(file)[name]


def one_run(cls, kwargs: dict, run: dict, rank: int, net: SlowNetwork) -> dict:
    """A training run or, for a run with ``latency``, a timing run."""
    with net.installed(), guards.forbidden_calls(OTHERS, WHY_NOT):
        with guards.refused_class(DistributedDataParallel, NO_TORCH_DDP):
            if "latency" in run:
                return own_ddp.timing(cls, kwargs, run, net)
            return own_ddp.train(cls, kwargs, run, rank, net)


def run_rank(ns: dict, inputs: dict, case: dict, rank: int, world: int) -> list:
    """Wrap this rank's model in the student's ``MyDDP`` and train (or time) it."""
    net = SlowNetwork()
    cls = load(FILE, "MyDDP", net)
    return per_run(case, rank, world, lambda run, r, n: one_run(cls, {}, run, r, net))


def count_problem(run: dict, outs: list[dict]) -> str | None:
    """One all-reduce per trainable parameter and step, each of that parameter's size."""
    sizes = Counter(math.prod(s) for s in own_ddp.trainable_shapes(run["dims"]))
    steps = run["xs"][0].shape[0]
    for r, o in enumerate(outs):
        for step in range(steps):
            got = Counter(c[1] for c in o["calls"] if c[0] == step)
            if got == sizes:
                continue
            n, want = sum(got.values()), sum(sizes.values())
            why = (
                "register the hook on every parameter that requires a gradient (not on the "
                "frozen one)"
                if n < want
                else "one all-reduce per gradient, started by its hook, and nothing else"
            )
            return (
                f"{own_ddp.where(run)}: rank {r}, step {step}: {n} all-reduces of "
                f"{sorted(got.elements())} elements; expected {want}, one per trainable "
                f"parameter ({sorted(sizes.elements())}): {why}"
            )
    return None


def problem(run: dict, outs: list[dict]) -> str | None:
    """What is wrong with ``MyDDP`` in one run on every rank, or None."""
    if len(outs) != run["ranks"] or any(o is None for o in outs):
        return f"expected the results of {run['ranks']} ranks, got {len(outs)}"
    if "latency" in run:
        return own_ddp.timing_problem(run, outs[0], "its all-reduce")
    return (
        own_ddp.broadcast_problem(run, outs)
        or count_problem(run, outs)
        or own_ddp.gradient_problem(run, outs)
        or own_ddp.weights_problem(run, outs)
    )


def judge_runs(inputs: dict, outputs: dict, problem_of) -> list[dict]:
    """Apply ``problem_of(run, outs)`` to every run; raise on the first problem."""
    runs = []
    for job, ranks in zip(inputs["cases"], outputs["cases"], strict=True):
        if len(ranks) != job["world_size"]:
            raise CheckFailed(
                f"expected the results of {job['world_size']} ranks, got {len(ranks)}"
            )
        for run, outs in run_outputs(job, ranks):
            if why := problem_of(run, outs):
                raise CheckFailed(why)
            runs.append((run, outs))
    return runs


def timing_said(runs) -> str:
    """``"overlap: 190 ms a step instead of 310 ms"`` from the timing runs."""
    said = [
        f"{1000 * outs[0]['overlapped']:.0f} ms a step instead of {1000 * outs[0]['blocking']:.0f}"
        " ms"
        for run, outs in runs
        if "latency" in run
    ]
    return ", ".join(said)


def judge(inputs: dict, outputs: dict) -> str:
    """Rank 0's weights everywhere, one all-reduce per gradient, the big batch's gradient,
    DDP's weights, and a measurable overlap on a slow link."""
    runs = judge_runs(inputs, outputs, problem)
    worlds = sorted({run["ranks"] for run, _ in runs if "latency" not in run})
    return (
        f"MyDDP on {' and '.join(map(str, worlds))} ranks that start apart: rank 0's weights "
        "everywhere, one all-reduce per gradient, the big batch's gradient, DDP's weights "
        f"after 3 steps; on a slowed link the all-reduces overlap backward ({timing_said(runs)})"
    )


EXERCISE = Exercise(
    "test_ex4_my_ddp",
    ("ex4_my_ddp",),
    "your own DDP: broadcast, asynchronous all-reduces in hooks",
    make_inputs,
    judge,
    run_rank=run_rank,
    timeout=90,
    visible_inputs=visible_inputs,
    files=(FILE,),
)
