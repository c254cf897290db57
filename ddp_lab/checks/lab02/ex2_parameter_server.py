"""Exercise 2: a synchronous parameter server (``ps.py``), on every rank of one torchrun job.

Rank 0, the server, holds the parameters and the optimizer; the workers (ranks ``1 .. n - 1``)
push gradients and pull parameters. Oracle: the trajectory of one process that averages the
workers' gradients at the current parameters and takes one SGD step
(:func:`~ddp_lab.checks.lab02.server.trajectory`, staleness 0), compared with what the checker
recorded in the ranks: where each gradient was computed, what the server applied, the
parameters after each step and at the end on every rank.

Case set, one job of 3 ranks: on 2 ranks (one worker; rank 2 sits it out) and on 3 ranks (two
workers with shards of different sizes), each with 1 step on 1 parameter (float64), 3 to 5
steps (float64), 3 to 5 steps (float32); learning rate and momentum drawn.
"""

from __future__ import annotations

import torch

from ddp_lab.checks import guards
from ddp_lab.checks.contract import Exercise
from ddp_lab.checks.lab02 import common, server
from ddp_lab.checks.values import randint


def _runs(gen: torch.Generator, n: int) -> list[dict]:
    return [
        server.make_run(gen, n, 1, torch.float64),
        server.make_run(gen, n, randint(gen, 3, 5), torch.float64),
        server.make_run(gen, n, randint(gen, 3, 5), torch.float32),
    ]


def make_inputs(gen: torch.Generator) -> dict:
    """One job of 3 ranks: three runs on 2 ranks, three on 3."""
    return {"cases": [{"world_size": common.JOB_RANKS, "runs": _runs(gen, 2) + _runs(gen, 3)}]}


def visible_inputs(gen: torch.Generator) -> dict:
    """One job of 3 ranks: 3 steps on 2 ranks, 3 steps on 3 (float64)."""
    runs = [server.make_run(gen, n, 3, torch.float64) for n in (2, 3)]
    return {"cases": [{"world_size": common.JOB_RANKS, "runs": runs}]}


EXERCISE = Exercise(
    "test_ex2_parameter_server",
    ("ex2_parameter_server",),
    "a synchronous parameter server",
    make_inputs,
    server.judge(stale=False),
    run_rank=server.run_rank(
        common.SERVER_FILE, "parameter_server", "a parameter server", stale=False
    ),
    forbid=guards.COLLECTIVES,
    timeout=90,
    visible_inputs=visible_inputs,
    files=(common.SERVER_FILE,),
)
