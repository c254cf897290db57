"""Exercise 4, part 2: ``fit_alpha_beta(sizes, seconds, world_size) -> (alpha, bandwidth)``.

The kit does not hold the cost model, so the times a fit must recover are made, in the
student's process, with the student's own ``ring_time`` (*model cases*: an ``alpha``, a ``B``,
sizes and noise factors; the run multiplies ``ring_time(sizes, n, alpha, B)`` by the noise).
The grader adds *measured cases*: times of the exact model with 3% noise
(``ddp_lab.answers``), which it compares with the reference fit. The kit's judge checks what
holds whatever the model:

- the result is a pair of finite numbers with a positive bandwidth;
- the fit has the model's units: times twice as long give twice ``alpha`` and half ``B``,
  sizes twice as large give twice ``B`` and the same ``alpha``; the order of the
  measurements does not matter;
- exact times of a model case are recovered (``alpha`` and ``B``);
- for noisy times of a model case (the run saves each time's derivative by ``alpha`` and by
  ``1/B``, the *columns*), the fitted pair minimises the sum of squared *relative* errors: the
  relative errors left are uncorrelated with both columns.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ddp_lab.checks.failure import CheckFailed
from ddp_lab.checks.values import log_uniform, randint

#: Relative tolerance of the unit properties and of an exact recovery.
RTOL = 1e-6
#: Largest correlation of the relative errors with a column of the model at a best fit.
MAX_CORRELATION = 1e-6


def sizes(gen: torch.Generator, points: int) -> np.ndarray:
    """``points`` sorted message sizes from 128 B to 256 MB, log-uniform."""
    return np.sort([round(log_uniform(gen, 2.0**7, 2.0**28)) for _ in range(points)])


def noise(gen: torch.Generator, points: int, level: float) -> np.ndarray:
    """Relative noise factors ``1 + level * randn``."""
    return 1 + level * torch.randn(points, generator=gen, dtype=torch.float64).numpy()


def _tensor(v) -> torch.Tensor:
    return torch.as_tensor(np.asarray(v, dtype=np.float64))


def model_case(gen: torch.Generator, n: int, points: int, level: float) -> dict:
    """A case whose times the run makes with the student's ``ring_time``."""
    s = sizes(gen, points)
    alpha, bandwidth = log_uniform(gen, 2e-6, 1e-4), log_uniform(gen, 1e8, 2e10)
    return {
        "sizes": _tensor(s),
        "n": n,
        "alpha": alpha,
        "bandwidth": bandwidth,
        "noise": _tensor(noise(gen, points, level)),
    }


def make_cases(gen: torch.Generator) -> list[dict]:
    """Model cases: exact times on 3 to 8 ranks, 3% noise on 16 ranks and on 2."""
    return [
        model_case(gen, randint(gen, 3, 8), 14, 0.0),
        model_case(gen, 16, 14, 0.03),
        model_case(gen, 2, 10, 0.03),
    ]


def visible_cases() -> list[dict]:
    """Model cases from a fixed seed: exact times on 4 ranks, 2% noise on 4 and on 2."""
    gen = torch.Generator().manual_seed(2)
    return [model_case(gen, 4, 12, 0.0), model_case(gen, 4, 12, 0.02), model_case(gen, 2, 12, 0.02)]


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


def _model(time_fn, s: np.ndarray, n: int, alpha: float, bandwidth: float) -> np.ndarray:
    return np.asarray(time_fn(s.copy(), n, alpha, bandwidth), dtype=np.float64).reshape(-1)


