"""Exercise 5, ``dataparallel_step_time(n, **costs)``: a cost model of one ``nn.DataParallel``
training step, built on what DataParallel does (``replicate`` is ``broadcast_coalesced``, the
gradients come back through ``reduce_add_coalesced``: NCCL collectives that pipeline chunks
along a chain of devices).

The judge has no formula. It checks the student's model on calls built around drawn costs:

- the docstring's example;
- one device (``n = 1``) moves nothing: its step is ``compute_s + host_s``;
- with only parameters to move (no compute, no launches, no batch, no outputs): the
  replicas' weights go out along the chain and the gradients come back along it, so the
  step takes twice the time of one pipelined chain transfer, which :func:`chain_seconds`
  *simulates* chunk by chunk (the oracle);
- without bytes to move and without launch time, ``n`` devices share the compute evenly;
- for ``n > 1``: more bytes of parameters, batch or outputs make a step slower, a batch
  alone takes less than sending the whole batch once, and the time is linear in
  ``1 / bandwidth``;
- for ``n > 1``, the launches alone take longer than one launch (the threads queue for
  the GIL).

The fixed case set, random costs inside: ``n`` = 1, 2, 3, 4 to 8 and 9 to 16, each with
parameters that are not a whole number of chunks, and a model smaller than one chunk.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ddp_lab.checks.contract import Exercise
from ddp_lab.checks.failure import CheckFailed, require
from ddp_lab.checks.values import kind, log_uniform, number, plain, randint, uniform

#: The docstring's example: 3 devices, 1 GB of parameters in chunks of 250 MB at 1 GB/s.
EXAMPLE = {
    "compute_s": 0.3,
    "param_bytes": 1e9,
    "batch_bytes": 0.0,
    "output_bytes": 0.0,
    "bandwidth": 1e9,
    "host_s": 0.0,
    "chunk_bytes": 2.5e8,
}
EXAMPLE_N, EXAMPLE_SECONDS = 3, 2.6
BYTES = ("param_bytes", "batch_bytes", "output_bytes")


def chain_seconds(n: int, nbytes: float, chunk: float, bandwidth: float) -> float:
    """Simulate a pipelined transfer along the chain of devices ``0 -> 1 -> ... -> n-1``.

    ``nbytes`` leave device 0 in chunks of ``chunk`` bytes (the last one smaller). Each link
    carries one chunk at a time at ``bandwidth`` bytes per second, all links at once, and a
    device passes a chunk on as soon as it holds it whole. A reduce along the chain in the
    other direction takes the same time.

    Returns:
        Seconds until the last device holds every chunk (0 for one device).

    Example:
        >>> chain_seconds(3, 4.0, 1.0, 1.0)  # 4 chunks, 2 links
        5.0
    """
    if n <= 1 or nbytes <= 0:
        return 0.0
    whole = int(nbytes // chunk)
    sizes = [chunk] * whole + ([nbytes - whole * chunk] if nbytes > whole * chunk else [])
    free = [0.0] * (n - 1)  # when each link is free again
    t = 0.0
    for size in sizes:
        t = 0.0  # every chunk is on device 0 from the start
        for link in range(n - 1):
            t = max(t, free[link]) + size / bandwidth
            free[link] = t
    return t


def _family(n: int, costs: dict) -> list[dict]:
    """A base call and, for ``n > 1``, the calls its properties compare it with."""
    base = {"n": n, "kwargs": costs, "role": "base"}
    zero = dict.fromkeys(BYTES, 0.0)
    only_params = {**costs, **zero, "param_bytes": costs["param_bytes"]}
    only_params.update(compute_s=0.0, host_s=0.0)
    if n == 1:
        return [base, {"n": n, "kwargs": only_params, "role": "params"}]
    more = [{"n": n, "kwargs": {**costs, k: 2 * costs[k]}, "role": f"more {k}"} for k in BYTES]
    faster = [
        {"n": n, "kwargs": {**costs, "bandwidth": f * costs["bandwidth"]}, "role": f"bw x{f}"}
        for f in (2, 4)
    ]
    only_batch = {**costs, **zero, "batch_bytes": costs["batch_bytes"]}
    only_batch.update(compute_s=0.0, host_s=0.0)
    return [
        base,
        *more,
        *faster,
        {"n": n, "kwargs": {**costs, **zero, "host_s": 0.0}, "role": "free"},
        {"n": n, "kwargs": {**costs, **zero, "compute_s": 0.0}, "role": "launch"},
        {"n": n, "kwargs": only_params, "role": "params"},
        {"n": n, "kwargs": only_batch, "role": "batch"},
    ]


def _costs(gen: torch.Generator, chunks: float) -> dict:
    """Costs of a step whose parameters make ``chunks`` chunks (not a whole number)."""
    chunk = log_uniform(gen, 1e5, 1e7)
    return {
        "compute_s": log_uniform(gen, 1e-3, 1.0),
        "param_bytes": chunks * chunk,
        "batch_bytes": log_uniform(gen, 1e5, 1e9),
        "output_bytes": log_uniform(gen, 1e4, 1e8),
        "bandwidth": log_uniform(gen, 1e9, 1e11),
        "host_s": log_uniform(gen, 1e-5, 1e-2),
        "chunk_bytes": chunk,
    }


def make_inputs(gen: torch.Generator) -> dict:
    """The docstring's example; n = 1, 2, 3, 4 to 8 and 9 to 16 with parameters of 2 to 200
    chunks (the last one partial); and a model smaller than one chunk on 3 to 8 devices."""
    cases = [{"n": EXAMPLE_N, "kwargs": dict(EXAMPLE), "role": "example"}]
    for n in (1, 2, 3, randint(gen, 4, 8), randint(gen, 9, 16)):
        chunks = randint(gen, 1, 199) + uniform(gen, 0.05, 0.95)
        cases += _family(n, _costs(gen, chunks))
    cases += _family(randint(gen, 3, 8), _costs(gen, uniform(gen, 0.1, 0.9)))
    return {"cases": cases}


def visible_inputs(gen: torch.Generator) -> dict:
    """The docstring's example, a ResNet-like step on 1 and 4 devices, and a model smaller
    than one chunk on 3 devices."""
    costs = {
        "compute_s": 0.2,
        "param_bytes": 4.5e7,
        "batch_bytes": 3e6,
        "output_bytes": 1e4,
        "bandwidth": 1.2e10,
        "host_s": 0.004,
        "chunk_bytes": 5.24288e5,
    }
    small = {**costs, "param_bytes": 2e5}
    example = {"n": EXAMPLE_N, "kwargs": dict(EXAMPLE), "role": "example"}
    return {"cases": [example, *_family(1, costs), *_family(4, costs), *_family(3, small)]}


def run(ns: dict, inputs: dict, workdir: Path | None) -> dict:
    """Call the student's function once per case."""
    fn = ns["dataparallel_step_time"]
    return {"times": [plain(fn(c["n"], **c["kwargs"])) for c in inputs["cases"]]}


