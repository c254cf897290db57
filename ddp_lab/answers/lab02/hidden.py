"""What the grader adds to lab 2's kit judges: exact comparisons and the typical mistakes'
diagnoses (instructor only).

- ring all-reduce: a wrong chunk is explained with the ring's schedule;
- the parameter servers: the kit's oracle is already the exact trajectory (nothing to add);
- the cost model: ``ring_time`` and ``server_time`` must equal the exact alpha-beta formulas
  (relative 1e-6), and a wrong one is told which factor is missing; the fit gets two more
  cases, synthetic times of the exact model (3% noise, 3 to 8 ranks and 16), where it must
  equal the reference least squares on relative errors (relative 1e-3), and a wrong fit is
  named (absolute errors, a missing factor, ...).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ddp_lab.answers import Hidden
from ddp_lab.answers.lab02.references import fit_alpha_beta as reference_fit
from ddp_lab.answers.lab02.references import ring_allreduce_time, server_step_time
from ddp_lab.checks.failure import CheckFailed
from ddp_lab.checks.lab02 import ex1_ring_all_reduce, ex4_cost_model
from ddp_lab.checks.values import log_uniform, randint

RING_SCHEDULE = (
    "Each phase needs n - 1 steps; in step s of the reduce-scatter rank r sends chunk "
    "(r - s) % n and adds into chunk (r - s - 1) % n. A ring that skips a step leaves partial "
    "sums"
)


# --------------------------------------------------------------------------- the ring


def ring_explain(inputs: dict, outputs: dict) -> str | None:
    """The kit's message about wrong chunks, with the schedule that fills them."""
    try:
        ex1_ring_all_reduce.EXERCISE.judge(inputs, outputs)
    except CheckFailed as err:
        if "wrong in chunk(s)" in str(err):
            return f"{err}. {RING_SCHEDULE}"
    except (KeyError, TypeError, ValueError):  # malformed outputs: the kit's message stays
        pass
    return None


# --------------------------------------------------------------------------- the two models


def _ring_hints(sizes, n, alpha, bandwidth):
    steps = 2 * (n - 1)
    return [
        (sizes / bandwidth + steps * alpha, "the bandwidth term needs the factor 2(n - 1)/n"),
        (steps / n * sizes / bandwidth + alpha, "every one of the 2(n - 1) steps pays alpha"),
        (steps / n * sizes / bandwidth, "the latency term 2(n - 1) * alpha is missing"),
        (steps * alpha + 8 * steps / n * sizes / bandwidth, "sizes and B are both in bytes"),
    ]


def _server_hints(sizes, n, alpha, bandwidth):
    return [
        (
            (n - 1) * (alpha + sizes / bandwidth),
            "the parameters go back to every worker too: 2(n - 1) messages through the link",
        ),
        (
            2 * (n - 1) * alpha + 2 * (n - 1) / n * sizes / bandwidth,
            "that is the ring's cost: through the server's one link every message travels "
            "whole, one after the other",
        ),
        (
            2 * (n - 1) * alpha + 2 * sizes / bandwidth,
            "each worker's gradient and each copy of the parameters crosses the server's link: "
            "the bandwidth term grows with n",
        ),
        (2 * alpha + 2 * (n - 1) * sizes / bandwidth, "each of the 2(n - 1) messages pays alpha"),
    ]


MODELS = {
    "ring_time": (ring_allreduce_time, _ring_hints, "T = 2(n - 1) * alpha + 2(n - 1)/n * S / B"),
    "server_time": (server_step_time, _server_hints, "T = 2(n - 1) * (alpha + S / B)"),
}


def time_problem(name: str, got, case: dict) -> str | None:
    """What is wrong with one case's ``ring_time`` / ``server_time`` result, or None."""
    reference, hints, formula = MODELS[name]
    sizes, n = case["sizes"].numpy(), case["n"]
    alpha, bandwidth = case["alpha"], case["bandwidth"]
    if got is None:
        return f"{name} returned None: return the predicted time"
    if not isinstance(got, torch.Tensor):
        return f"{name}: expected a number or an array of seconds, got {got}"
    want = np.atleast_1d(reference(sizes, n, alpha, bandwidth))
    got = got.double().numpy()
    if got.shape != want.shape:
        return f"{name}: expected {want.size} time(s), one per size, got {got.size}"
    if np.allclose(got, want, rtol=1e-6, atol=0):
        return None
    where = f"n = {n}, alpha = {alpha:.3g} s, B = {bandwidth:.3g} B/s, S = {sizes[0]:.4g} B"
    said = f"{name}, {where}: expected {want[0]:.6g} s, got {got[0]:.6g} s"
    if n > 1:
        for wrong, hint in hints(sizes, n, alpha, bandwidth):
            if np.allclose(got, np.atleast_1d(wrong), rtol=1e-6, atol=0):
                return f"{said}: {hint}"
    return f"{said}: {formula}"


