"""Exercise 3: ``train_accumulated`` in ``accum.py``, gradient accumulation under DDP.

Every rank of a torchrun job receives a ``DistributedDataParallel`` model built by the
checker (a float64 :class:`~ddp_lab.checks.lab05.common.Net` whose gradients fit in one
bucket), an SGD optimizer with momentum, and its own list of equal-sized micro-batches. The
student's function takes one optimizer step per group of ``k`` consecutive micro-batches
(the last group may be shorter).

Two things are measured by the checker's code, in the ranks:

- the weights after every optimizer step (the optimizer's ``step`` is wrapped);
- the all-reduces DDP launched for each optimizer step, counted by a communication hook that
  the checker registers on the model before handing it over (the hook averages like DDP's
  own path, so the weights are those of plain DDP).

The oracle is one process with plain SGD (same momentum) on the big batch: for each group,
all ranks' micro-batches of that group concatenated, the mean loss over them. The weights
must match after every step (float64, to 1e-9), and every optimizer step must have cost
exactly one all-reduce (the model's one bucket), and the function must return the number of
optimizer steps (an ``int``). Case set, on 2 ranks and on 3 ranks: ``k = 1`` (no
accumulation), ``k`` = 2 to 4 with a number of micro-batches not divisible by ``k`` (the
last group holds fewer), ``k`` larger than the number of micro-batches (a single, short
group), and one micro-batch per rank with ``k`` = 2 to 4 (one step, synced at once).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from ddp_lab.checks import guards
from ddp_lab.checks.contract import Exercise
from ddp_lab.checks.failure import CheckFailed
from ddp_lab.checks.lab05.common import ACCUM_FILE, net, random_state, state
from ddp_lab.checks.values import kind, max_diff, plain, randint, uniform
from ddp_lab.dist import ddp_bucket_count

#: float64 throughout: DDP's average equals the big batch's mean to rounding.
ATOL = 1e-9
#: Large enough for the lab's models to fit one bucket (so one all-reduce per step).
BUCKET_CAP_MB = 25
MOMENTUM = 0.9
_all_reduce = dist.all_reduce  # the hook's own reference (taken before any student code)


def groups(n: int, k: int) -> list[range]:
    """The micro-batch indices of each optimizer step: ``k`` at a time, the rest last.

    Example:
        >>> [list(g) for g in groups(5, 2)]
        [[0, 1], [2, 3], [4]]
    """
    return [range(s, min(s + k, n)) for s in range(0, n, k)]


def _run_spec(gen: torch.Generator, world: int, n: int, k: int) -> dict:
    dims = (randint(gen, 3, 6), randint(gen, 4, 8), 3)
    b = randint(gen, 2, 4)
    return {
        "ranks": world,
        "k": k,
        "lr": uniform(gen, 0.05, 0.3),
        "init": random_state(dims, gen, torch.float64, unused=False),
        "xs": [
            [torch.randn(b, dims[0], generator=gen, dtype=torch.float64) for _ in range(n)]
            for _ in range(world)
        ],
        "ys": [[torch.randint(0, 3, (b,), generator=gen) for _ in range(n)] for _ in range(world)],
    }


def _runs(gen: torch.Generator, world: int) -> list[dict]:
    """Four runs of DDP over ``world`` ranks: k = 1, an uneven tail, a single short group,
    and a single micro-batch per rank (k > 1: one step, no ``no_sync`` at all)."""
    k = randint(gen, 2, 4)
    uneven = k * randint(gen, 1, 2) + randint(gen, 1, k - 1)  # not divisible by k
    return [
        _run_spec(gen, world, randint(gen, 2, 3), 1),
        _run_spec(gen, world, uneven, k),
        _run_spec(gen, world, randint(gen, 2, 3), 4),  # k larger than the micro-batches
        _run_spec(gen, world, 1, randint(gen, 2, 4)),  # one micro-batch per rank
    ]


def make_inputs(gen: torch.Generator) -> dict:
    """One torchrun job of 3 ranks (each job costs seconds): four runs of DDP over a group
    of 2 ranks (rank 2 sits them out), then four over all 3 ranks."""
    return {"cases": [{"world_size": 3, "runs": _runs(gen, 2) + _runs(gen, 3)}]}


def visible_inputs(gen: torch.Generator) -> dict:
    """One job on 2 ranks, four runs."""
    return {"cases": [{"world_size": 2, "runs": _runs(gen, 2)}]}


def _counting_hook(counter: list[int], world: int):
    def hook(group, bucket):  # no annotations: DDP checks them
        counter[0] += 1
        tensor = bucket.buffer()
        tensor.div_(world)  # DDP's own average
        return (
            _all_reduce(tensor, group=group, async_op=True)
            .get_future()
            .then(lambda f: f.value()[0])
        )

    return hook


def _one_run(fn, spec: dict, rank: int, group) -> dict:
    model = net(spec["init"])
    ddp = DistributedDataParallel(model, process_group=group, bucket_cap_mb=BUCKET_CAP_MB)
    counter = [0]
    ddp.register_comm_hook(group, _counting_hook(counter, spec["ranks"]))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=spec["lr"], momentum=MOMENTUM)
    per_step: list[int] = []
    after: list[dict] = []
    step = optimizer.step

    def recorded_step(*args, **kwargs):
        per_step.append(counter[0] - sum(per_step))
        out = step(*args, **kwargs)
        after.append(state(model))
        return out

    optimizer.step = recorded_step
    micro = list(zip(spec["xs"][rank], spec["ys"][rank], strict=True))
    returned = plain(fn(ddp, optimizer, micro, spec["k"], F.cross_entropy))
    buckets = ddp_bucket_count(ddp)
    out = {
        "returned": returned if isinstance(returned, (int, float)) else kind(returned),
        "allreduces": per_step,
        "after_last_step": counter[0] - sum(per_step),
        "weights": after,
        "buckets": -1 if buckets is None else buckets,
    }
    del ddp, optimizer
    return out


def run_rank(ns: dict, inputs: dict, case: dict, rank: int, world: int) -> list[dict | None]:
    """The student's ``train_accumulated`` on this rank, once per run of the case that this
    rank takes part in (``None`` for the others). Runs over fewer ranks than the job's use a
    process group of ranks ``0 .. n-1`` (DDP's ``process_group``; the student's code does not
    see it)."""
    fn = guards.load_student_file(ACCUM_FILE)["train_accumulated"]
    sizes = sorted({spec["ranks"] for spec in case["runs"] if spec["ranks"] < world})
    groups = {n: dist.new_group(list(range(n))) for n in sizes}  # every rank creates each
    return [
        _one_run(fn, spec, rank, groups.get(spec["ranks"])) if rank < spec["ranks"] else None
        for spec in case["runs"]
    ]


def big_batch_steps(spec: dict, lr_factor=None) -> list[dict]:
    """The oracle: one process, SGD with momentum on each group's concatenated batch (all
    ranks' micro-batches of the group); the weights after every step. ``lr_factor(g)``
    scales group ``g``'s gradient (the hidden diagnoses use it)."""
    model = net(spec["init"])
    optimizer = torch.optim.SGD(model.parameters(), lr=spec["lr"], momentum=MOMENTUM)
    n = len(spec["xs"][0])
    out = []
    for g, idx in enumerate(groups(n, spec["k"])):
        x = torch.cat([xs[i] for xs in spec["xs"] for i in idx])
        y = torch.cat([ys[i] for ys in spec["ys"] for i in idx])
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        (loss * (lr_factor(g) if lr_factor else 1.0)).backward()
        optimizer.step()
        out.append(state(model))
    return out


