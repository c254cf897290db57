"""Exercise 2, ``LossScaler``: a dynamic loss scaler that follows ``torch.amp.GradScaler``.

The checker trains a small float32 model with the student's scaler for a dozen steps. After
some backward passes it writes an inf, a -inf or a NaN into one gradient entry (a forced
overflow), and on some steps it calls ``unscale_`` itself before ``step`` (as one does
before clipping). It records, at every step, what ``scale(loss)`` returned, the scale after
``update()`` and the weights after the step.

The oracle is torch's own ``torch.amp.GradScaler("cpu", ...)``, driven by the same code on
the same inputs in the judge's process: the student's scaler must give the same scaled
losses, the same scale trajectory and the same weights, bit for bit. The case set: growth
interval 1 (the scale grows after every good step) with SGD + momentum, two overflows in a
row and a NaN; growth interval 2 to 4 with Adam, a growth before the first overflow, an
overflow in the middle of an interval (the count of good steps restarts) and a NaN. Every
run draws a growth factor of 4 or 8 and a backoff factor of 1/4 or 1/8 (never the defaults
2 and 1/2, which a scaler that ignores its arguments would follow by luck). One parameter
never receives a gradient (``.grad`` is None). ``get_scale()`` must return a Python float.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

from ddp_lab.checks.contract import Exercise
from ddp_lab.checks.failure import CheckFailed
from ddp_lab.checks.lab05.common import net, random_state, state
from ddp_lab.checks.values import kind, max_diff, number, plain, randint, same_bits, uniform

#: Forced gradient events: what is written into one gradient entry after a backward pass.
EVENTS = {0: None, 1: math.inf, 2: -math.inf, 3: math.nan}
EVENT_NAMES = {
    0: "finite gradients",
    1: "an inf gradient",
    2: "a -inf gradient",
    3: "a NaN gradient",
}


def _events(steps: int, marks: dict[int, int]) -> list[int]:
    return [marks.get(i, 0) for i in range(steps)]


def _factors(gen: torch.Generator) -> dict:
    """Growth and backoff factors other than GradScaler's defaults (2.0, 0.5), so that a
    scaler that ignores its arguments fails; powers of two, so that every scale and every
    unscaled gradient is exact (bit for bit is then fair to any order of operations)."""
    return {
        "growth_factor": 2.0 ** randint(gen, 2, 3),
        "backoff_factor": 2.0 ** -randint(gen, 2, 3),
    }


def _case(gen: torch.Generator, interval: int) -> dict:
    dims = (randint(gen, 4, 7), randint(gen, 5, 9), 3)
    if interval == 1:
        steps, first = 10, randint(gen, 1, 3)
        marks = {first: 1, first + 1: 2, first + randint(gen, 3, 5): 3}
        explicit = [first + 1, randint(gen, 0, steps - 1)]
        scaler = {**_factors(gen), "growth_interval": 1}
        optimizer = {"name": "sgd", "lr": uniform(gen, 0.05, 0.2), "momentum": 0.9}
    else:
        steps = 3 * interval + 6
        first = interval + randint(gen, 1, interval - 1)  # an overflow mid-interval
        nan = first + randint(gen, 1, interval)
        marks = {first: randint(gen, 1, 2), nan: 3}
        explicit = [nan, randint(gen, 0, steps - 1)]
        scaler = {**_factors(gen), "growth_interval": interval}
        optimizer = {"name": "adam", "lr": uniform(gen, 0.005, 0.02)}
    batch = randint(gen, 3, 6)
    return {
        "init": random_state(dims, gen),
        "xs": [torch.randn(batch, dims[0], generator=gen) for _ in range(steps)],
        "ys": [torch.randint(0, dims[2], (batch,), generator=gen) for _ in range(steps)],
        "events": _events(steps, marks),
        "where": [randint(gen, 0, dims[1] - 1), randint(gen, 0, dims[0] - 1)],
        "explicit_unscale": sorted(set(explicit)),
        "scaler": {"init_scale": 2.0 ** randint(gen, 8, 16), **scaler},
        "optimizer": optimizer,
    }


def make_inputs(gen: torch.Generator) -> dict:
    """Two runs: growth interval 1 (SGD + momentum), and 2 to 4 (Adam); growth factors 4
    or 8, backoff factors 1/4 or 1/8."""
    return {"cases": [_case(gen, 1), _case(gen, randint(gen, 2, 4))]}


def visible_inputs(gen: torch.Generator) -> dict:
    """Growth interval 1, then 2."""
    return {"cases": [_case(gen, 1), _case(gen, 2)]}


def _optimizer(model: torch.nn.Module, spec: dict) -> torch.optim.Optimizer:
    if spec["name"] == "adam":
        return torch.optim.Adam(model.parameters(), lr=spec["lr"])
    return torch.optim.SGD(model.parameters(), lr=spec["lr"], momentum=spec["momentum"])


def drive(scaler, case: dict) -> dict:
    """Train with ``scaler`` (the student's or torch's) exactly as the exercise describes.

    Returns:
        ``{"initial": scale before the first step, "scaled": [scale(loss) per step],
        "scales": [scale after update() per step], "weights": [parameters after each step],
        "not_float": "" or what the first get_scale() that gave no Python float gave}``.
    """
    model = net(case["init"])
    optimizer = _optimizer(model, case["optimizer"])
    out = {"not_float": "", "scaled": [], "scales": [], "weights": []}

    def get_scale() -> float:
        value = scaler.get_scale()
        if not isinstance(value, float) and not out["not_float"]:
            out["not_float"] = kind(value)
        return number(value)

    out["initial"] = get_scale()
    row, col = case["where"]
    for i, (x, y) in enumerate(zip(case["xs"], case["ys"], strict=True)):
        optimizer.zero_grad(set_to_none=True)
        scaled = scaler.scale(F.cross_entropy(model(x), y))
        out["scaled"].append(plain(scaled))
        scaled.backward()
        forced = EVENTS[case["events"][i]]
        if forced is not None:
            with torch.no_grad():
                model.hidden.weight.grad[row, col] = forced
        if i in case["explicit_unscale"]:
            scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
        out["scales"].append(get_scale())
        out["weights"].append(state(model))
    return out


def run(ns: dict, inputs: dict, workdir: Path | None) -> dict:
    """Drive the student's ``LossScaler`` through every case."""
    cls = ns["LossScaler"]
    return {"runs": [drive(cls(**case["scaler"]), case) for case in inputs["cases"]]}


