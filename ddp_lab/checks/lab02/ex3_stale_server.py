"""Exercise 3: a parameter server with bounded staleness (``ps_stale.py``), on every rank of
one torchrun job.

With staleness ``s`` a worker does not wait for the parameters it just asked for: the
gradient of step ``t`` is computed on the parameters after step ``max(0, t - s)``. Oracle: the
trajectory of one process with that rule (:func:`~ddp_lab.checks.lab02.server.trajectory`),
compared with what the checker recorded in the ranks; a worker that runs one step too far
ahead (or waits for fresher parameters than the rule) is named.

Case set, one job of 3 ranks, on 2 ranks and on 3 each: staleness 1 with a single step
(float64), staleness 1 with 4 to 6 steps (float64), staleness 2 with 5 to 7 steps (float32),
staleness 0 with 3 steps (the synchronous server, float64).
"""

from __future__ import annotations

import torch

from ddp_lab.checks import guards
from ddp_lab.checks.contract import Exercise
from ddp_lab.checks.lab02 import common, server
from ddp_lab.checks.values import randint


def _runs(gen: torch.Generator, n: int) -> list[dict]:
    return [
        server.make_run(gen, n, 1, torch.float64, staleness=1),
        server.make_run(gen, n, randint(gen, 4, 6), torch.float64, staleness=1),
        server.make_run(gen, n, randint(gen, 5, 7), torch.float32, staleness=2),
        server.make_run(gen, n, 3, torch.float64, staleness=0),
    ]


def make_inputs(gen: torch.Generator) -> dict:
    """One job of 3 ranks: four runs on 2 ranks, four on 3."""
    return {"cases": [{"world_size": common.JOB_RANKS, "runs": _runs(gen, 2) + _runs(gen, 3)}]}


def visible_inputs(gen: torch.Generator) -> dict:
    """One job of 3 ranks: staleness 1 (4 steps) on 2 and on 3 ranks, staleness 2 (5 steps)
    on 3 ranks (float64)."""
    runs = [
        server.make_run(gen, 2, 4, torch.float64, staleness=1),
        server.make_run(gen, 3, 4, torch.float64, staleness=1),
        server.make_run(gen, 3, 5, torch.float64, staleness=2),
    ]
    return {"cases": [{"world_size": common.JOB_RANKS, "runs": runs}]}


EXERCISE = Exercise(
    "test_ex3_stale_server",
    ("ex3_stale_server",),
    "a parameter server with bounded staleness",
    make_inputs,
    server.judge(stale=True),
    run_rank=server.run_rank(
        common.STALE_FILE, "stale_parameter_server", "a parameter server with staleness", stale=True
    ),
    forbid=guards.COLLECTIVES,
    timeout=90,
    visible_inputs=visible_inputs,
    files=(common.STALE_FILE,),
)
