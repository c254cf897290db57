"""Exercise 5: ``BucketedDDP`` in ``bucketed_ddp.py``: ``MyDDP`` with DDP's buckets.

``BucketedDDP(model, bucket_cap_mb)`` groups the trainable parameters into buckets, walking
them in reverse registration order and closing a bucket as soon as it holds at least
``bucket_cap_mb`` MiB; when the last gradient of a bucket is ready, one asynchronous
all-reduce sends the whole bucket (flattened); ``finish()`` waits, divides and copies the
averages back. How it is trained and judged: :mod:`~ddp_lab.checks.lab03.own_ddp`.

The buckets the checker expects come from torch's own bucketing routine
(``dist._compute_bucket_assignment_by_size``, what DDP uses when it rebuilds its buckets in
the order the gradients become ready), fed the parameters in reverse registration order.
Case set, in one torchrun job of 3 ranks (random model sizes and caps inside): on a group of
ranks 0 and 1 (the student's world; rank 2 waits), float32 with three or more buckets and
float64 with a cap larger than the model (one bucket); on all 3 ranks, float64 with two or
three buckets, then a timing run. Every cap is drawn so that the typical mistakes give other
buckets: the forward order, one bucket per parameter, and (float64) 4 bytes an element.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist

from ddp_lab.checks.contract import Exercise
from ddp_lab.checks.lab03 import own_ddp
from ddp_lab.checks.lab03.common import per_run
from ddp_lab.checks.lab03.ex4_my_ddp import judge_runs, load, one_run, timing_said
from ddp_lab.checks.lab03.network import SlowNetwork
from ddp_lab.checks.values import first, randint

FILE = "bucketed_ddp.py"
MIB = 2**20
#: The timing run's cap: one layer's weight and bias per bucket.
TIMING_CAP_BYTES = 2048


def buckets(sizes: list[int], itemsize: int, cap_bytes: int, reverse: bool = True) -> list[int]:
    """Elements per bucket, in order, of tensors of ``sizes`` elements (registration order)
    by torch's bucketing routine, walking them in reverse (or forward) order.

    Example:
        >>> buckets([100, 10, 50], 4, 300), buckets([100, 10, 50], 4, 300, reverse=False)
        ([160], [100, 60])
    """
    dtype = {2: torch.float16, 4: torch.float32, 8: torch.float64}[itemsize]
    order = list(reversed(sizes)) if reverse else list(sizes)
    tensors = [torch.empty(n, dtype=dtype) for n in order]
    groups, _ = dist._compute_bucket_assignment_by_size(tensors, [cap_bytes], [False] * len(order))
    return [sum(order[i] for i in g) for g in groups]


def _sizes(dims) -> list[int]:
    out = []
    for shape in own_ddp.trainable_shapes(dims):
        n = 1
        for s in shape:
            n *= s
        out.append(n)
    return out


def _exact_hit(sizes: list[int], itemsize: int, cap: int) -> bool:
    """True when a bucket reaches exactly ``cap`` bytes (a rule "more than the cap" and the
    rule "at least the cap" would then disagree)."""
    return buckets(sizes, itemsize, cap) != buckets(sizes, itemsize, cap + 1)


def _cap(gen: torch.Generator, dims, dtype, lo: int, hi: int) -> int | None:
    """A cap in bytes giving ``lo`` to ``hi`` buckets that no typical mistake reproduces."""
    sizes, itemsize = _sizes(dims), torch.empty(0, dtype=dtype).element_size()
    total = sum(sizes) * itemsize
    for _ in range(60):
        cap = randint(gen, min(sizes) * itemsize, total)
        right = buckets(sizes, itemsize, cap)
        if not lo <= len(right) <= hi or _exact_hit(sizes, itemsize, cap):
            continue
        wrongs = [
            buckets(sizes, itemsize, cap, reverse=False),  # the forward order
            list(reversed(sizes)),  # a bucket per gradient
            [sum(sizes)],  # the cap ignored
        ]
        if itemsize == 8:
            wrongs.append(buckets(sizes, 4, cap))  # 4 bytes an element
        kinds = {tuple(sorted(b)) for b in [right, *wrongs]}
        if len(kinds) == len(wrongs) + 1:  # each mistake gives buckets of its own
            return cap
    return None


def bucket_run(gen: torch.Generator, ranks: int, dtype, lo: int, hi: int) -> dict:
    """A training run whose cap gives ``lo`` to ``hi`` buckets (a cap above the model's
    size when ``hi`` is 1)."""
    while True:
        run = own_ddp.run_spec(gen, ranks, dtype, steps=2)
        itemsize = torch.empty(0, dtype=dtype).element_size()
        if hi == 1:
            cap = sum(_sizes(run["dims"])) * itemsize + randint(gen, 1, 4096)
        else:
            cap = _cap(gen, run["dims"], dtype, lo, hi)
        if cap is not None:
            return {**run, "cap_bytes": cap, "bucket_cap_mb": cap / MIB}


def make_inputs(gen: torch.Generator) -> dict:
    """One job of 3 ranks (see the module docstring)."""
    timing = {"ranks": 3, **own_ddp.TIMING, "bucket_cap_mb": TIMING_CAP_BYTES / MIB}
    runs = [
        bucket_run(gen, 2, torch.float32, 3, 5),
        bucket_run(gen, 2, torch.float64, 1, 1),
        bucket_run(gen, 3, torch.float64, 2, 3),
        timing,
    ]
    return {"cases": [{"world_size": 3, "runs": runs}]}


def visible_inputs(gen: torch.Generator) -> dict:
    """One job of 2 ranks: a float64 run of two or three buckets, and a timing run."""
    timing = {"ranks": 2, **own_ddp.TIMING, "bucket_cap_mb": TIMING_CAP_BYTES / MIB}
    return {"cases": [{"world_size": 2, "runs": [bucket_run(gen, 2, torch.float64, 2, 3), timing]}]}


def run_rank(ns: dict, inputs: dict, case: dict, rank: int, world: int) -> list:
    """Wrap this rank's model in the student's ``BucketedDDP`` and train (or time) it."""
    net = SlowNetwork()
    cls = load(FILE, "BucketedDDP", net)
    return per_run(
        case,
        rank,
        world,
        lambda run, r, n: one_run(cls, {"bucket_cap_mb": run["bucket_cap_mb"]}, run, r, net),
    )


def expected_buckets(run: dict) -> list[int]:
    """Elements per bucket, in the order the buckets fill up during backward."""
    itemsize = torch.empty(0, dtype=getattr(torch, run["dtype"])).element_size()
    return buckets(_sizes(run["dims"]), itemsize, run["cap_bytes"])


def bucket_problem(run: dict, outs: list[dict]) -> str | None:
    """One all-reduce per bucket and step, each of its bucket's size."""
    want = expected_buckets(run)
    sizes = _sizes(run["dims"])
    itemsize = torch.empty(0, dtype=getattr(torch, run["dtype"])).element_size()
    for r, o in enumerate(outs):
        for step in range(run["xs"][0].shape[0]):
            got = [c[1] for c in o["calls"] if c[0] == step]
            if Counter(got) == Counter(want):
                continue
            said = (
                f"{own_ddp.where(run)}, trainable tensors of {sizes} elements (registration "
                f"order), bucket_cap_mb = {run['cap_bytes']} bytes / 2**20: rank {r}, step "
                f"{step}: all-reduces of {first(got, 8) or 'nothing'} elements; expected "
                f"{len(want)} bucket(s) of {want}"
            )
            if Counter(got) == Counter(buckets(sizes, itemsize, run["cap_bytes"], False)):
                return (
                    f"{said}: those are the buckets of the forward order; walk the parameters "
                    "in reverse (the order backward makes their gradients ready)"
                )
            if len(got) == len(sizes) and len(want) < len(sizes):
                return f"{said}: one all-reduce per bucket, not one per gradient"
            if len(got) == 1 and len(want) > 1:
                return f"{said}: close a bucket once it holds at least bucket_cap_mb MiB"
            if itemsize == 8 and Counter(got) == Counter(buckets(sizes, 4, run["cap_bytes"])):
                return f"{said}: measure a tensor in bytes with numel() * element_size()"
            if step and not got:
                return f"{said}: get the buckets ready again for the next step"
            return (
                f"{said}: walk the trainable parameters in reverse registration order and close "
                "a bucket as soon as it holds at least bucket_cap_mb * 2**20 bytes"
            )
    return None


