"""Exercise 4: ``fit_alpha_beta(sizes, seconds, world_size) -> (alpha, bandwidth)``.

Drawing times that a right fit must recover needs the exact cost model, which the kit does
not hold: the graded case set comes from the grader (``ddp_lab.answers``), and the visible
check makes its times with the student's own ``ring_time`` (:func:`inputs_from_model`). The
kit's judge checks what holds whatever the model:

- the result is a pair of finite numbers with a positive bandwidth;
- the fit has the model's units: times twice as long give twice ``alpha`` and half ``B``,
  sizes twice as large give twice ``B`` and the same ``alpha``; the order of the
  measurements does not matter;
- times made exactly by a model (``"alpha"`` and ``"bandwidth"`` in the case) are recovered;
- for noisy times of a known model (``"columns"``: each time's derivative by ``alpha`` and by
  ``1/B``), the fitted pair minimises the sum of squared *relative* errors: the relative
  errors left are uncorrelated with both columns.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from ddp_lab.checks.contract import Exercise
from ddp_lab.checks.failure import CheckFailed
from ddp_lab.checks.values import log_uniform, randint

#: Relative tolerance of the unit properties and of an exact recovery.
RTOL = 1e-6
#: Largest correlation of the relative errors with a column of the model at a best fit.
MAX_CORRELATION = 1e-6


def _sizes(gen: torch.Generator, points: int) -> np.ndarray:
    return np.sort([round(log_uniform(gen, 2.0**7, 2.0**28)) for _ in range(points)])


def _noise(gen: torch.Generator, points: int, level: float) -> np.ndarray:
    return 1 + level * torch.randn(points, generator=gen, dtype=torch.float64).numpy()


def _case(sizes, seconds, n: int, **extra) -> dict:
    as_tensor = lambda v: torch.as_tensor(np.asarray(v, dtype=np.float64))  # noqa: E731
    return {"sizes": as_tensor(sizes), "seconds": as_tensor(seconds), "n": n} | {
        k: as_tensor(v) if k == "columns" else v for k, v in extra.items()
    }


def make_inputs(gen: torch.Generator) -> dict:
    """What the kit can draw without the cost model: noisy times that grow affinely with the
    size (14 sizes from 128 B to 256 MB, on 3 to 8 ranks and on 16). The grader draws times
    from the exact model instead."""
    cases = []
    for n in (randint(gen, 3, 8), 16):
        sizes = _sizes(gen, 14)
        fixed, per_byte = log_uniform(gen, 1e-5, 1e-3), 1 / log_uniform(gen, 1e8, 2e10)
        cases.append(_case(sizes, (fixed + per_byte * sizes) * _noise(gen, 14, 0.03), n))
    return {"cases": cases}


def inputs_from_model(time_fn: Callable, seed: int = 2) -> dict:
    """The visible check's cases, made with ``time_fn(size, n, alpha, bandwidth)`` (your
    ``ring_time``): exact times on 4 ranks (recovered?), then times with 2% noise on 4 and on
    2 ranks (relative errors minimised?)."""
    gen = torch.Generator().manual_seed(seed)
    cases = []
    for n, noise in ((4, 0.0), (4, 0.02), (2, 0.02)):
        sizes = _sizes(gen, 12)
        alpha, bandwidth = log_uniform(gen, 2e-6, 1e-4), log_uniform(gen, 1e8, 2e10)

        def model(a: float, b: float, sizes=sizes, n=n) -> np.ndarray:
            return np.asarray(time_fn(sizes.copy(), n, a, b), dtype=np.float64).reshape(-1)

        seconds = model(alpha, bandwidth) * _noise(gen, sizes.size, noise)
        if noise == 0:
            cases.append(_case(sizes, seconds, n, alpha=alpha, bandwidth=bandwidth))
        else:
            columns = np.stack([model(1.0, math.inf), model(0.0, 1.0)], axis=1)
            cases.append(_case(sizes, seconds, n, columns=columns))
    return {"cases": cases}


def _pair(value):
    """A returned ``(alpha, bandwidth)`` as two floats, or a tag saying what it was."""
    if isinstance(value, (tuple, list, np.ndarray, torch.Tensor)) and len(value) == 2:
        try:
            return [float(v) for v in value]
        except (TypeError, ValueError):
            return f"<pair of {type(value[0]).__name__}>"
    if isinstance(value, (tuple, list)):
        return f"<{len(value)} values>"
    return f"<{type(value).__name__}>"


def run(ns: dict, inputs: dict, workdir: Path) -> dict:
    """The student's fit on each case, on twice the times, twice the sizes, reversed order."""
    fn = ns["fit_alpha_beta"]
    out = []
    for case in inputs["cases"]:
        s, t, n = case["sizes"].numpy(), case["seconds"].numpy(), case["n"]
        out.append(
            {
                "fit": _pair(fn(s.copy(), t.copy(), n)),
                "times_x2": _pair(fn(s.copy(), 2 * t, n)),
                "sizes_x2": _pair(fn(2 * s, t.copy(), n)),
                "reversed": _pair(fn(s[::-1].copy(), t[::-1].copy(), n)),
            }
        )
    return {"fits": out}


