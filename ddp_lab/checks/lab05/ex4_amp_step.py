"""Exercise 4, ``amp_step``: one mixed-precision optimizer step, with clipping.

The checker hands the student's function a float32 model, plain SGD, a
``torch.amp.GradScaler("cpu", ...)`` (disabled in the bfloat16 case), a batch, ``max_norm``
and the autocast dtype, and records the weights before and after each step, the norm the
function returned and the scaler's scale afterwards.

The oracle is the float32 step without any scaler: from the same weights, the loss in
float32, ``backward``, ``clip_grad_norm_(max_norm)`` on the true gradients, ``step``. A
right mixed-precision step moves the weights by the same amount up to float16 (bfloat16)
rounding, and returns the same norm before clipping. Clipping the *scaled* gradients (before
``scaler.unscale_``) clips by a factor ``scale`` too much: the weights barely move. Case set:
float16 with a scale of 2**12 to 2**14 and a true norm below ``max_norm`` (no clipping
needed; the second step runs at twice the scale, and at 2**17 about one draw in a hundred
overflowed there, where a right step is skipped), float16 with clipping active, float16
with a scale of 2**40 (the gradients overflow: the step is skipped, the scale halves), and
bfloat16 with a disabled scaler and clipping active; two steps in a row where the step is
not skipped (the scale doubles after each, at a growth interval of 1).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

from ddp_lab.checks.contract import Exercise
from ddp_lab.checks.failure import CheckFailed
from ddp_lab.checks.lab05.common import net, random_state, state
from ddp_lab.checks.values import number, randint, same_bits, uniform

#: How far a right step may be from the float32 step (relative to the step's size).
TOLERANCE = {"float16": 1e-2, "bfloat16": 5e-2}
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def fp32_step(weights: dict, case: dict, step: int) -> tuple[dict, float, float]:
    """The oracle: the float32 step with clipping on the true gradients.

    Returns:
        ``(weights after, norm before clipping, norm of the unclipped step)``.
    """
    model = net(weights)
    optimizer = torch.optim.SGD(model.parameters(), lr=case["lr"])
    optimizer.zero_grad(set_to_none=True)
    F.cross_entropy(model(case["xs"][step]), case["ys"][step]).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), case["max_norm"])
    optimizer.step()
    return state(model), float(norm), float(norm) * case["lr"]


def _case(gen: torch.Generator, dtype: str, scale: float | None, clip: bool, steps: int) -> dict:
    dims = (randint(gen, 6, 12), randint(gen, 8, 16), 4)
    b = randint(gen, 8, 16)
    case = {
        "dtype": dtype,
        "init_scale": scale,  # None: a disabled scaler (bfloat16)
        "lr": uniform(gen, 0.2, 0.5),
        "init": random_state(dims, gen),
        "xs": [2 * torch.randn(b, dims[0], generator=gen) for _ in range(steps)],
        "ys": [torch.randint(0, dims[2], (b,), generator=gen) for _ in range(steps)],
        "max_norm": 1.0,
    }
    _, norm, _ = fp32_step(case["init"], case, 0)
    case["max_norm"] = norm / uniform(gen, 3, 6) if clip else norm * uniform(gen, 2, 4)
    return case


def make_inputs(gen: torch.Generator) -> dict:
    """float16 without and with clipping, float16 overflowing, bfloat16 with clipping."""
    return {
        "cases": [
            _case(gen, "float16", 2.0 ** randint(gen, 12, 14), clip=False, steps=2),
            _case(gen, "float16", 2.0 ** randint(gen, 10, 13), clip=True, steps=2),
            _case(gen, "float16", 2.0**40, clip=True, steps=1),
            _case(gen, "bfloat16", None, clip=True, steps=2),
        ]
    }


def visible_inputs(gen: torch.Generator) -> dict:
    """float16 without clipping (one step) and bfloat16 with clipping."""
    return {
        "cases": [
            _case(gen, "float16", 2.0**16, clip=False, steps=1),
            _case(gen, "bfloat16", None, clip=True, steps=1),
        ]
    }


def _scaler(case: dict) -> torch.amp.GradScaler:
    if case["init_scale"] is None:
        return torch.amp.GradScaler("cpu", enabled=False)
    return torch.amp.GradScaler("cpu", init_scale=case["init_scale"], growth_interval=1)


def run(ns: dict, inputs: dict, workdir: Path | None) -> dict:
    """Call the student's ``amp_step`` for every step of every case."""
    fn = ns["amp_step"]
    runs = []
    for case in inputs["cases"]:
        model = net(case["init"])
        optimizer = torch.optim.SGD(model.parameters(), lr=case["lr"])
        scaler = _scaler(case)
        steps = []
        for x, y in zip(case["xs"], case["ys"], strict=True):
            before = state(model)
            try:
                norm = fn(model, optimizer, scaler, x, y, case["max_norm"], DTYPES[case["dtype"]])
            except NotImplementedError:
                raise
            except Exception as err:  # noqa: BLE001 - judged after the steps before it
                steps.append({"error": f"{type(err).__name__}: {err}"[:300]})
                break
            steps.append(
                {
                    "before": before,
                    "after": state(model),
                    "norm": number(norm),
                    "scale": number(scaler.get_scale()),
                }
            )
        runs.append(steps)
    return {"runs": runs}


