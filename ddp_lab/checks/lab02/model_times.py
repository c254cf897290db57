"""Exercise 4, part 1: ``ring_time`` and ``server_time``, the alpha-beta models of a ring
all-reduce and of one synchronous parameter-server step, judged by **properties**.

Each function is called on a case and around it (the probes: no bytes, twice alpha, no
latency, twice the bandwidth, one and two more ranks). Any sound model of either has:

- one rank: nothing to send, 0 s;
- an empty message still pays the latency: a positive time proportional to ``alpha``;
- the time is affine in the size: the latency part plus a bandwidth part proportional to the
  size, independent of ``alpha`` and inversely proportional to ``B``;
- the ring: each rank sends and receives less than twice the message (cost per byte below
  ``2 / B``); more ranks mean more steps and a larger share per rank (both parts grow with
  ``n``);
- the server: its one link receives every worker's full gradient (cost per byte at least
  ``(n - 1) / B``), and each extra worker adds the same time (both parts linear in ``n``).

The exact formulas, and the hints that name a missing factor, are the grader's
(``ddp_lab.answers``).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ddp_lab.checks.failure import CheckFailed
from ddp_lab.checks.values import kind, log_uniform, randint, uniform

#: Relative tolerance of the properties (they hold to rounding).
RTOL = 1e-9
#: The two models: the function's name, and what an extra rank must do to it.
MODELS = ("ring_time", "server_time")


def case(sizes, n: int, alpha: float, bandwidth: float) -> dict:
    """A case: message sizes (bytes), ranks, latency (s), bandwidth (bytes/s)."""
    sizes = torch.as_tensor(np.asarray(sizes, dtype=np.float64).reshape(-1))
    return {"sizes": sizes, "n": n, "alpha": alpha, "bandwidth": bandwidth}


def make_cases(gen: torch.Generator) -> list[dict]:
    """Four cases: 9 sizes on 3 to 64 ranks, 5 on 2 ranks, one size (passed as a number) on
    3 to 64 ranks, 3 sizes on one rank; sizes from 55 B to 3.6 GB, alpha 1 to 100 us, B 0.1 to
    100 GB/s."""

    def draw(n: int, k: int) -> dict:
        sizes = [round(log_uniform(gen, math.exp(4), math.exp(22))) for _ in range(k)]
        return case(sizes, n, uniform(gen, 1e-6, 1e-4), uniform(gen, 1e8, 1e11))

    n1, n2 = randint(gen, 3, 64), randint(gen, 3, 64)
    return [draw(n1, 9), draw(2, 5), draw(n2, 1), draw(1, 3)]


def visible_cases() -> list[dict]:
    """Fixed cases: 1 KB, 1 MB and 1 GB on 4 and 2 ranks, 500 MB (a number) on 8, one rank."""
    sizes = [1e3, 1e6, 1e9]
    return [
        case(sizes, 4, 1e-5, 1e10),
        case(sizes, 2, 3e-5, 2e9),
        case([5e8], 8, 2e-6, 5e10),
        case([1e6], 1, 1e-5, 1e10),
    ]


def _seconds(value):
    """What a model returned as a 1-D float64 tensor (None, or a tag when not numbers)."""
    if value is None:
        return None
    try:
        array = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        return f"<{type(value).__name__}>"
    return torch.as_tensor(array).reshape(-1).clone()


def probe(fn, c: dict) -> dict:
    """Call a model on case ``c`` and around it (student process)."""
    sizes = c["sizes"].numpy()
    n, alpha, bw = c["n"], c["alpha"], c["bandwidth"]

    def size_arg():  # a number when the case has one size, else a fresh array
        return float(sizes[0]) if sizes.size == 1 else sizes.copy()

    return {
        "times": _seconds(fn(size_arg(), n, alpha, bw)),
        "latency": _seconds(fn(0.0, n, alpha, bw)),
        "latency_2alpha": _seconds(fn(0.0, n, 2 * alpha, bw)),
        "latency_more": _seconds(fn(0.0, n + 1, alpha, bw)),
        "latency_more2": _seconds(fn(0.0, n + 2, alpha, bw)),
        "bytes": _seconds(fn(size_arg(), n, 0.0, bw)),
        "bytes_2bandwidth": _seconds(fn(size_arg(), n, 0.0, 2 * bw)),
        "bytes_more": _seconds(fn(size_arg(), n + 1, 0.0, bw)),
        "bytes_more2": _seconds(fn(size_arg(), n + 2, 0.0, bw)),
    }


def values(got, count: int, what: str) -> np.ndarray:
    """A probe's result as ``count`` finite floats, or :class:`CheckFailed`."""
    if got is None:
        raise CheckFailed(f"{what} returned None: return the predicted time")
    if not isinstance(got, torch.Tensor):
        raise CheckFailed(f"{what}: expected a number or an array of seconds, got {kind(got)}")
    if got.numel() != count:
        raise CheckFailed(f"{what}: expected {count} time(s), one per size, got {got.numel()}")
    out = got.double().numpy()
    if not np.all(np.isfinite(out)):
        raise CheckFailed(f"{what}: got {out[:3]} (not finite)")
    return out


def _close(a, b) -> bool:
    return bool(np.all(np.abs(np.asarray(a) - np.asarray(b)) <= RTOL * np.abs(b)))