def run_text(spec: dict, world: int) -> str:
    """``"2 ranks x 5 micro-batches of 3 samples, k = 2"``."""
    n, b = len(spec["xs"][0]), spec["xs"][0][0].shape[0]
    return f"{world} ranks x {n} micro-batches of {b} samples, k = {spec['k']}"


def count_problem(spec: dict, world: int, outs: list[dict]) -> str | None:
    """What is wrong with the number of optimizer steps or of all-reduces, or None."""
    n, k = len(spec["xs"][0]), spec["k"]
    steps = len(groups(n, k))
    at = run_text(spec, world)
    for rank, o in enumerate(outs):
        if len(o["allreduces"]) != steps:
            return (
                f"{at}: rank {rank} took {len(o['allreduces'])} optimizer steps; expected "
                f"{steps} (one per group of k micro-batches, the last group shorter)"
            )
        buckets = o["buckets"] if o["buckets"] > 0 else 1
        for s, count in enumerate(o["allreduces"]):
            if count != buckets:
                size = len(groups(n, k)[s])
                why = (
                    "run every micro-batch but the last of a group under ddp_model.no_sync()"
                    if count > buckets
                    else "the last micro-batch of each group must run outside no_sync(), "
                    "so that DDP averages the accumulated gradients"
                )
                return (
                    f"{at}: rank {rank}, optimizer step {s} (a group of {size}): {count} "
                    f"all-reduces, expected {buckets} (the model's gradients fit one bucket): "
                    f"{why}"
                )
        if o["after_last_step"]:
            return (
                f"{at}: rank {rank}: {o['after_last_step']} all-reduces after the last "
                "optimizer step (a backward pass that no step used?)"
            )
    return None