def _time_problems(inputs: dict, outputs: dict):
    for name in MODELS:
        for case, got in zip(inputs["times"], outputs[name], strict=True):
            if why := time_problem(name, got["times"], case):
                yield why


# --------------------------------------------------------------------------- fit_alpha_beta


def synthetic_times(gen: torch.Generator, n: int, points: int, noise: float):
    """Times of the exact model: ``(sizes, seconds, alpha, bandwidth)``, relative noise."""
    alpha, bandwidth = log_uniform(gen, 2e-6, 1e-4), log_uniform(gen, 1e8, 2e10)
    sizes = np.sort([round(log_uniform(gen, 2.0**7, 2.0**28)) for _ in range(points)])
    factor = 1 + noise * torch.randn(points, generator=gen, dtype=torch.float64).numpy()
    return sizes, ring_allreduce_time(sizes, n, alpha, bandwidth) * factor, alpha, bandwidth


def measured_cases(gen: torch.Generator) -> list[dict]:
    """Two cases of the exact model's times: 14 sizes, 3% noise, on 3 to 8 ranks and on 16
    (more than 2, so that the factor 2(n - 1)/n matters)."""
    cases = []
    for n in (randint(gen, 3, 8), 16):
        sizes, seconds, _, _ = synthetic_times(gen, n, 14, 0.03)
        cases.append(
            {"sizes": torch.from_numpy(sizes), "seconds": torch.from_numpy(seconds), "n": n}
        )
    return cases


def cost_inputs(gen: torch.Generator) -> dict:
    """The kit's case set, plus :func:`measured_cases` for the fit."""
    inputs = ex4_cost_model.make_inputs(gen)
    inputs["fits"] += measured_cases(gen)
    return inputs


def fit_problem(got, sizes: np.ndarray, seconds: np.ndarray, n: int) -> str | None:
    """What is wrong with a ``fit_alpha_beta`` result, or None (it matches the reference)."""
    if not isinstance(got, list) or len(got) != 2:
        return f"expected a pair (alpha, bandwidth), got {str(got).strip('<>')}"
    alpha, bandwidth = got
    ref_alpha, ref_bw = reference_fit(sizes, seconds, n, relative=True)

    def same(a: float, b: float) -> bool:
        return math.isfinite(a) and abs(a - b) <= 1e-3 * abs(b)

    if same(alpha, ref_alpha) and same(bandwidth, ref_bw):
        return None
    said = (
        f"n = {n}, {len(sizes)} sizes: expected alpha = {ref_alpha:.4g} s and B = "
        f"{ref_bw:.4g} B/s, got alpha = {alpha:.4g} s and B = {bandwidth:.4g} B/s"
    )
    abs_alpha, abs_bw = reference_fit(sizes, seconds, n, relative=False)
    if same(alpha, abs_alpha) and same(bandwidth, abs_bw):
        return f"{said}: you minimised absolute errors; divide each equation by its time"
    if same(alpha, ref_bw) and same(bandwidth, ref_alpha):
        return f"{said}: return (alpha, bandwidth), in that order"
    if same(bandwidth * 2 * (n - 1) / n, ref_bw):
        return f"{said}: the bandwidth term needs the factor 2(n - 1)/n"
    if same(alpha / (2 * (n - 1)), ref_alpha):
        return f"{said}: alpha is paid 2(n - 1) times; the unknown is alpha itself"
    if same(bandwidth, 1 / ref_bw):
        return f"{said}: the fit gives 1/B; return B"
    return f"{said}: fit 2(n - 1) * alpha + 2(n - 1)/n * S * (1/B) = T, each row divided by T"


def _fit_problems(inputs: dict, outputs: dict):
    for case, got in zip(inputs["fits"], outputs["fits"], strict=True):
        if "noise" in case:  # times of the student's own ring_time: the kit's judge decides
            continue
        sizes, seconds = case["sizes"].numpy(), case["seconds"].numpy()
        if why := fit_problem(got["fit"], sizes, seconds, case["n"]):
            yield why


def _problems(inputs: dict, outputs: dict):
    yield from _time_problems(inputs, outputs)
    yield from _fit_problems(inputs, outputs)


def cost_check(inputs: dict, outputs: dict) -> None:
    """The exact formulas on every case, the reference fit on the measured cases."""
    if why := next(_problems(inputs, outputs), None):
        raise CheckFailed(why)


def cost_explain(inputs: dict, outputs: dict) -> str | None:
    """The first formula or fit that is wrong, with the hint that names the mistake."""
    try:
        return next(_problems(inputs, outputs), None)
    except (KeyError, TypeError, ValueError):  # malformed outputs: the kit's message stays
        return None


HIDDEN = {
    "test_ex1_ring_all_reduce": Hidden(explain=ring_explain),
    "test_ex4_cost_model": Hidden(inputs=cost_inputs, check=cost_check, explain=cost_explain),
}