def call(case: dict) -> str:
    """The call as the student would write it, for messages."""
    args = ", ".join(f"{k}={v:.4g}" for k, v in case["kwargs"].items())
    return f"dataparallel_step_time({case['n']}, {args})"


def _same(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-15)


def _params_only(n: int, costs: dict, t: float, where: str) -> None:
    p, c, bw = costs["param_bytes"], costs["chunk_bytes"], costs["bandwidth"]
    one = chain_seconds(n, p, c, bw)
    if _same(t, 2 * one):
        return
    copies = (n - 1) * p / bw
    if n > 2 and _same(t, 2 * copies):
        raise CheckFailed(
            f"{where}: that is one full copy per device, one after another ((n - 1) * "
            f"param_bytes / bandwidth out and back, {2 * copies:.6g} s). nn.DataParallel "
            "replicates with broadcast_coalesced and reduces the gradients with "
            "reduce_add_coalesced, NCCL collectives that cut the bytes into chunks and "
            "pipeline them along the chain of devices: expected "
            f"{2 * one:.6g} s (twice {one:.6g} s, the simulated chain transfer)"
        )
    raise CheckFailed(
        f"{where}; with only parameters to move, the weights go out along the chain of "
        f"devices and the gradients come back along it: a simulation of chunks of "
        f"{c:.4g} bytes on {n - 1} links gives {one:.6g} s each way, {2 * one:.6g} s in all"
    )


