"""Exercise 3: ``ring_time(size_bytes, world_size, alpha, bandwidth)``, the alpha-beta model
of a ring all-reduce.

The kit's judge checks **properties** that any sound cost model of a ring all-reduce has, on
the student's own function probed around each case:

- one rank has nothing to send: 0 s;
- an empty message costs the latency part alone, positive and proportional to ``alpha``;
- the time is affine in the size: the latency part plus a bandwidth part that is
  proportional to the size, independent of ``alpha`` and inversely proportional to ``B``;
- each rank sends and receives less than twice the message: the cost per byte is below
  ``2 / B``;
- more ranks mean more steps and a larger share of the message per rank: both the latency
  part and the cost per byte grow with ``n``.

The exact formula, and the hints that name a missing factor, are the grader's
(``ddp_lab.answers``).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from ddp_lab.checks.contract import Exercise
from ddp_lab.checks.failure import CheckFailed
from ddp_lab.checks.values import kind, log_uniform, randint, uniform

#: Relative tolerance of the properties (they hold to rounding).
RTOL = 1e-9


def _case(sizes, n: int, alpha: float, bandwidth: float) -> dict:
    sizes = torch.as_tensor(np.asarray(sizes, dtype=np.float64).reshape(-1))
    return {"sizes": sizes, "n": n, "alpha": alpha, "bandwidth": bandwidth}


def make_inputs(gen: torch.Generator) -> dict:
    """Four cases: 9 sizes on 3 to 64 ranks, 5 on 2 ranks, one size (a number) on 3 to 64
    ranks, 3 sizes on one rank; sizes from 55 B to 3.6 GB, alpha 1 to 100 us, B 0.1 to 100
    GB/s."""

    def draw(n: int, k: int) -> dict:
        sizes = [round(log_uniform(gen, math.exp(4), math.exp(22))) for _ in range(k)]
        return _case(sizes, n, uniform(gen, 1e-6, 1e-4), uniform(gen, 1e8, 1e11))

    n1, n2 = randint(gen, 3, 64), randint(gen, 3, 64)
    return {"cases": [draw(n1, 9), draw(2, 5), draw(n2, 1), draw(1, 3)]}


def visible_inputs(gen: torch.Generator) -> dict:
    """Fixed cases: 1 KB, 1 MB and 1 GB on 4 and 2 ranks, 500 MB (a number) on 8, one rank."""
    sizes = [1e3, 1e6, 1e9]
    return {
        "cases": [
            _case(sizes, 4, 1e-5, 1e10),
            _case(sizes, 2, 3e-5, 2e9),
            _case([5e8], 8, 2e-6, 5e10),
            _case([1e6], 1, 1e-5, 1e10),
        ]
    }


def _seconds(value):
    """What ``ring_time`` returned as a 1-D float64 tensor (None, or a tag when not numbers)."""
    if value is None:
        return None
    try:
        array = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        return f"<{type(value).__name__}>"
    return torch.as_tensor(array).reshape(-1).clone()


def run(ns: dict, inputs: dict, workdir: Path) -> dict:
    """Call the student's ``ring_time`` on each case, and around it (the probes)."""
    fn = ns["ring_time"]
    out = []
    for case in inputs["cases"]:
        sizes = case["sizes"].numpy()
        n, alpha, bw = case["n"], case["alpha"], case["bandwidth"]

        def size_arg(sizes=sizes):  # a number when the case has one size, else a fresh array
            return float(sizes[0]) if sizes.size == 1 else sizes.copy()

        out.append(
            {
                "times": _seconds(fn(size_arg(), n, alpha, bw)),
                "latency": _seconds(fn(0.0, n, alpha, bw)),
                "latency_2alpha": _seconds(fn(0.0, n, 2 * alpha, bw)),
                "latency_more": _seconds(fn(0.0, n + 1, alpha, bw)),
                "bytes": _seconds(fn(size_arg(), n, 0.0, bw)),
                "bytes_2bandwidth": _seconds(fn(size_arg(), n, 0.0, 2 * bw)),
                "bytes_more": _seconds(fn(size_arg(), n + 1, 0.0, bw)),
            }
        )
    return {"cases": out}


def _values(got, count: int, what: str) -> np.ndarray:
    if got is None:
        raise CheckFailed(f"{what} returned None: return the predicted time")
    if not isinstance(got, torch.Tensor):
        raise CheckFailed(f"{what}: expected a number or an array of seconds, got {kind(got)}")
    if got.numel() != count:
        raise CheckFailed(f"{what}: expected {count} time(s), one per size, got {got.numel()}")
    values = got.double().numpy()
    if not np.all(np.isfinite(values)):
        raise CheckFailed(f"{what}: got {values[:3]} (not finite)")
    return values