def problem(run: dict, outs: list[dict]) -> str | None:
    """What is wrong with ``BucketedDDP`` in one run on every rank, or None."""
    if len(outs) != run["ranks"] or any(o is None for o in outs):
        return f"expected the results of {run['ranks']} ranks, got {len(outs)}"
    if "latency" in run:
        return own_ddp.timing_problem(run, outs[0], "a bucket's all-reduce")
    return (
        own_ddp.broadcast_problem(run, outs)
        or bucket_problem(run, outs)
        or own_ddp.gradient_problem(run, outs)
        or own_ddp.weights_problem(run, outs)
    )


def judge(inputs: dict, outputs: dict) -> str:
    """Rank 0's weights, DDP's buckets (one all-reduce each), the big batch's gradient, DDP's
    weights, and a measurable overlap on a slow link."""
    runs = judge_runs(inputs, outputs, problem)
    counts = [len(expected_buckets(run)) for run, _ in runs if "latency" not in run]
    return (
        f"BucketedDDP: one all-reduce per bucket ({', '.join(map(str, counts))} buckets, "
        "float32 and float64), rank 0's weights everywhere, the big batch's gradient, DDP's "
        f"weights; on a slowed link the buckets overlap backward ({timing_said(runs)})"
    )


EXERCISE = Exercise(
    "test_ex5_bucketed_ddp",
    ("ex5_bucketed_ddp",),
    "buckets: one asynchronous all-reduce per bucket",
    make_inputs,
    judge,
    run_rank=run_rank,
    timeout=90,
    visible_inputs=visible_inputs,
    files=(FILE,),
)