def run_fits(fit_fn, time_fn, cases: list[dict]) -> list[dict]:
    """The student's fit on each case, on twice the times, twice the sizes, reversed order
    (student process). Model cases get their times (and columns) from ``time_fn``."""
    out = []
    for case in cases:
        s, n = case["sizes"].numpy(), case["n"]
        one: dict = {}
        if "seconds" in case:
            t = case["seconds"].numpy()
        else:
            t = _model(time_fn, s, n, case["alpha"], case["bandwidth"]) * case["noise"].numpy()
            columns = np.stack(
                [_model(time_fn, s, n, 1.0, math.inf), _model(time_fn, s, n, 0.0, 1.0)]
            )
            one |= {"seconds": _tensor(t), "columns": _tensor(columns.T)}
        one |= {
            "fit": _pair(fit_fn(s.copy(), t.copy(), n)),
            "times_x2": _pair(fit_fn(s.copy(), 2 * t, n)),
            "sizes_x2": _pair(fit_fn(2 * s, t.copy(), n)),
            "reversed": _pair(fit_fn(s[::-1].copy(), t[::-1].copy(), n)),
        }
        out.append(one)
    return out


def numbers(got, what: str) -> tuple[float, float]:
    """A fit's ``(alpha, bandwidth)``, or :class:`CheckFailed`."""
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


def _seconds_of(case: dict, got: dict) -> np.ndarray:
    t = case["seconds"] if "seconds" in case else got.get("seconds")
    if not isinstance(t, torch.Tensor) or t.numel() != case["sizes"].numel():
        raise CheckFailed("fit_alpha_beta: the times made with your ring_time are missing")
    return t.double().numpy()


def check_fit(case: dict, got: dict) -> None:
    """The fit's properties on one case (see the module docstring)."""
    s, n = case["sizes"].numpy(), case["n"]
    t = _seconds_of(case, got)
    where = f"n = {n}, {s.size} sizes"
    alpha, bw = numbers(got["fit"], f"fit_alpha_beta ({where})")
    scale = float(np.min(np.abs(t)))  # alpha is measured against the shortest time
    units = [
        ("times_x2", "times twice as long", (2 * alpha, bw / 2)),
        ("sizes_x2", "sizes twice as large", (alpha, 2 * bw)),
        ("reversed", "the measurements in reverse order", (alpha, bw)),
    ]
    for key, change, (want_alpha, want_bw) in units:
        a, b = numbers(got[key], f"fit_alpha_beta with {change} ({where})")
        if not (_same(a, want_alpha, scale) and _same(b, want_bw)):
            raise CheckFailed(
                f"{where}: you fitted alpha = {alpha:.4g} s, B = {bw:.4g} B/s; with {change} "
                f"expected alpha = {want_alpha:.4g} s, B = {want_bw:.4g} B/s, got {a:.4g} s, "
                f"{b:.4g} B/s (is the pair (alpha, bandwidth), in seconds and bytes/s?)"
            )
    if "noise" not in case:
        return
    if bool((case["noise"] == 1).all()):
        if not (_same(alpha, case["alpha"]) and _same(bw, case["bandwidth"])):
            raise CheckFailed(
                f"{where}, times made exactly by your ring_time with alpha = {case['alpha']:.4g} "
                f"s and B = {case['bandwidth']:.4g} B/s: the fit gave alpha = {alpha:.4g} s, "
                f"B = {bw:.4g} B/s"
            )
        return
    columns = got["columns"].double().numpy() / t[:, None]
    errors = columns @ np.array([alpha, 1 / bw]) - 1
    norm = float(np.linalg.norm(errors))
    correlation = max(
        abs(float(c @ errors)) / (float(np.linalg.norm(c)) * norm) if norm else 0.0
        for c in columns.T
    )
    if correlation > MAX_CORRELATION:
        raise CheckFailed(
            f"{where}, noisy times of your ring_time: alpha = {alpha:.4g} s, B = {bw:.4g} B/s "
            "do not minimise the sum of squared relative errors (model - T_i) / T_i: at the "
            "best fit these errors are uncorrelated with both columns of the model, here a "
            f"correlation of {correlation:.2g} is left"
        )


def judge_fits(cases: list[dict], fits) -> None:
    """The fit's properties on every case."""
    if not isinstance(fits, list) or len(fits) != len(cases):
        raise CheckFailed(f"fit_alpha_beta: expected {len(cases)} fits, got a different number")
    for case, got in zip(cases, fits, strict=True):
        check_fit(case, got)
