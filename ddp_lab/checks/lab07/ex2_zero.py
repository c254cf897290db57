"""Exercise 2: ``ShardedAdamW`` in ``zero.py``, AdamW with its state sharded over the ranks.

Every rank of a group builds the student's optimizer over the same parameters; before each
``step()`` the checker puts into every parameter's ``.grad`` this rank's own gradient (as
after a backward pass on this rank's batch). The optimizer averages the gradients over the
group, clips them by their global norm when it has a ``max_norm``, updates the part of the
flat parameter vector this rank owns with AdamW, and gathers the parts so that every rank
holds all the new parameters.

The oracle is ``torch.optim.AdamW`` itself on one process: the gradients averaged over the
ranks, ``torch.nn.utils.clip_grad_norm_`` when there is a ``max_norm``, then ``step()``.
Every rank's parameters must equal it after every step (to 1e-6 in float32, 1e-9 in
float64), and between steps the optimizer may hold about three chunks' worth of tensors per
rank (its part of the parameters and their two moments), measured by walking every tensor
reachable from the object (:func:`ddp_lab.parallel.memory.held_bytes`), not the model's own
parameters and gradients. Each ``step()``'s collectives are recorded (name, and the numbers
of the largest tensor each one is given): the gradients must be combined by a
reduce-scatter and the new parameters spread by an all-gather (any of ``torch.distributed``'s
forms of either, at most ``n (c + P)`` numbers gathered for ``P`` parameter tensors and
chunks of ``c``), and an all-reduce may carry no more than ``P`` numbers (the clipping norm's
sums of squares): an all-reduce of the gradients gives the right parameters for 1.5 times
the bytes of one all-reduce, which is what ZeRO's step costs.

A parameter whose ``.grad`` is None (frozen: ``requires_grad=False``; or unused in a step's
forward pass) must be skipped as ``torch.optim.AdamW`` skips it: its values do not move (no
weight decay either) and its AdamW state, step count included, does not advance. Such a
parameter's ``.grad`` is None on every rank alike.

Case set, in one torchrun job of 3 ranks (each job costs seconds): three runs over all 3
ranks (float32 with ``N`` not divisible by 3, a one-number parameter, a frozen parameter and
one whose gradient is None at the first step and at a later one; a tiny float64 parameter
of 2 numbers, so one rank owns nothing; float32 with clipping and a frozen parameter), then
two over a group of ranks 0 and 1 (float64 with odd ``N``, clipping, a frozen parameter and
one whose gradient is None at two steps; float32 without), 10 steps each. The clipping
threshold is the median of the steps' gradient norms (some steps clip, some do not); ``eps``
is of the order of the gradients, so that AdamW is not blind to the gradients' scale; the
weight decay of a run with a frozen parameter is at least 0.03, so that a zero gradient
moves it.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter

import torch
from torch import nn

from ddp_lab.checks import guards
from ddp_lab.checks.contract import Exercise
from ddp_lab.checks.failure import CheckFailed
from ddp_lab.checks.lab07.common import (
    BUILT_INS,
    DTYPES,
    WATCHDOG_S,
    ZERO_FILE,
    counted_collectives,
    groups_for,
    randn,
    release,
)
from ddp_lab.checks.values import kind, log_uniform, randint, uniform
from ddp_lab.parallel.memory import held_bytes

STEPS = 10
ATOL = {"float32": 1e-6, "float64": 1e-9}
#: Bytes beyond three chunks an optimizer may hold (step counters, scalars).
SLACK = 512


def _shapes(gen: torch.Generator, ranks: int, want_divisible: bool) -> list[list[int]]:
    """An MLP's shapes with a one-number parameter; ``N`` divisible by ``ranks`` or not."""
    while True:
        d, h, c = randint(gen, 8, 16), randint(gen, 24, 48), randint(gen, 3, 8)
        shapes = [[h, d], [h], [1], [c, h], [c]]
        n = sum(math.prod(s) for s in shapes)
        if (n % ranks == 0) == want_divisible:
            return shapes


