"""Exercise 6: ``warmup_steps_for(base_batch, batch_size, world_size, accum_steps,
warmup_samples)``, the shortest warm-up that keeps the first steps of a linearly scaled run
as gentle as the run the learning rate was tuned on.

The contract (the notebook's): the rate ``base_lr`` was tuned for a global batch of
``base_batch`` samples; a run with the global batch ``batch_size x world_size x
accum_steps`` scales it linearly and ramps it up with the course trainer's
``--warmup-steps N`` (``ddp_lab.optim.warmup_schedule``). The answer is the smallest ``N``
(0 included) for which

1. no optimizer step raises the rate by more than ``base_lr`` over the step before (the
   rate before step 1 counts as 0): the tuned run itself takes that jump at its first step;
2. the warm-up sees at least ``warmup_samples`` samples (``N`` steps of the global batch).

Judged by properties, with the trainer's schedule as the oracle (no formula here): the
student's ``N`` must be an ``int`` that meets both conditions, and ``N - 1`` must break one
of them (when ``N > 0``). Case set, every edge in every run: a global batch that is an
integer multiple of ``base_batch`` and one that is not, one equal to it and one smaller, with
accumulation and without, on 2 and 3 processes and more, ``warmup_samples`` of 0, a
multiple of the global batch and not, binding in some cases and not in others.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from ddp_lab.checks.contract import Exercise
from ddp_lab.checks.failure import CheckFailed
from ddp_lab.checks.values import randint
from ddp_lab.optim import warmup_schedule

#: Arguments of one call, in the docstring's order.
FIELDS = ("base_batch", "batch_size", "world_size", "accum_steps", "warmup_samples")
#: Relative slack of the rate comparison (the trainer's factors are floats).
REL = 1e-9


def trainer_factor(step: int, warmup_steps: int) -> float:
    """The share of the scaled rate the trainer's ``--warmup-steps`` gives optimizer step
    ``step`` (1, 2, ...): the oracle, read from ``ddp_lab.optim.warmup_schedule``."""
    return trainer_factors(warmup_steps, step)[-1]


def trainer_factors(warmup_steps: int, last: int) -> list[float]:
    """The trainer's factors of optimizer steps 1 .. ``last`` for ``--warmup-steps``."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    factor = warmup_schedule(opt, warmup_steps).lr_lambdas[0]
    return [float(factor(step - 1)) for step in range(1, last + 1)]


def global_batch(call: dict) -> int:
    """Samples per optimizer step, over all processes and micro-batches."""
    return call["batch_size"] * call["world_size"] * call["accum_steps"]


def largest_rise(call: dict, warmup: int) -> float:
    """The largest rise of the rate from one optimizer step to the next (the rate before
    step 1 is 0), in units of ``base_lr``, over the warm-up and two steps after it."""
    scale = global_batch(call) / call["base_batch"]
    rates = [0.0] + [scale * f for f in trainer_factors(warmup, warmup + 2)]
    return max(b - a for a, b in zip(rates, rates[1:], strict=False))


def gentle(call: dict, warmup: int) -> bool:
    """Condition 1: no step raises the rate by more than ``base_lr``."""
    return largest_rise(call, warmup) <= 1.0 + REL


def long_enough(call: dict, warmup: int) -> bool:
    """Condition 2: the warm-up sees at least ``warmup_samples`` samples."""
    return warmup * global_batch(call) >= call["warmup_samples"]


def _call(base_pow: int, per_step: int, world: int, accum: int, samples: int) -> dict:
    return {
        "base_batch": 2**base_pow,
        "batch_size": per_step,
        "world_size": world,
        "accum_steps": accum,
        "warmup_samples": samples,
    }