def _numbers(got, what: str) -> tuple[float, float]:
    if not isinstance(got, list):
        tag = str(got).strip("<>")
        raise CheckFailed(f"{what}: expected a pair (alpha, bandwidth) of numbers, got {tag}")
    alpha, bandwidth = got
    if not (math.isfinite(alpha) and math.isfinite(bandwidth) and bandwidth > 0):
        raise CheckFailed(
            f"{what} gave alpha = {alpha:.4g} s, B = {bandwidth:.4g} B/s: expected finite "
            "numbers and a positive bandwidth (the times grow with the size)"
        )
    return alpha, bandwidth


def _same(got: float, want: float, scale: float = 0.0) -> bool:
    return abs(got - want) <= RTOL * (abs(want) + scale)


def _check_case(case: dict, got: dict) -> None:
    s, t, n = case["sizes"].numpy(), case["seconds"].numpy(), case["n"]
    where = f"n = {n}, {s.size} sizes"
    alpha, bw = _numbers(got["fit"], f"fit_alpha_beta ({where})")
    scale = float(t.min())  # alpha is measured against the shortest time
    units = [
        ("times_x2", "times twice as long", (2 * alpha, bw / 2)),
        ("sizes_x2", "sizes twice as large", (alpha, 2 * bw)),
        ("reversed", "the measurements in reverse order", (alpha, bw)),
    ]
    for key, change, (want_alpha, want_bw) in units:
        a, b = _numbers(got[key], f"fit_alpha_beta with {change} ({where})")
        if not (_same(a, want_alpha, scale) and _same(b, want_bw)):
            raise CheckFailed(
                f"{where}: you fitted alpha = {alpha:.4g} s, B = {bw:.4g} B/s; with {change} "
                f"expected alpha = {want_alpha:.4g} s, B = {want_bw:.4g} B/s, got {a:.4g} s, "
                f"{b:.4g} B/s (is the pair (alpha, bandwidth), in seconds and bytes/s?)"
            )
    if "alpha" in case:
        if not (_same(alpha, case["alpha"]) and _same(bw, case["bandwidth"])):
            raise CheckFailed(
                f"{where}, times made exactly by your ring_time with alpha = {case['alpha']:.4g} "
                f"s and B = {case['bandwidth']:.4g} B/s: the fit gave alpha = {alpha:.4g} s, "
                f"B = {bw:.4g} B/s"
            )
    if "columns" in case:
        columns = case["columns"].numpy() / t[:, None]
        errors = columns @ np.array([alpha, 1 / bw]) - 1
        norm = float(np.linalg.norm(errors))
        correlation = max(
            abs(float(c @ errors)) / (float(np.linalg.norm(c)) * norm) if norm else 0.0
            for c in columns.T
        )
        if correlation > MAX_CORRELATION:
            raise CheckFailed(
                f"{where}, noisy times of a known model: alpha = {alpha:.4g} s, B = {bw:.4g} "
                "B/s do not minimise the sum of squared relative errors (model - T_i) / T_i: "
                "at the best fit these errors are uncorrelated with both columns of the model, "
                f"here a correlation of {correlation:.2g} is left"
            )


def judge(inputs: dict, outputs: dict) -> str:
    """Check the properties of the module docstring on every case."""
    fits = outputs.get("fits", []) if isinstance(outputs, dict) else []
    if len(fits) != len(inputs["cases"]):
        raise CheckFailed(f"expected {len(inputs['cases'])} fits, got {len(fits)}")
    for case, got in zip(inputs["cases"], fits, strict=True):
        _check_case(case, got)
    worlds = " and ".join(str(c["n"]) for c in inputs["cases"])
    message = (
        "fit_alpha_beta gives a pair (alpha, B) in seconds and bytes/s, independent of the "
        f"order of the measurements (n = {worlds})"
    )
    if any("alpha" in c for c in inputs["cases"]):
        message += "; exact times recovered"
    if any("columns" in c for c in inputs["cases"]):
        message += "; relative errors minimised on noisy times"
    return message


EXERCISE = Exercise(
    "test_ex4_fit_alpha_beta",
    ("ex4_fit_alpha_beta",),
    "fit alpha and B to measured times",
    make_inputs,
    judge,
    run=run,
)