def _close(a, b) -> bool:
    return bool(np.all(np.abs(np.asarray(a) - np.asarray(b)) <= RTOL * np.abs(b)))


def _check_case(case: dict, got: dict) -> None:
    sizes = case["sizes"].numpy()
    n, alpha, bw = case["n"], case["alpha"], case["bandwidth"]
    k = sizes.size
    call = f"ring_time(S, {n}, alpha={alpha:.3g}, bandwidth={bw:.3g})"
    times = _values(got["times"], k, call)
    if n == 1:
        if np.any(np.abs(times) > 0):
            raise CheckFailed(
                f"with one rank there is nothing to send: expected 0 s, got {times[0]:.6g} s"
            )
        return
    empty = f"ring_time(0, {n}, alpha={alpha:.3g}, bandwidth={bw:.3g})"
    latency = _values(got["latency"], 1, empty)[0]
    doubled = _values(got["latency_2alpha"], 1, empty.replace("alpha=", "2 * alpha="))[0]
    if not (latency > 0 and _close(doubled, 2 * latency)):
        raise CheckFailed(
            f"{empty} = {latency:.6g} s and with twice alpha {doubled:.6g} s: an empty message "
            "still pays the latency, a positive time proportional to alpha"
        )
    part = _values(got["bytes"], k, call.replace(f"alpha={alpha:.3g}", "alpha=0"))
    per_byte = part / sizes
    if not (np.all(per_byte > 0) and _close(per_byte, per_byte[0])):
        raise CheckFailed(
            f"with alpha = 0 the time should be the bandwidth part, proportional to the size S: "
            f"n = {n}, B = {bw:.3g} B/s, S = {sizes[:3]} B gave {part[:3]} s"
        )
    if not _close(times, latency + part):
        raise CheckFailed(
            f"{call} is not the latency part ({latency:.6g} s, S = 0) plus the bandwidth part "
            f"(alpha = 0): for S = {sizes[0]:.6g} B it is {times[0]:.6g} s, not "
            f"{latency:.6g} + {part[0]:.6g} s"
        )
    half = _values(got["bytes_2bandwidth"], k, "ring_time(S, n, 0, 2 * B)")
    if not _close(half, part / 2):
        raise CheckFailed(
            f"twice the bandwidth must halve the bandwidth part: n = {n}, S = {sizes[0]:.6g} B: "
            f"{part[0]:.6g} s with B = {bw:.3g} B/s, {half[0]:.6g} s with twice B"
        )
    if per_byte[0] * bw >= 2:
        raise CheckFailed(
            f"n = {n}: the cost per byte is {per_byte[0] * bw:.4g}/B: in a ring all-reduce each "
            "rank sends and receives less than twice the message, so it must stay below 2/B"
        )
    more = _values(got["latency_more"], 1, f"ring_time(0, {n + 1}, ...)")[0]
    if not more > latency * (1 + RTOL):
        raise CheckFailed(
            f"the latency part does not grow with n: {latency:.6g} s on {n} ranks, {more:.6g} s "
            f"on {n + 1}: a larger ring takes more steps, and each step pays alpha"
        )
    per_byte_more = _values(got["bytes_more"], k, f"ring_time(S, {n + 1}, 0, B)")[0] / sizes[0]
    if not per_byte_more > per_byte[0] * (1 + RTOL):
        raise CheckFailed(
            f"the cost per byte does not grow with n: {per_byte[0] * bw:.6g}/B on {n} ranks, "
            f"{per_byte_more * bw:.6g}/B on {n + 1}: with more ranks each rank passes on a "
            "larger share of the message (toward twice the message)"
        )


def judge(inputs: dict, outputs: dict) -> str:
    """Check the properties of the module docstring on every case."""
    got_cases = outputs.get("cases", []) if isinstance(outputs, dict) else []
    if len(got_cases) != len(inputs["cases"]):
        raise CheckFailed(f"expected {len(inputs['cases'])} results, got {len(got_cases)}")
    for case, got in zip(inputs["cases"], got_cases, strict=True):
        _check_case(case, got)
    worlds = ", ".join(str(c["n"]) for c in inputs["cases"])
    return (
        "ring_time: 0 s on one rank; latency proportional to alpha and growing with n; cost "
        f"per byte proportional to 1/B, below 2/B and growing with n (n = {worlds}; arrays "
        "and a number)"
    )


EXERCISE = Exercise(
    "test_ex3_ring_time",
    ("ex3_ring_time",),
    "alpha-beta model of the ring",
    make_inputs,
    judge,
    run=run,
    visible_inputs=visible_inputs,
)