def describe(case: dict) -> str:
    """How feedback names a case."""
    if case["init_scale"] is None:
        return f"bfloat16 (scaler disabled), max_norm {case['max_norm']:.3g}"
    return (
        f"float16, loss scale 2**{math.log2(case['init_scale']):.0f}, max_norm "
        f"{case['max_norm']:.3g}"
    )


def flat_delta(after: dict, before: dict) -> torch.Tensor:
    """The step as one float64 vector (``after - before``)."""
    return torch.cat([(after[k].double() - before[k].double()).reshape(-1) for k in sorted(after)])


def overflows(case: dict) -> bool:
    """True for the case whose float16 gradients overflow at the first step (scale 2**40)."""
    return case["init_scale"] is not None and case["init_scale"] >= 2.0**30


def step_problem(case: dict, i: int, got: dict, scale_before: float) -> str | None:
    """What is wrong with step ``i`` of a case, or None."""
    what = f"amp_step, {describe(case)}, step {i}"
    if "error" in got:
        return f"{what}: amp_step raised {got['error']}"
    overflow = overflows(case)
    if overflow:
        if not same_bits(got["after"], got["before"]):
            return (
                f"{what}: with this scale the float16 gradients overflow (inf): the step must "
                "be skipped (scaler.step(optimizer) does that; optimizer.step() does not)"
            )
        if got["scale"] != scale_before / 2:
            return (
                f"{what}: after an overflow the scale should halve to {scale_before / 2:g}, "
                f"got {got['scale']:g}: call scaler.update() once per step"
            )
        return None
    want, norm, _ = fp32_step(got["before"], case, i)
    expected, delta = flat_delta(want, got["before"]), flat_delta(got["after"], got["before"])
    tol = TOLERANCE[case["dtype"]]
    if not bool(torch.isfinite(delta).all()):
        return f"{what}: the weights are no longer finite"
    off = float((delta - expected).norm() / expected.norm())
    if off > tol:
        ratio = float(delta.norm() / expected.norm())
        return (
            f"{what}: the step moved the weights by {ratio:.3g} times the float32 step with "
            f"clip_grad_norm_ on the true gradients (relative difference {off:.2g}, allowed "
            f"{tol:g})"
        )
    if not abs(got["norm"] - norm) <= tol * norm:
        return (
            f"{what}: returned {got['norm']:.6g}; expected the norm of the true (unscaled) "
            f"gradients before clipping, {norm:.6g}"
        )
    want_scale = 1.0 if case["init_scale"] is None else scale_before * 2
    if got["scale"] != want_scale:
        return (
            f"{what}: the scale after the step should be {want_scale:g} (GradScaler doubles "
            f"it after a good step at growth_interval=1), got {got['scale']:g}: call "
            "scaler.update() once per step, after scaler.step"
        )
    return None


def judge(inputs: dict, outputs: dict) -> str:
    """Every step against the float32 step with clipping on the true gradients."""
    runs = outputs.get("runs")
    if not isinstance(runs, list) or len(runs) != len(inputs["cases"]):
        raise CheckFailed("amp_step: expected one run per case")
    for case, steps in zip(inputs["cases"], runs, strict=True):
        scale = 1.0 if case["init_scale"] is None else case["init_scale"]
        for i, got in enumerate(steps):
            if why := step_problem(case, i, got, scale):
                raise CheckFailed(why)
            scale = got["scale"]
    n = sum(len(steps) for steps in runs)
    return (
        f"amp_step equals the float32 step with clip_grad_norm_ on the true gradients over {n} "
        "steps (float16 with and without clipping, bfloat16), skips a float16 overflow and "
        "updates the scale"
    )


EXERCISE = Exercise(
    "test_ex4_amp_step",
    ("ex4_amp_step",),
    "a clipped mixed-precision step equals the float32 step",
    make_inputs,
    judge,
    run=run,
    timeout=60,
    visible_inputs=visible_inputs,
)