def oracle(case: dict) -> dict:
    """The same run with ``torch.amp.GradScaler("cpu", ...)``."""
    return drive(torch.amp.GradScaler("cpu", **case["scaler"]), case)


def describe(case: dict) -> str:
    """How feedback names a run."""
    s = case["scaler"]
    return (
        f"LossScaler(init_scale={s['init_scale']:g}, growth_factor={s['growth_factor']:g}, "
        f"backoff_factor={s['backoff_factor']:g}, growth_interval={s['growth_interval']})"
    )


def _step_text(case: dict, i: int) -> str:
    how = " (unscale_ called before step)" if i in case["explicit_unscale"] else ""
    return f"step {i} ({EVENT_NAMES[case['events'][i]]}{how})"


def first_problem(case: dict, got: dict, want: dict) -> str | None:
    """The first step at which the student's run leaves torch's, said in one line."""
    what = describe(case)
    if got.get("initial") != want["initial"]:
        return f"{what}: get_scale() before the first step should be {want['initial']:g}"
    for i in range(len(want["scales"])):
        step = _step_text(case, i)
        scaled = got["scaled"][i] if i < len(got.get("scaled", [])) else None
        if not (isinstance(scaled, torch.Tensor) and torch.equal(scaled, want["scaled"][i])):
            return (
                f"{what}, {step}: scale(loss) returned {scaled!r:.60}, expected "
                f"{float(want['scaled'][i]):.6g} (the loss times the current scale)"
            )
        weights = got["weights"][i] if i < len(got.get("weights", [])) else None
        if not same_bits(weights, want["weights"][i]):
            before = case["init"] if i == 0 else want["weights"][i - 1]
            skipped = case["events"][i] != 0
            if skipped:
                hint = (
                    "the weights changed although the gradients were not finite: skip "
                    "optimizer.step() when any gradient holds an inf or a NaN"
                )
            elif same_bits(weights, before):
                hint = "the step was skipped although every gradient was finite"
            else:
                hint = (
                    f"max abs difference {max_diff(weights, want['weights'][i]):.3g}: the "
                    "optimizer must see the gradients divided by the scale exactly once"
                )
            return f"{what}, {step}: the weights differ from torch.amp.GradScaler's: {hint}"
        scale = got["scales"][i] if i < len(got.get("scales", [])) else math.nan
        if scale != want["scales"][i]:
            before = want["scales"][i - 1] if i else want["initial"]
            return (
                f"{what}, {step}: the scale after update() should be {want['scales'][i]:g} "
                f"(it was {before:g} before), got {scale:g}"
            )
    if got.get("not_float", "<missing>"):  # right values: now the type the docstring promises
        return (
            f"{what}: get_scale() returned {got.get('not_float', 'nothing recorded')}; the "
            "docstring promises a Python float (keep the scale as a float, or return float(...))"
        )
    return None


def judge(inputs: dict, outputs: dict) -> str:
    """Every run against the same run with ``torch.amp.GradScaler``."""
    runs = outputs.get("runs")
    if not isinstance(runs, list) or len(runs) != len(inputs["cases"]):
        raise CheckFailed("LossScaler: expected one run per case")
    for case, got in zip(inputs["cases"], runs, strict=True):
        if why := first_problem(case, got, oracle(case)):
            raise CheckFailed(why)
    steps = sum(len(c["events"]) for c in inputs["cases"])
    skips = sum(e != 0 for c in inputs["cases"] for e in c["events"])
    intervals = " and ".join(str(c["scaler"]["growth_interval"]) for c in inputs["cases"])
    return (
        f"LossScaler follows torch.amp.GradScaler bit for bit over {steps} steps ({skips} "
        f"skipped on inf/NaN; growth intervals {intervals})"
    )


EXERCISE = Exercise(
    "test_ex2_loss_scaler",
    ("ex2_loss_scaler",),
    "a dynamic loss scaler equal to GradScaler",
    make_inputs,
    judge,
    run=run,
    timeout=60,
    visible_inputs=visible_inputs,
)