def _with_frozen(gen: torch.Generator, shapes: list[list[int]], skip_first: bool) -> dict:
    """A frozen parameter of 2 to 5 numbers inserted at a random place of ``shapes``, and
    another parameter whose gradient is None at two steps (the first one when
    ``skip_first``)."""
    at = randint(gen, 0, len(shapes))
    shapes = [*shapes[:at], [randint(gen, 2, 5)], *shapes[at:]]
    other = [i for i in range(len(shapes)) if i != at]
    gone = other[randint(gen, 0, len(other) - 1)]
    later = randint(gen, STEPS // 2, STEPS - 1)
    steps = [0, later] if skip_first else [randint(gen, 1, STEPS // 2 - 1), later]
    return {"shapes": shapes, "frozen": [at], "skips": {str(gone): steps}}


def has_grad(spec: dict, i: int, step: int) -> bool:
    """Whether parameter ``i`` has a gradient at ``step`` (not frozen, not skipped there)."""
    return i not in spec["frozen"] and step not in spec["skips"].get(str(i), [])


def _run(gen, ranks: int, dtype: str, shapes, clip: bool, none: dict | None = None) -> dict:
    none = none or {"frozen": [], "skips": {}}
    shapes = none.get("shapes", shapes)
    dt = DTYPES[dtype]
    scale = log_uniform(gen, 1e-3, 1e-1)
    init = [randn(gen, *s, dtype=dt) for s in shapes]
    per_tensor = [scale * 2.0 ** randint(gen, -3, 3) for _ in shapes]
    grads = [
        [
            [randn(gen, *s, dtype=dt, scale=k) for s, k in zip(shapes, per_tensor, strict=True)]
            for _ in range(ranks)
        ]
        for _ in range(STEPS)
    ]
    max_norm = None
    if clip:  # half of the steps clip
        norms = [
            float(
                torch.cat(
                    [
                        torch.stack(g).mean(0).reshape(-1)
                        for i, g in enumerate(zip(*step, strict=True))
                        if has_grad(none, i, s)
                    ]
                )
                .double()
                .norm()
            )
            for s, step in enumerate(grads)
        ]
        max_norm = statistics.median(norms)
    decay = uniform(gen, 0.0, 0.1) if not none["frozen"] else uniform(gen, 0.03, 0.1)
    return {
        "ranks": ranks,
        "dtype": dtype,
        "shapes": shapes,
        "init": init,
        "grads": grads,
        "lr": log_uniform(gen, 1e-3, 3e-2),
        "betas": [uniform(gen, 0.8, 0.95), uniform(gen, 0.95, 0.999)],
        "eps": scale * uniform(gen, 0.3, 3.0),
        "weight_decay": decay,
        "max_norm": max_norm,
        "frozen": none["frozen"],
        "skips": none["skips"],
    }


def make_inputs(gen: torch.Generator) -> dict:
    """One job of 3 ranks: three runs over all of them, then two over ranks 0 and 1."""
    runs = [
        _run(gen, 3, "float32", None, False, _frozen_shapes(gen, 3, False, skip_first=True)),
        _run(gen, 3, "float64", [[2]], clip=True),
        _run(gen, 3, "float32", None, True, _frozen_shapes(gen, 3, True, skips=False)),
        _run(gen, 2, "float64", None, True, _frozen_shapes(gen, 2, False, skip_first=False)),
        _run(gen, 2, "float32", _shapes(gen, 2, True), clip=False),
    ]
    return {"cases": [{"world_size": 3, "runs": runs}]}


def _frozen_shapes(
    gen: torch.Generator, ranks: int, divisible: bool, skip_first: bool = False, skips=True
) -> dict:
    """An MLP's shapes with a frozen parameter (and one skipped at two steps), ``N``
    divisible by ``ranks`` or not."""
    while True:
        none = _with_frozen(gen, _shapes(gen, ranks, divisible), skip_first)
        if (sum(math.prod(s) for s in none["shapes"]) % ranks == 0) == divisible:
            return none if skips else {**none, "skips": {}}


def visible_inputs(gen: torch.Generator) -> dict:
    """One job of 3 ranks: an uneven float32 run over all 3, a clipped float64 run over the
    group of ranks 0 and 1."""
    runs = [
        _run(gen, 3, "float32", None, False, _frozen_shapes(gen, 3, False, skip_first=True)),
        _run(gen, 2, "float64", _shapes(gen, 2, False), clip=True),
    ]
    return {"cases": [{"world_size": 3, "runs": runs}]}


def flat(params) -> torch.Tensor:
    """All parameters, flattened and concatenated (a copy)."""
    return torch.cat([p.detach().reshape(-1) for p in params]).clone()


def _one_run(cls, spec: dict, rank: int, group) -> dict:
    params = [
        nn.Parameter(t.clone(), requires_grad=i not in spec["frozen"])
        for i, t in enumerate(spec["init"])
    ]
    n = spec["ranks"]

    def hung() -> str:
        where = f"a group of {n} of the job's ranks" if group is not None else "every rank"
        return (
            f"ShardedAdamW did not return within {WATCHDOG_S:g} s on rank {rank} ({where}): "
            "does every rank call the same collectives in the same order, also a rank that "
            "owns nothing? (and pass group=self.group, or whatever you named it, to each one)"
        )

    with guards.call_watchdog(WATCHDOG_S, hung):
        opt = cls(
            params,
            lr=spec["lr"],
            betas=tuple(spec["betas"]),
            eps=spec["eps"],
            weight_decay=spec["weight_decay"],
            max_norm=spec["max_norm"],
            group=group,
        )
    after, calls = [], []
    for s, step in enumerate(spec["grads"]):
        for i, (p, g) in enumerate(zip(params, step[rank], strict=True)):
            p.grad = g.clone() if has_grad(spec, i, s) else None
        calls.append([])
        with guards.call_watchdog(WATCHDOG_S, hung), counted_collectives(Counter(), calls[-1]):
            opt.step()
        after.append(flat(params))
    held = held_bytes(opt, exclude=[*params, *(p.grad for p in params)])
    return {"params": after, "held": held, "calls": calls}


def run_rank(ns: dict, inputs: dict, case: dict, rank: int, world: int) -> list:
    """The student's ``ShardedAdamW`` on this rank, once per run it takes part in (``None``
    for the others); runs over fewer ranks than the job's get ``group``, a process group of
    ranks ``0 .. n-1``."""
    cls = guards.load_student_file(ZERO_FILE)["ShardedAdamW"]
    sizes = [spec["ranks"] for spec in case["runs"]]
    groups = groups_for(sizes, world)
    out = [
        _one_run(cls, spec, rank, groups.get(spec["ranks"])) if rank < spec["ranks"] else None
        for spec in case["runs"]
    ]
    release(sizes, rank, world)
    return out


def mean_grads(spec: dict, s: int) -> list[torch.Tensor | None]:
    """Step ``s``'s gradients averaged over the ranks, None where a parameter has none."""
    return [
        torch.stack(g).mean(0) if has_grad(spec, i, s) else None
        for i, g in enumerate(zip(*spec["grads"][s], strict=True))
    ]


def oracle(spec: dict, grads_of=None) -> list[torch.Tensor]:
    """``torch.optim.AdamW`` on one process: the flat parameters after every step (it
    skips a parameter whose ``.grad`` is None, as it always does).

    ``grads_of(step)`` replaces the averaged gradients (the hidden diagnoses use it)."""
    params = [
        nn.Parameter(t.clone(), requires_grad=i not in spec["frozen"])
        for i, t in enumerate(spec["init"])
    ]
    opt = torch.optim.AdamW(
        params,
        lr=spec["lr"],
        betas=tuple(spec["betas"]),
        eps=spec["eps"],
        weight_decay=spec["weight_decay"],
    )
    out = []
    for s in range(len(spec["grads"])):
        for p, g in zip(params, grads_of(s) if grads_of else mean_grads(spec, s), strict=True):
            p.grad = g
        if spec["max_norm"] is not None:
            torch.nn.utils.clip_grad_norm_(params, spec["max_norm"])
        opt.step()
        out.append(flat(params))
    return out


def run_text(spec: dict) -> str:
    """``"3 ranks, N = 1,234 float32 numbers in 5 tensors, clipped at 0.12"``."""
    n = sum(math.prod(s) for s in spec["shapes"])
    clip = f", clipped at max_norm {spec['max_norm']:.3g}" if spec["max_norm"] else ""
    none = ""
    if spec["frozen"]:
        none += f", tensor {spec['frozen'][0]} frozen (requires_grad=False, .grad None)"
    for i, steps in spec["skips"].items():
        at = " and ".join(str(s + 1) for s in steps)
        none += f", tensor {i} without a gradient (.grad None) at steps {at}"
    return (
        f"{spec['ranks']} ranks, N = {n:,} {spec['dtype']} numbers in {len(spec['shapes'])} "
        f"tensors{clip}{none}"
    )


def bound(spec: dict) -> int:
    """The most bytes the optimizer may hold per rank: three chunks, plus :data:`SLACK`."""
    n = sum(math.prod(s) for s in spec["shapes"])
    size = torch.empty((), dtype=DTYPES[spec["dtype"]]).element_size()
    return 3 * -(-n // spec["ranks"]) * size + SLACK


def params_problem(spec: dict, outs: list) -> str | None:
    """Where some rank's parameters leave AdamW's, or None."""
    want = oracle(spec)
    tol = ATOL[spec["dtype"]]
    for rank, o in enumerate(outs):
        if not isinstance(o, dict) or not isinstance(o.get("params"), list):
            return f"{run_text(spec)}: rank {rank} returned {kind(o)}"
        if len(o["params"]) != len(want):
            return f"{run_text(spec)}: rank {rank} took {len(o['params'])} steps"
        for s, (got, expected) in enumerate(zip(o["params"], want, strict=True)):
            if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
                return f"{run_text(spec)}: rank {rank}'s parameters changed shape at step {s}"
            diff = (got.double() - expected.double()).abs()
            worst = float(torch.nan_to_num(diff, nan=math.inf).max())
            if worst > tol:
                i = int(torch.nan_to_num(diff, nan=math.inf).argmax())
                return (
                    f"{run_text(spec)}: after step {s + 1}, rank {rank}'s parameters differ "
                    f"from torch.optim.AdamW's on the averaged gradients by {worst:.3g} "
                    f"(allowed {tol:g}), e.g. number {i} of the flat vector: expected "
                    f"{float(expected[i]):.8g}, got {float(got[i]):.8g}"
                )
    return None


def memory_problem(spec: dict, outs: list) -> str | None:
    """A rank whose optimizer holds more than three chunks' worth, or None."""
    limit = bound(spec)
    n = sum(math.prod(s) for s in spec["shapes"])
    size = torch.empty((), dtype=DTYPES[spec["dtype"]]).element_size()
    for rank, o in enumerate(outs):
        if o["held"] > limit:
            return (
                f"{run_text(spec)}: between steps your ShardedAdamW holds {o['held']:,} bytes "
                f"of tensors on rank {rank} (everything reachable from it, but the model's "
                f"parameters and gradients); a rank's chunk is {-(-n // spec['ranks']):,} "
                f"numbers, so ZeRO keeps about three chunks (the chunk and its two moments), "
                f"at most {limit:,} bytes; unsharded AdamW would hold {2 * n * size:,}. Keep "
                "only this rank's chunk between steps (a slice keeps its whole tensor alive: "
                ".clone() it), and no full-size buffer"
            )
    return None


#: The collectives a step may call: the gradients' reduce-scatter, the parameters'
#: all-gather (any of torch.distributed's forms), and all-reduces of the norm's few numbers.
REDUCE_SCATTERS = (
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "_reduce_scatter_base",
)
ALL_GATHERS = ("all_gather", "all_gather_single", "all_gather_into_tensor", "_all_gather_base")
ALL_REDUCES = ("all_reduce", "all_reduce_coalesced")


def comm_problem(spec: dict, outs: list) -> str | None:
    """A step whose collectives are not ZeRO's (a reduce-scatter of the gradients, an
    all-gather of the parameters, all-reduces of at most one number per parameter), or
    None."""
    n, tensors = spec["ranks"], len(spec["shapes"])
    c = -(-sum(math.prod(s) for s in spec["shapes"]) // n)
    for rank, o in enumerate(outs):
        calls = o.get("calls")
        if not isinstance(calls, list) or len(calls) != STEPS:
            return f"{run_text(spec)}: rank {rank}'s collectives were not recorded"
        for s, step in enumerate(calls):
            at = f"{run_text(spec)}: at step {s + 1}, rank {rank}"
            names = [name for name, _ in step]
            for name, size in step:
                if name in ALL_REDUCES and size > tensors:
                    return (
                        f"{at} called {name} on {size:,} numbers: a rank needs only its own "
                        "chunk of the averaged gradient, and a reduce-scatter gives it just "
                        "that, for half of an all-reduce's bytes (ZeRO's step moves the bytes "
                        "of one all-reduce in all, as DDP). An all-reduce may carry only the "
                        f"norm's few numbers (at most {tensors} here)"
                    )
                if name not in (*REDUCE_SCATTERS, *ALL_GATHERS, *ALL_REDUCES):
                    return (
                        f"{at} called {name}: a ZeRO step communicates by a reduce-scatter "
                        "(the gradients), an all-gather (the new parameters) and, to clip, "
                        "an all-reduce of a few numbers; nothing else"
                    )
            gathered = sum(size for name, size in step if name in ALL_GATHERS)
            if not any(name in REDUCE_SCATTERS for name in names) or not gathered:
                return (
                    f"{at} called {names or 'no collective'}: every step reduce-scatters the "
                    "gradients and all-gathers the new parameters"
                )
            if gathered > n * (c + tensors):
                return (
                    f"{at} all-gathered {gathered:,} numbers: the new parameters are "
                    f"{n} chunks of {c:,} (padded); gather them, not the gradients"
                )
    return None


def judge(inputs: dict, outputs: dict) -> str:
    """Every rank equal to AdamW after every step, about 1/N of its state per rank, and
    ZeRO's collectives."""
    for case, ranks in zip(inputs["cases"], outputs["cases"], strict=True):
        for r, spec in enumerate(case["runs"]):
            outs = [rank_out[r] if len(rank_out) > r else None for rank_out in ranks]
            outs = outs[: spec["ranks"]]
            why = params_problem(spec, outs) or memory_problem(spec, outs)
            if why := why or comm_problem(spec, outs):
                raise CheckFailed(why)
    worlds = " and ".join(sorted({str(s["ranks"]) for c in inputs["cases"] for s in c["runs"]}))
    return (
        f"ShardedAdamW equals torch.optim.AdamW after each of {STEPS} steps on {worlds} ranks "
        "(float32 and float64, uneven chunks, clipping by the global norm), holding about "
        "1/N of AdamW's state per rank and communicating by reduce-scatter and all-gather"
    )


EXERCISE = Exercise(
    "test_ex2_zero",
    ("ex2_zero",),
    "a sharded AdamW (ZeRO) equal to AdamW",
    make_inputs,
    judge,
    run_rank=run_rank,
    forbid_modules=BUILT_INS,
    timeout=120,
    visible_inputs=visible_inputs,
    files=(ZERO_FILE,),
)
