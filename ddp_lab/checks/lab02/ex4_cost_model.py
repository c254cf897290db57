"""Exercise 4: the cost model, derived: ``ring_time`` and ``server_time`` (the alpha-beta
model of your ring and of one step of your synchronous server), and ``fit_alpha_beta``, which
fits the ring's model to measured times. One solution cell, one grade.

- ``ring_time`` and ``server_time``: properties any sound model has, probed around four cases
  (:mod:`~ddp_lab.checks.lab02.model_times`);
- ``fit_alpha_beta``: units and order, recovery of exact times and least relative errors on
  noisy ones, with times made by the student's own ``ring_time``
  (:mod:`~ddp_lab.checks.lab02.model_fit`).

The exact formulas and the reference fit are the grader's (``ddp_lab.answers``), which also
adds times of the exact model to the fit's cases.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ddp_lab.checks.contract import Exercise
from ddp_lab.checks.lab02 import model_fit, model_times

FUNCTIONS = ("ring_time", "server_time", "fit_alpha_beta")


def make_inputs(gen: torch.Generator) -> dict:
    """Four cases for both models, three model cases for the fit."""
    return {"times": model_times.make_cases(gen), "fits": model_fit.make_cases(gen)}


def visible_inputs(gen: torch.Generator) -> dict:
    """Fixed cases (see :func:`model_times.visible_cases`, :func:`model_fit.visible_cases`)."""
    return {"times": model_times.visible_cases(), "fits": model_fit.visible_cases()}


def run(ns: dict, inputs: dict, workdir: Path) -> dict:
    """The three functions on every case (student process)."""
    ring, server, fit = (ns[name] for name in FUNCTIONS)
    return {
        "ring_time": [model_times.probe(ring, c) for c in inputs["times"]],
        "server_time": [model_times.probe(server, c) for c in inputs["times"]],
        "fits": model_fit.run_fits(fit, ring, inputs["fits"]),
    }


def judge(inputs: dict, outputs: dict) -> str:
    """Both models' properties, then the fit's."""
    model_times.judge_times(inputs["times"], outputs)
    model_fit.judge_fits(inputs["fits"], outputs.get("fits") if isinstance(outputs, dict) else None)
    worlds = ", ".join(str(c["n"]) for c in inputs["times"])
    fits = " and ".join(str(c["n"]) for c in inputs["fits"])
    return (
        "ring_time and server_time: 0 s on one rank, latency proportional to alpha, cost per "
        "byte proportional to 1/B; the ring's below 2/B and growing with n, the server's at "
        f"least (n - 1)/B and linear in n (n = {worlds}); fit_alpha_beta: units and order, "
        f"exact times recovered, relative errors minimised (n = {fits})"
    )


EXERCISE = Exercise(
    "test_ex4_cost_model",
    ("ex4_cost_model",),
    "alpha-beta models of the ring and the server, and the fit",
    make_inputs,
    judge,
    run=run,
    visible_inputs=visible_inputs,
)