def weights_problem(spec: dict, world: int, outs: list[dict]) -> str | None:
    """Where the ranks' weights leave the big-batch oracle, or None."""
    want = big_batch_steps(spec)
    n, k = len(spec["xs"][0]), spec["k"]
    for s, expected in enumerate(want):
        apart = max(max_diff(o["weights"][s], outs[0]["weights"][s]) for o in outs)
        if apart > ATOL:
            return (
                f"{run_text(spec, world)}: after optimizer step {s} the ranks hold different "
                f"weights (apart by {apart:.3g}): the ranks ended with different weights, so "
                "some gradients were never averaged; DDP averages what has accumulated when "
                "it syncs, so the synced backward must be the last one of each group"
            )
        for rank, o in enumerate(outs):
            diff = max_diff(o["weights"][s], expected)
            if diff > ATOL:
                size = len(groups(n, k)[s])
                b = spec["xs"][0][0].shape[0]
                return (
                    f"{run_text(spec, world)}: after optimizer step {s} (a group of {size} "
                    f"micro-batches), rank {rank}'s weights differ from one process on the "
                    f"{world} x {size} x {b} = {world * size * b}-sample batch by {diff:.3g}: "
                    "the accumulated gradient must be the mean over the group (each "
                    "micro-batch's loss divided by the number of micro-batches in its group)"
                )
    return None


def returned_problem(spec: dict, world: int, outs: list[dict]) -> str | None:
    """What is wrong with the step count the function returned, or None."""
    steps = len(groups(len(spec["xs"][0]), spec["k"]))
    for rank, o in enumerate(outs):
        got = o.get("returned")
        if isinstance(got, bool) or not isinstance(got, int) or got != steps:
            said = got if isinstance(got, (int, float)) else got or "nothing"
            return (
                f"{run_text(spec, world)}: rank {rank}'s train_accumulated returned {said}; "
                f"expected {steps}, the number of optimizer steps taken (an int: one per "
                "group, the last, shorter group included)"
            )
    return None


def problem(spec: dict, world: int, outs: list[dict]) -> str | None:
    """The first thing wrong with one run on every rank, or None."""
    if len(outs) != world:
        return f"expected the results of {world} ranks, got {len(outs)}"
    return (
        count_problem(spec, world, outs)
        or weights_problem(spec, world, outs)
        or returned_problem(spec, world, outs)
    )


def judge(inputs: dict, outputs: dict) -> str:
    """Weights equal to the big batch's after every step; one all-reduce per step."""
    for case, ranks in zip(inputs["cases"], outputs["cases"], strict=True):
        for r, spec in enumerate(case["runs"]):
            outs = [rank_out[r] for rank_out in ranks[: spec["ranks"]]]
            if why := problem(spec, spec["ranks"], outs):
                raise CheckFailed(why)
    worlds = " and ".join(sorted({str(s["ranks"]) for c in inputs["cases"] for s in c["runs"]}))
    ks = sorted({s["k"] for c in inputs["cases"] for s in c["runs"]})
    return (
        f"train_accumulated on {worlds} ranks (k = {', '.join(map(str, ks))}, uneven tails) "
        "equals one process on the k-times larger batch after every step, with one "
        "all-reduce per optimizer step"
    )


EXERCISE = Exercise(
    "test_ex3_accumulation",
    ("ex3_accumulation",),
    "gradient accumulation with no_sync equals the big batch",
    make_inputs,
    judge,
    run_rank=run_rank,
    timeout=120,
    visible_inputs=visible_inputs,
    files=(ACCUM_FILE,),
)
