"""Exercise 6: ``lr_at(step, base_lr, base_batch, batch_size, world_size, accum_steps,
warmup_steps)``, the learning rate of optimizer step ``step`` (1, 2, ...) after scaling for
the global batch and with a linear warm-up.

Judged by properties, each probed with extra calls:

- after the warm-up, the *base set-up* (a global batch of ``base_batch``: one process, no
  accumulation) keeps ``base_lr``, and the rate is proportional to the global batch
  ``batch_size x world_size x accum_steps``: its ratio to the base set-up's rate is the
  ratio of the global batches (doubling each factor on its own tells which one is missing);
- during the warm-up, the rate of step k is the warmed-up rate times the factor that the
  course trainer's ``--warmup-steps`` gives step k (``ddp_lab.optim.warmup_schedule``, the
  oracle): the student's function and the trainer's logged ``lr`` agree step for step.

Case set: eight set-ups (half with accumulation), with warm-ups of 0 steps, 1 step and
random lengths up to 500.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch

from ddp_lab.checks.contract import Exercise
from ddp_lab.checks.failure import CheckFailed
from ddp_lab.checks.values import number, randint, uniform
from ddp_lab.optim import warmup_schedule

#: Relative and absolute tolerance of every comparison.
REL, ABS = 1e-9, 1e-12
#: Fields of a set-up.
FIELDS = ("base_lr", "base_batch", "batch_size", "world_size", "accum_steps", "warmup_steps")


def scaled_calls(setup: dict) -> list[dict]:
    """Calls after the warm-up (step ``warmup_steps + after``) that probe the scaling rule:
    the set-up itself, the base set-up, each factor doubled, and the set-up 7 steps later."""
    base = {"step": setup["warmup_steps"] + setup["after"], **{k: setup[k] for k in FIELDS}}
    return [
        base,
        {**base, "batch_size": base["base_batch"], "world_size": 1, "accum_steps": 1},
        {**base, "batch_size": 2 * base["batch_size"]},
        {**base, "world_size": 2 * base["world_size"]},
        {**base, "accum_steps": 2 * base["accum_steps"]},
        {**base, "step": base["step"] + 7},
    ]


def warmup_calls(setup: dict) -> list[dict]:
    """Calls during the warm-up: steps 1, a middle step and ``warmup_steps``."""
    base = {k: setup[k] for k in FIELDS}
    steps = sorted({1, setup["middle"], setup["warmup_steps"]}) if setup["warmup_steps"] else []
    return [{"step": s, **base} for s in steps]


def _setup(gen: torch.Generator, accum: bool, warmup: int) -> dict:
    """The batch per process is odd and the world larger than ``accum_steps``, so that no
    typical mistake is right by luck (a global batch equal to ``base_batch``,
    ``world_size == accum_steps``)."""
    k = randint(gen, 2, 4) if accum else 1
    return {
        "base_lr": uniform(gen, 0.01, 0.5),
        "base_batch": 2 ** randint(gen, 4, 10),
        "batch_size": 2 * randint(gen, 2, 127) + 1,
        "world_size": randint(gen, 5 if accum else 2, 64),
        "accum_steps": k,
        "warmup_steps": warmup,
        "after": randint(gen, 1, 50),
        "middle": randint(gen, 1, max(1, warmup)),
    }


def make_inputs(gen: torch.Generator) -> dict:
    """Eight set-ups, half with accumulation: warm-ups of 0 and 1 steps and six random ones
    (2 to 500 steps)."""
    warmups = [0, 1] + [randint(gen, 2, 500) for _ in range(6)]
    return {"setups": [_setup(gen, i % 2 == 1, w) for i, w in enumerate(warmups)]}


def visible_inputs(gen: torch.Generator) -> dict:
    """Three hand-picked set-ups."""
    keys = (*FIELDS, "after", "middle")
    return {
        "setups": [
            dict(zip(keys, (0.1, 256, 32, 8, 1, 10, 5, 4), strict=True)),
            dict(zip(keys, (0.05, 64, 16, 2, 4, 0, 3, 1), strict=True)),
            dict(zip(keys, (0.4, 1024, 128, 4, 1, 1, 2, 1), strict=True)),
        ]
    }


def _value(fn: Callable, call: dict):
    """``fn(...)`` as a float; an error (but the stub's) as ``"raised Error: ..."``."""
    try:
        return number(fn(**call))
    except NotImplementedError:
        raise
    except Exception as err:  # noqa: BLE001 - the student's error, said by the judge
        return f"raised {type(err).__name__}: {err}"[:200]


def run(ns: dict, inputs: dict, workdir: Path) -> dict:
    """Call ``lr_at`` at every probe."""
    fn = ns["lr_at"]
    return {
        "scaled": [[_value(fn, c) for c in scaled_calls(s)] for s in inputs["setups"]],
        "warmup": [[_value(fn, c) for c in warmup_calls(s)] for s in inputs["setups"]],
    }


def close(a, b) -> bool:
    """``a`` and ``b`` are equal numbers up to :data:`REL` / :data:`ABS`."""
    if not isinstance(a, float) or not isinstance(b, float):
        return False
    return math.isclose(a, b, rel_tol=REL, abs_tol=ABS)


def said(call: dict, got) -> str:
    """``"lr_at(step=12, base_lr=0.1, ...) = 0.2"`` (or ``"... raised ..."``)."""
    value = f"= {got:.6g}" if isinstance(got, float) else str(got)
    args = ", ".join(f"{k}={call[k]:.4g}" if k == "base_lr" else f"{k}={call[k]}" for k in call)
    return f"lr_at({args}) {value}"


def trainer_factor(step: int, warmup_steps: int) -> float:
    """The share of the rate the trainer's ``--warmup-steps`` gives optimizer step ``step``
    (1, 2, ...): the oracle, read from ``ddp_lab.optim.warmup_schedule``."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    return float(warmup_schedule(opt, warmup_steps).lr_lambdas[0](step - 1))


def _ratio(a, b) -> float:
    return a / b if isinstance(a, float) and isinstance(b, float) and b != 0 else math.nan


def scaled_problem(setup: dict, got: list) -> str | None:
    """Which property of the linear scaling rule one set-up breaks after its warm-up."""
    calls = scaled_calls(setup)
    for call, value in zip(calls, got, strict=True):
        if isinstance(value, str):
            return said(call, value)
    if not close(got[5], got[0]):
        return (
            f"{said(calls[5], got[5])}, but {said(calls[0], got[0])}: the rate keeps changing "
            "after the warm-up; from step warmup_steps on it stays at the scaled rate"
        )
    if not close(got[1], float(setup["base_lr"])):
        return (
            f"{said(calls[1], got[1])}, expected base_lr = {setup['base_lr']:.6g}: a global "
            "batch of base_batch samples keeps the rate it was tuned with"
        )
    glob = setup["batch_size"] * setup["world_size"] * setup["accum_steps"]
    want = got[1] * glob / setup["base_batch"]
    if close(got[0], want):
        return None
    head = f"{said(calls[0], got[0])}, expected {want:.6g}"
    ratios = [_ratio(got[i], got[0]) for i in (2, 3, 4)]
    if all(math.isclose(r, 1.0, rel_tol=1e-6) for r in ratios):
        return f"{head}: the learning rate must grow with the global batch"
    if math.isclose(ratios[0], 0.5, rel_tol=1e-6):
        return f"{head}: the ratio is upside down: a larger global batch gets a larger rate"
    if math.isclose(ratios[0], 2.0, rel_tol=1e-6) and math.isclose(ratios[1], 1.0, rel_tol=1e-6):
        return f"{head}: the global batch counts every process: times world_size"
    if math.isclose(ratios[0], 2.0, rel_tol=1e-6) and math.isclose(ratios[2], 1.0, rel_tol=1e-6):
        return (
            f"{head}: the global batch also counts the accumulated micro-batches: times accum_steps"
        )
    doubled = ", ".join(f"{r:.3g}" for r in ratios)
    return (
        f"{head}: after the warm-up the rate must be proportional to the global batch "
        f"batch_size x world_size x accum_steps; doubling batch_size, world_size, accum_steps "
        f"multiplied it by {doubled}, expected 2 each"
    )


def warmup_problem(setup: dict, got: list, after: float) -> str | None:
    """Which step of the warm-up leaves the trainer's ramp, or None."""
    for call, value in zip(warmup_calls(setup), got, strict=True):
        if isinstance(value, str):
            return said(call, value)
        factor = trainer_factor(call["step"], setup["warmup_steps"])
        if not close(value, factor * after):
            return (
                f"{said(call, value)}, expected {factor:.6g} x the warmed-up rate {after:.6g} "
                f"= {factor * after:.6g}: like the trainer's --warmup-steps {call['warmup_steps']}"
                ", optimizer step k of the warm-up uses k / warmup_steps of the scaled rate "
                "(step 1 already moves; from step warmup_steps on, the whole rate)"
            )
    return None


def judge(inputs: dict, outputs: dict) -> str:
    """The scaling rule after the warm-up, the trainer's ramp during it."""
    for setup, got in zip(inputs["setups"], outputs["scaled"], strict=True):
        if why := scaled_problem(setup, got):
            raise CheckFailed(why)
    for setup, got, scaled in zip(
        inputs["setups"], outputs["warmup"], outputs["scaled"], strict=True
    ):
        if why := warmup_problem(setup, got, scaled[0]):
            raise CheckFailed(why)
    warmups = sorted({s["warmup_steps"] for s in inputs["setups"]})
    return (
        f"lr_at keeps base_lr for a global batch of base_batch, grows in proportion to the "
        f"global batch ({len(inputs['setups'])} set-ups, with accumulation), and warms up like "
        f"the trainer's --warmup-steps ({', '.join(map(str, warmups))} steps)"
    )


EXERCISE = Exercise(
    "test_ex6_lr_at",
    ("ex6_lr_at",),
    "the learning rate for a larger global batch, warmed up",
    make_inputs,
    judge,
    run=run,
    timeout=30,
    visible_inputs=visible_inputs,
)