def make_inputs(gen: torch.Generator) -> dict:
    """Eleven calls, one per edge case (random values inside)."""
    p = randint(gen, 4, 7)  # base_batch = 2^p, 16 .. 128
    base = 2**p
    odd = 2 * randint(gen, 25, 60) + 1  # odd: the global batch is no multiple of base_batch
    world = randint(gen, 2, 8)
    k = randint(gen, 2, 9)  # an integer multiple of the base batch

    def many(glob: int) -> int:  # more samples than the stability requirement's steps see
        return glob * (glob // base + randint(gen, 5, 30)) + randint(gen, 1, glob - 1)

    calls = [
        # 1. k an integer > 1, no data requirement: exactly k steps
        _call(p, base * k // 2, 2, 1, 0),
        # 2. k not an integer, with accumulation, on 3 processes
        _call(p, odd, 3, randint(gen, 2, 4), 0),
        # 3. the global batch equals base_batch: no warm-up needed
        _call(p, base // 2, 2, 1, 0),
        # 4. a smaller global batch than the tuned one: no warm-up needed
        _call(p, base // 8, 3, 1, 0),
        # 5. a smaller global batch, but a warm-up in samples that is not a multiple
        _call(p, base // 4, 2, 1, base * randint(gen, 3, 9) + randint(gen, 1, 7)),
        # 6. the data requirement binds (many samples, not a multiple), with accumulation
        _call(p, odd, world, 2, many(odd * world * 2)),
        # 7. the stability requirement binds (few samples), on 3 processes
        _call(p, odd + 2, 3, 1, randint(gen, 1, 3 * (odd + 2) - 1)),
        # 8. warmup_samples an exact multiple of the global batch
        _call(p, base, 2, 2, 4 * base * randint(gen, 20, 60)),
        # 9. many processes (32 to 128): the stability requirement binds
        _call(p, odd, 16 * world, 1, 16 * world * odd * randint(gen, 2, 5)),
        # 10. k just above an integer (a fraction below 1/2: rounding is not enough)
        _call(p, (k * base + 2 * randint(gen, 1, base // 4 - 1)) // 2, 2, 1, 0),
        # 11. k a fraction above 1/2 past an integer (floor and rounding differ)
        _call(p, (k * base + base // 2 + 2 * randint(gen, 1, base // 4 - 1)) // 2, 2, 1, 0),
    ]
    return {"calls": calls}


def visible_inputs(gen: torch.Generator) -> dict:
    """Five hand-picked calls: 8 x 32 against 64, the same with 3000 samples, 2 x 48 and
    2 x 20 against 32, and 2 x 8 against 32."""
    keys = FIELDS
    rows = (
        (64, 32, 8, 1, 0),
        (64, 32, 8, 1, 3000),
        (32, 48, 2, 1, 0),
        (32, 20, 2, 1, 0),
        (32, 8, 2, 1, 0),
    )
    return {"calls": [dict(zip(keys, row, strict=True)) for row in rows]}


def _value(fn: Callable, call: dict):
    """``fn(...)``; an error (but the stub's) as ``"raised Error: ..."``."""
    try:
        return fn(**call)
    except NotImplementedError:
        raise
    except Exception as err:  # noqa: BLE001 - the student's error, said by the judge
        return f"raised {type(err).__name__}: {err}"[:200]


def run(ns: dict, inputs: dict, workdir: Path) -> dict:
    """Call ``warmup_steps_for`` on every call; keep the value and its type."""
    fn = ns["warmup_steps_for"]
    out = []
    for call in inputs["calls"]:
        got = _value(fn, call)
        is_int = isinstance(got, int) and not isinstance(got, bool)
        out.append({"value": int(got) if is_int else str(got)[:200], "int": is_int})
    return {"results": out}


def said(call: dict, got) -> str:
    """``"warmup_steps_for(base_batch=64, ...) = 8"``."""
    args = ", ".join(f"{k}={call[k]}" for k in FIELDS)
    return f"warmup_steps_for({args}) = {got}"


def problem(call: dict, result: dict) -> str | None:
    """Which condition the student's warm-up breaks, or why it is not the shortest."""
    got = result.get("value") if isinstance(result, dict) else None
    if not isinstance(result, dict) or result.get("int") is not True:
        return f"{said(call, got)}: expected a number of optimizer steps, an int (>= 0)"
    if got < 0:
        return f"{said(call, got)}: a warm-up cannot last fewer than 0 steps"
    glob = global_batch(call)
    if not gentle(call, got):
        rise = largest_rise(call, got)
        return (
            f"{said(call, got)}: with that warm-up one step raises the rate by {rise:.4g} x "
            f"base_lr (global batch {glob} against base_batch {call['base_batch']}); the "
            "tuned run never rose by more than base_lr in one step"
        )
    if not long_enough(call, got):
        return (
            f"{said(call, got)}: {got} steps of the global batch ({glob} samples each) see "
            f"{got * glob} samples, fewer than warmup_samples = {call['warmup_samples']}"
        )
    if got > 0 and gentle(call, got - 1) and long_enough(call, got - 1):
        return (
            f"{said(call, got)}: {got - 1} steps already keep every rise within base_lr and "
            "see warmup_samples samples; the warm-up should be the shortest that does"
        )
    return None


def judge(inputs: dict, outputs: dict) -> str:
    """Every call: an int that meets both conditions, and the shortest such."""
    results = outputs.get("results")
    calls = inputs["calls"]
    if not isinstance(results, list) or len(results) != len(calls):
        raise CheckFailed(f"expected one result per call ({len(calls)})")
    for call, result in zip(calls, results, strict=True):
        if why := problem(call, result):
            raise CheckFailed(why)
    shown = ", ".join(str(r["value"]) for r in results)
    return (
        "warmup_steps_for gives the shortest warm-up of the trainer's ramp that keeps every "
        f"step's rise within base_lr and sees warmup_samples samples ({shown} steps)"
    )


EXERCISE = Exercise(
    "test_ex6_warmup_steps",
    ("ex6_warmup_steps",),
    "the shortest warm-up that keeps the first steps gentle",
    make_inputs,
    judge,
    run=run,
    timeout=30,
    visible_inputs=visible_inputs,
)