def _affine(name: str, c: dict, got: dict) -> tuple[float, np.ndarray]:
    """The properties every model has; returns (latency part, cost per byte)."""
    sizes = c["sizes"].numpy()
    n, alpha, bw = c["n"], c["alpha"], c["bandwidth"]
    k = sizes.size
    call = f"{name}(S, {n}, alpha={alpha:.3g}, bandwidth={bw:.3g})"
    times = values(got["times"], k, call)
    empty = f"{name}(0, {n}, alpha={alpha:.3g}, bandwidth={bw:.3g})"
    latency = values(got["latency"], 1, empty)[0]
    doubled = values(got["latency_2alpha"], 1, empty.replace("alpha=", "2 * alpha="))[0]
    if not (latency > 0 and _close(doubled, 2 * latency)):
        raise CheckFailed(
            f"{empty} = {latency:.6g} s and with twice alpha {doubled:.6g} s: an empty message "
            "still pays the latency, a positive time proportional to alpha"
        )
    part = values(got["bytes"], k, call.replace(f"alpha={alpha:.3g}", "alpha=0"))
    per_byte = part / sizes
    if not (np.all(per_byte > 0) and _close(per_byte, per_byte[0])):
        raise CheckFailed(
            f"{name}: with alpha = 0 the time should be the bandwidth part, proportional to the "
            f"size S: n = {n}, B = {bw:.3g} B/s, S = {sizes[:3]} B gave {part[:3]} s"
        )
    if not _close(times, latency + part):
        raise CheckFailed(
            f"{call} is not the latency part ({latency:.6g} s, S = 0) plus the bandwidth part "
            f"(alpha = 0): for S = {sizes[0]:.6g} B it is {times[0]:.6g} s, not "
            f"{latency:.6g} + {part[0]:.6g} s"
        )
    half = values(got["bytes_2bandwidth"], k, f"{name}(S, n, 0, 2 * B)")
    if not _close(half, part / 2):
        raise CheckFailed(
            f"{name}: twice the bandwidth must halve the bandwidth part: n = {n}, S = "
            f"{sizes[0]:.6g} B: {part[0]:.6g} s with B = {bw:.3g} B/s, {half[0]:.6g} s with "
            "twice B"
        )
    return latency, per_byte


def _more(name: str, c: dict, got: dict, key: str) -> float:
    """A probe with more ranks: the latency part (``latency_more*``) or the cost per byte
    (``bytes_more*``)."""
    sizes, n = c["sizes"].numpy(), c["n"]
    extra = 2 if key.endswith("2") else 1
    if key.startswith("latency"):
        return values(got[key], 1, f"{name}(0, {n + extra}, ...)")[0]
    return values(got[key], sizes.size, f"{name}(S, {n + extra}, 0, B)")[0] / sizes[0]


def check_ring(c: dict, got: dict) -> None:
    """The ring's properties on one case (see the module docstring)."""
    n, bw = c["n"], c["bandwidth"]
    if n == 1:
        times = values(got["times"], c["sizes"].numel(), "ring_time(S, 1, ...)")
        if np.any(np.abs(times) > 0):
            raise CheckFailed(
                "ring_time with one rank: there is nothing to send, expected 0 s, got "
                f"{times[0]:.6g} s"
            )
        return
    latency, per_byte = _affine("ring_time", c, got)
    if per_byte[0] * bw >= 2:
        raise CheckFailed(
            f"ring_time, n = {n}: the cost per byte is {per_byte[0] * bw:.4g}/B: in a ring "
            "all-reduce each rank sends and receives less than twice the message, so it must "
            "stay below 2/B"
        )
    more = _more("ring_time", c, got, "latency_more")
    if not more > latency * (1 + RTOL):
        raise CheckFailed(
            f"ring_time: the latency part does not grow with n: {latency:.6g} s on {n} ranks, "
            f"{more:.6g} s on {n + 1}: a larger ring takes more steps, and each step pays alpha"
        )
    per_byte_more = _more("ring_time", c, got, "bytes_more")
    if not per_byte_more > per_byte[0] * (1 + RTOL):
        raise CheckFailed(
            f"ring_time: the cost per byte does not grow with n: {per_byte[0] * bw:.6g}/B on {n} "
            f"ranks, {per_byte_more * bw:.6g}/B on {n + 1}: with more ranks each rank passes on "
            "a larger share of the message (toward twice the message)"
        )


def check_server(c: dict, got: dict) -> None:
    """The server's properties on one case (see the module docstring)."""
    n, bw = c["n"], c["bandwidth"]
    if n == 1:
        times = values(got["times"], c["sizes"].numel(), "server_time(S, 1, ...)")
        if np.any(np.abs(times) > 0):
            raise CheckFailed(
                f"server_time with one rank: there is no worker, expected 0 s, got {times[0]:.6g} s"
            )
        return
    latency, per_byte = _affine("server_time", c, got)
    if per_byte[0] * bw < (n - 1) * (1 - RTOL):
        raise CheckFailed(
            f"server_time, n = {n}: the cost per byte is {per_byte[0] * bw:.4g}/B: the server's "
            f"one link receives every worker's whole gradient, {n - 1} times S bytes, so it is "
            f"at least {n - 1}/B"
        )
    for part, now, what in (
        ("latency", latency, "latency part"),
        ("bytes", per_byte[0], "cost per byte"),
    ):
        one = _more("server_time", c, got, f"{part}_more")
        two = _more("server_time", c, got, f"{part}_more2")
        if not (one > now and _close(two - one, one - now)):
            raise CheckFailed(
                f"server_time: the {what} on {n}, {n + 1} and {n + 2} ranks is {now:.6g}, "
                f"{one:.6g} and {two:.6g}: each extra worker adds the same messages through "
                "the server's link, so it must grow by the same amount with each rank"
            )


def judge_times(cases: list[dict], got: dict) -> None:
    """Both models' properties on every case."""
    for name, check in (("ring_time", check_ring), ("server_time", check_server)):
        results = got.get(name, []) if isinstance(got, dict) else []
        if len(results) != len(cases):
            raise CheckFailed(f"{name}: expected {len(cases)} results, got {len(results)}")
        for c, one in zip(cases, results, strict=True):
            check(c, one)
