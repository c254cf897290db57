"""Exercise 5, ``dataparallel_step_time(n, **costs)``: the notebook's ``nn.DataParallel``
cost model.

The judge checks properties that any right model has, on calls built around drawn costs
(the exact terms are the grader's part):

- the docstring's example gives 3.0 s;
- one device (``n = 1``) moves nothing: its step is ``compute_s + host_s``;
- without bytes to move and without launch time, ``n`` devices share the compute evenly;
- for ``n > 1``, more bytes of parameters, batch or outputs make a step slower, and the
  time is linear in ``1 / bandwidth`` (doubling the bandwidth saves twice what doubling it
  again saves);
- for ``n > 1``, the launches alone take longer than one launch (the threads queue for
  the GIL).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ddp_lab.checks.contract import Exercise
from ddp_lab.checks.failure import CheckFailed, require
from ddp_lab.checks.values import kind, log_uniform, number, plain, randint

#: The docstring's example: 2 devices, 1 GB of parameters and of batch at 1 GB/s -> 3.0 s.
EXAMPLE = {
    "compute_s": 1.0,
    "param_bytes": 1e9,
    "batch_bytes": 1e9,
    "output_bytes": 0.0,
    "bandwidth": 1e9,
    "host_s": 0.0,
}
EXAMPLE_SECONDS = 3.0
BYTES = ("param_bytes", "batch_bytes", "output_bytes")


def _family(n: int, costs: dict) -> list[dict]:
    """A base call and, for ``n > 1``, the calls its properties compare it with."""
    base = {"n": n, "kwargs": costs, "role": "base"}
    if n == 1:
        return [base]
    more = [{"n": n, "kwargs": {**costs, k: 2 * costs[k]}, "role": f"more {k}"} for k in BYTES]
    faster = [
        {
            "n": n,
            "kwargs": {**costs, "bandwidth": f * costs["bandwidth"]},
            "role": f"bandwidth x{f}",
        }
        for f in (2, 4)
    ]
    free = {**costs, **dict.fromkeys(BYTES, 0.0), "host_s": 0.0}
    launch = {**costs, **dict.fromkeys(BYTES, 0.0), "compute_s": 0.0}
    return [
        base,
        *more,
        *faster,
        {"n": n, "kwargs": free, "role": "free"},
        {"n": n, "kwargs": launch, "role": "launch"},
    ]


def _costs(gen: torch.Generator) -> dict:
    return {
        "compute_s": log_uniform(gen, 1e-3, 1.0),
        "param_bytes": log_uniform(gen, 1e6, 1e9),
        "batch_bytes": log_uniform(gen, 1e5, 1e9),
        "output_bytes": log_uniform(gen, 1e4, 1e8),
        "bandwidth": log_uniform(gen, 1e9, 1e11),
        "host_s": log_uniform(gen, 1e-5, 1e-2),
    }


def make_inputs(gen: torch.Generator) -> dict:
    """The docstring's example, then costs drawn for n = 1, 2 and six n in 3 .. 16."""
    cases = [{"n": 2, "kwargs": dict(EXAMPLE), "role": "example"}]
    for n in [1, 2, *(randint(gen, 3, 16) for _ in range(6))]:
        cases += _family(n, _costs(gen))
    return {"cases": cases}


def visible_inputs(gen: torch.Generator) -> dict:
    """The docstring's example, and a ResNet-like step on 1 and 4 devices."""
    costs = {
        "compute_s": 0.2,
        "param_bytes": 4e8,
        "batch_bytes": 1e8,
        "output_bytes": 1e6,
        "bandwidth": 1e10,
        "host_s": 0.002,
    }
    example = {"n": 2, "kwargs": dict(EXAMPLE), "role": "example"}
    return {"cases": [example, *_family(1, costs), *_family(4, costs)]}


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


def judge(inputs: dict, outputs: dict) -> str:
    """The properties of the module docstring, case by case."""
    cases, got_all = inputs["cases"], outputs["times"]
    require(
        isinstance(got_all, list) and len(got_all) == len(cases),
        "expected one time per call",
    )
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
        n, costs, role = case["n"], case["kwargs"], case["role"]
        where = f"{call(case)} returned {t:.6g} s"
        if role == "example":
            require(
                _same(t, EXAMPLE_SECONDS),
                f"{where}; the docstring's example says {EXAMPLE_SECONDS} s",
            )
        elif role == "base":
            base = (case, t)
            if n == 1:
                require(
                    _same(t, costs["compute_s"] + costs["host_s"]),
                    f"{where}; one device moves nothing: expected compute_s + host_s = "
                    f"{costs['compute_s'] + costs['host_s']:.6g} s",
                )
        elif role.startswith("more "):
            key = role.split()[1]
            require(
                t > base[1],
                f"{where}, with twice the {key} of {call(base[0])} ({base[1]:.6g} s): on "
                f"{n} devices more bytes to move must make a step slower",
            )
        elif role.startswith("bandwidth x"):
            require(
                t < base[1],
                f"{where}, with a faster link than {call(base[0])} ({base[1]:.6g} s): on "
                f"{n} devices a faster link must make a step faster",
            )
            if role == "bandwidth x2":
                twice = t
            else:  # linear in 1 / bandwidth: t(B) - t(2B) = 2 (t(2B) - t(4B))
                t1, t2 = base[1], twice
                require(
                    abs((t1 - t2) - 2 * (t2 - t)) <= 1e-9 * t1,
                    f"{call(base[0])}: transfers take bytes / bandwidth, so the step time is "
                    f"linear in 1 / bandwidth; at 1x, 2x and 4x the bandwidth you return "
                    f"{t1:.6g}, {t2:.6g} and {t:.6g} s: the saving should halve "
                    f"({t1 - t2:.4g} s, then {(t1 - t2) / 2:.4g} s), not {t2 - t:.4g} s",
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
    counts = sorted({c["n"] for c in cases if c["role"] == "base"})
    return (
        f"the docstring's example, one device, and how {len(cases)} predictions change with "
        f"bytes, bandwidth and n (n = {counts}) agree with the cost model's properties"
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