def _check(case: dict, t: float, base: tuple | None, twice: float) -> None:
    n, costs, role = case["n"], case["kwargs"], case["role"]
    where = f"{call(case)} returned {t:.6g} s"
    if role == "example":
        require(_same(t, EXAMPLE_SECONDS), f"{where}; the docstring says {EXAMPLE_SECONDS} s")
    elif role == "base" and n == 1:
        require(
            _same(t, costs["compute_s"] + costs["host_s"]),
            f"{where}; one device moves nothing: expected compute_s + host_s = "
            f"{costs['compute_s'] + costs['host_s']:.6g} s",
        )
    elif role == "params":
        _params_only(n, costs, t, where)
    elif role.startswith("more "):
        key = role.split()[1]
        require(
            t > base[1],
            f"{where}, with twice the {key} of {call(base[0])} ({base[1]:.6g} s): on {n} "
            "devices more bytes to move must make a step slower",
        )
    elif role == "batch":
        whole = costs["batch_bytes"] / costs["bandwidth"]
        require(
            0 < t < whole,
            f"{where}; with only the batch to move, device 0 keeps its own part and sends "
            f"the others: more than 0 and less than sending the whole batch ({whole:.6g} s)",
        )
    elif role == "bw x4":  # linear in 1 / bandwidth: t(B) - t(2B) = 2 (t(2B) - t(4B))
        t1, t2 = base[1], twice
        require(
            t < t2 < t1 and abs((t1 - t2) - 2 * (t2 - t)) <= 1e-9 * t1,
            f"{call(base[0])}: transfers take bytes / bandwidth, so the step time is linear "
            f"in 1 / bandwidth; at 1x, 2x and 4x the bandwidth you return {t1:.6g}, "
            f"{t2:.6g} and {t:.6g} s: the saving should halve each time",
        )
    elif role == "free":
        require(
            _same(t, costs["compute_s"] / n),
            f"{where}; with nothing to move and no launch time, {n} devices share the "
            f"compute evenly: expected compute_s / n = {costs['compute_s'] / n:.6g} s",
        )
    elif role == "launch":
        require(
            t > costs["host_s"] * (1 + 1e-9),
            f"{where}; with only the launches to pay, {n} threads take longer than one "
            f"launch ({costs['host_s']:.6g} s): they queue for the GIL",
        )


def judge(inputs: dict, outputs: dict) -> str:
    """The properties of the module docstring, case by case."""
    cases, got_all = inputs["cases"], outputs.get("times")
    require(isinstance(got_all, list) and len(got_all) == len(cases), "expected one time per call")
    times = []
    for case, got in zip(cases, got_all, strict=True):
        t = number(got)
        if not math.isfinite(t) or t < 0:
            raise CheckFailed(
                f"{call(case)}: expected a number of seconds (>= 0), got {kind(got)}"
                + (f" {t:g}" if not math.isnan(t) else "")
            )
        times.append(t)
    base, twice = None, math.nan
    for case, t in zip(cases, times, strict=True):
        if case["role"] == "base":
            base = (case, t)
        if case["role"] == "bw x2":
            twice = t
        _check(case, t, base, twice)
    counts = sorted({c["n"] for c in cases if c["role"] == "base"})
    return (
        f"the docstring's example, one device, the simulated chain transfers and how "
        f"{len(cases)} predictions change with bytes, bandwidth and n (n = {counts}) agree "
        "with the cost model's properties"
    )


EXERCISE = Exercise(
    "test_ex5_dataparallel_step_time",
    ("ex5_dataparallel_step_time",),
    "the nn.DataParallel cost model",
    make_inputs,
    judge,
    run=run,
    visible_inputs=visible_inputs,
)
