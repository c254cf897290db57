"""Exercise 5: ``scaled_lr`` (the linear scaling rule) and ``warmup_lr`` (the warm-up ramp).

Both are judged by their properties, each probed with extra calls:

``scaled_lr(base_lr, base_batch, batch_size, world_size, accum_steps)``
    the *base set-up* (a global batch of ``base_batch``: one process, no accumulation)
    keeps ``base_lr``; otherwise the rate is proportional to the global batch
    ``batch_size x world_size x accum_steps``, i.e. its ratio to the base set-up's rate is
    the ratio of the global batches. Doubling each factor on its own tells which one is
    forgotten.
``warmup_lr(step, base_lr, peak_lr, warmup_steps)``
    ``base_lr`` at step 0, ``peak_lr`` at step ``warmup_steps`` and after (at once when
    ``warmup_steps`` is 0), and a straight line in between: at the midpoint of two steps of
    the ramp, the rate is the mean of their rates.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch

from ddp_lab.checks.contract import Exercise
from ddp_lab.checks.failure import CheckFailed
from ddp_lab.checks.values import number, randint, uniform

#: Relative and absolute tolerance of every comparison.
REL, ABS = 1e-9, 1e-12


def scaled_calls(setup: list) -> list[tuple]:
    """The calls that probe one set-up ``[base_lr, base_batch, batch_size, world_size,
    accum_steps]``: itself, the base set-up, and each factor doubled."""
    base_lr, base_batch, b, w, k = setup
    return [
        (base_lr, base_batch, b, w, k),
        (base_lr, base_batch, base_batch, 1, 1),
        (base_lr, base_batch, 2 * b, w, k),
        (base_lr, base_batch, b, 2 * w, k),
        (base_lr, base_batch, b, w, 2 * k),
    ]


def warmup_steps_probed(ramp: list) -> list[int]:
    """The steps that probe one ramp ``[base_lr, peak_lr, warmup_steps, after, m1, d1, m2,
    d2]``: 0, warmup_steps, a later step, and two triples ``m - d, m, m + d`` on the ramp."""
    _, _, steps, after, m1, d1, m2, d2 = ramp
    probes = [0, steps, steps + after]
    if steps >= 2:
        probes += [m1 - d1, m1, m1 + d1, m2 - d2, m2, m2 + d2]
    return probes


def _setups(gen: torch.Generator) -> list[list]:
    """Six set-ups, half with accumulation. The batch per process is odd and the world is
    larger than ``accum_steps``, so that no typical mistake is right by luck (a global batch
    equal to ``base_batch``, ``world_size == accum_steps``)."""
    setups = []
    for i in range(6):
        accum = randint(gen, 2, 4) if i % 2 else 1  # > 1: forgetting it must show
        setups.append(
            [
                uniform(gen, 0.01, 0.5),
                2 ** randint(gen, 4, 10),
                2 * randint(gen, 2, 127) + 1,
                randint(gen, 5 if accum > 1 else 2, 64),
                accum,
            ]
        )
    return setups


def _ramp(gen: torch.Generator, base_lr: float, peak_lr: float, steps: int) -> list:
    after = randint(gen, 1, max(1, steps))
    if steps < 2:
        return [base_lr, peak_lr, steps, after, 0, 0, 0, 0]
    m1 = randint(gen, 1, steps // 2)  # a triple that starts at step 0 ...
    m2 = randint(gen, (steps + 1) // 2, steps - 1)  # ... and one that ends at warmup_steps
    return [base_lr, peak_lr, steps, after, m1, m1, m2, steps - m2]


def make_inputs(gen: torch.Generator) -> dict:
    """Six random set-ups (half with accumulation) and ten ramps (one of 2 steps, one of
    none, the rest random)."""
    ramps = [
        _ramp(gen, uniform(gen, 0.001, 0.1), uniform(gen, 0.1, 2.0), randint(gen, 2, 499))
        for _ in range(8)
    ]
    ramps.append(_ramp(gen, 0.05, 0.4, 2))
    ramps.append(_ramp(gen, 0.05, 0.4, 0))  # warmup_steps = 0 last
    return {"scaled": _setups(gen), "warmup": ramps}


def visible_inputs(gen: torch.Generator) -> dict:
    """Three hand-picked set-ups and three ramps."""
    return {
        "scaled": [[0.1, 256, 32, 8, 1], [0.05, 64, 16, 2, 4], [0.4, 1024, 128, 4, 1]],
        "warmup": [
            [0.1, 0.8, 5, 4, 2, 2, 3, 2],
            [0.1, 0.4, 6, 1, 1, 1, 4, 2],
            [0.02, 0.02, 0, 3, 0, 0, 0, 0],
        ],
    }


def _value(fn: Callable, args: tuple):
    """``fn(*args)`` as a float; an error (but the stub's) as ``"raised Error: ..."``."""
    try:
        return number(fn(*args))
    except NotImplementedError:
        raise
    except Exception as err:  # noqa: BLE001 - the student's error, said by the judge
        return f"raised {type(err).__name__}: {err}"[:200]


def run(ns: dict, inputs: dict, workdir: Path) -> dict:
    """Call both functions at every probe."""
    scaled, warmup = ns["scaled_lr"], ns["warmup_lr"]
    return {
        "scaled": [[_value(scaled, c) for c in scaled_calls(s)] for s in inputs["scaled"]],
        "warmup": [
            [_value(warmup, (step, r[0], r[1], r[2])) for step in warmup_steps_probed(r)]
            for r in inputs["warmup"]
        ],
    }


def close(a, b) -> bool:
    """``a`` and ``b`` are equal numbers up to :data:`REL` / :data:`ABS`."""
    if not isinstance(a, float) or not isinstance(b, float):
        return False
    return math.isclose(a, b, rel_tol=REL, abs_tol=ABS)


def said_scaled(args: tuple, got) -> str:
    """``"scaled_lr(base_lr=0.1, ...) = 0.2"`` (or ``"... raised ..."``)."""
    base_lr, base_batch, b, w, k = args
    value = f"= {got:.6g}" if isinstance(got, float) else str(got)
    return (
        f"scaled_lr(base_lr={base_lr:.4g}, base_batch={base_batch}, batch_size={b}, "
        f"world_size={w}, accum_steps={k}) {value}"
    )


def _ratio(a, b) -> float:
    return a / b if isinstance(a, float) and isinstance(b, float) and b != 0 else math.nan


def scaled_problem(setup: list, got: list) -> str | None:
    """Which property of the linear scaling rule one set-up breaks, or None."""
    calls = scaled_calls(setup)
    base_lr, base_batch, b, w, k = setup
    for args, value in zip(calls, got, strict=True):
        if isinstance(value, str):
            return said_scaled(args, value)
    if not close(got[1], float(base_lr)):
        return (
            f"{said_scaled(calls[1], got[1])}, expected base_lr = {base_lr:.6g}: a global batch "
            "of base_batch samples keeps the rate it was tuned with"
        )
    want = got[1] * (b * w * k) / base_batch
    if close(got[0], want):
        return None
    said = f"{said_scaled(calls[0], got[0])}, expected {want:.6g}"
    ratios = [_ratio(got[i], got[0]) for i in (2, 3, 4)]
    if all(math.isclose(r, 1.0, rel_tol=1e-6) for r in ratios):
        return f"{said}: the learning rate must grow with the global batch"
    if math.isclose(ratios[0], 0.5, rel_tol=1e-6):
        return f"{said}: the ratio is upside down: a larger global batch gets a larger rate"
    if math.isclose(ratios[0], 2.0, rel_tol=1e-6) and math.isclose(ratios[1], 1.0, rel_tol=1e-6):
        return f"{said}: the global batch counts every process: times world_size"
    if math.isclose(ratios[0], 2.0, rel_tol=1e-6) and math.isclose(ratios[2], 1.0, rel_tol=1e-6):
        return (
            f"{said}: the global batch also counts the accumulated micro-batches: times accum_steps"
        )
    doubled = ", ".join(f"{r:.3g}" for r in ratios)
    return (
        f"{said}: the rate must be proportional to the global batch batch_size x world_size x "
        f"accum_steps; doubling batch_size, world_size, accum_steps multiplied it by {doubled}, "
        "expected 2 each"
    )


def warmup_problem(ramp: list, got: list) -> str | None:
    """Which property of the warm-up ramp one ramp breaks, or None."""
    base_lr, peak_lr, steps = ramp[0], ramp[1], ramp[2]
    probes = warmup_steps_probed(ramp)

    def said(i: int) -> str:
        value = got[i] if isinstance(got[i], str) else f"= {got[i]:.6g}"
        return (
            f"warmup_lr(step={probes[i]}, base_lr={base_lr:.4g}, peak_lr={peak_lr:.4g}, "
            f"warmup_steps={steps}) {value}"
        )

    for i, value in enumerate(got):
        if isinstance(value, str):
            zero = ": with warmup_steps = 0 the rate is peak_lr at once" if steps == 0 else ""
            return said(i) + zero
    if steps > 0 and not close(got[0], float(base_lr)):
        return f"{said(0)}, expected base_lr = {base_lr:.6g}: the warm-up starts at base_lr"
    for i in (1, 2):
        if not close(got[i], float(peak_lr)):
            return (
                f"{said(i)}, expected peak_lr = {peak_lr:.6g}: from step warmup_steps on the "
                "rate stays at peak_lr"
            )
    for t in range(3, len(probes), 3):
        lo, mid, hi = got[t : t + 3]
        if not close(mid, (lo + hi) / 2):
            return (
                f"{said(t + 1)}, but the mean of the rates at steps {probes[t]} and "
                f"{probes[t + 2]} is {(lo + hi) / 2:.6g}: the warm-up is a straight line from "
                "base_lr (step 0) to peak_lr (step warmup_steps)"
            )
    return None


def judge(inputs: dict, outputs: dict) -> str:
    """Both functions keep every property at every probe."""
    for setup, got in zip(inputs["scaled"], outputs["scaled"], strict=True):
        if why := scaled_problem(setup, got):
            raise CheckFailed(why)
    for ramp, got in zip(inputs["warmup"], outputs["warmup"], strict=True):
        if why := warmup_problem(ramp, got):
            raise CheckFailed(why)
    return (
        f"scaled_lr keeps base_lr for base_batch and grows in proportion to the global batch "
        f"({len(inputs['scaled'])} set-ups, with accumulation); warmup_lr ramps in a straight "
        f"line from base_lr to peak_lr and stays there ({len(inputs['warmup'])} ramps)"
    )


EXERCISE = Exercise(
    "test_ex5_scaled_lr",
    ("ex5_scaled_lr",),
    "linear learning-rate scaling and warm-up",
    make_inputs,
    judge,
    run=run,
    timeout=30,
    visible_inputs=visible_inputs,
)
