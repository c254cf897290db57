"""Jobs with a straggler, for exercise 2: real ``torch.profiler`` traces of data-parallel jobs
in which one rank is slow in one phase.

Every job is a small data-parallel loop (a three-layer MLP, SGD; the gradients averaged by
one ``all_reduce`` of them all, in a ``ddp_lab: all_reduce bucket 0`` range at the end of the
backward pass, as DDP's last bucket) on a group of ``world_size`` gloo ranks, marked like the
trainer's ``--profile`` runs (:mod:`ddp_lab.profiling`): ``ddp_lab: data``, ``ddp_lab:
forward``, ``ddp_lab: backward``, ``ddp_lab: optimizer`` ``record_function`` ranges, and
``torch.profiler`` over the steps of :data:`SCHEDULE` (``record_shapes`` and
``profile_memory`` off, so the traces stay small). The loop is written by hand, not with
``DistributedDataParallel`` and ``torch.optim``: both import the compiler (``torch._dynamo``),
seconds of CPU per rank, which a grading run cannot spend; what the trace shows of waiting is
the same.

The straggler (``spec["rank"]``) sleeps :data:`SLOW_MS` (or a little more) inside its phase
``spec["phase"]`` on every step (a sleep inside the range, before that phase's work). A job may
have a *hiccup* too (``spec["hiccup"] = [rank, phase, step]``): another rank pauses
:data:`HICCUP_MS` once, in one phase of one profiled step (a logging step, a GC pause), longer
than the straggler's slowdown over all profiled steps together.

What each rank gives back: the complete events (``"ph": "X"``) of its Chrome trace, as
:func:`ddp_lab.figures.profile.load_events` reads them, each cut to the keys ``name``, ``ph``,
``ts``, ``dur`` (microseconds), ``tid``, ``pid``, ``cat``.

All of a grading run's jobs run in one ``torchrun`` launch of 3 ranks, each job on a process
group of its own (ranks 0 and 1, or 0 to 2); rank 2 skips the jobs of 2 ranks.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

import torch
import torch.distributed as dist

from ddp_lab.checks.lab08 import jobs
from ddp_lab.checks.values import randint, uniform
from ddp_lab.profiling import BUCKET, PHASES, PREFIX

#: the profiler's (wait, warmup, active) steps of every job (the last active step's
#: ``prof.step()`` writes the trace)
SCHEDULE = (1, 1, 3)
STEPS = sum(SCHEDULE)
#: the straggler's least extra time per step in its phase, in ms
SLOW_MS = 25.0
#: the straggler's most extra time per step
SLOW_MAX_MS = 1.5 * SLOW_MS
#: a hiccup's pause, in ms (more than a waiting rank's backward summed over the active steps)
HICCUP_MS = 8 * SLOW_MS
BATCH, WIDTH, LR = 32, 128, 0.01


def spec(world: int, rank: int, phase: str, slow_ms: float, hiccup=None, seed: int = 0) -> dict:
    """One job: ``world`` ranks, rank ``rank`` slowed by ``slow_ms`` in ``phase`` every step;
    ``hiccup``: None or ``[rank, phase, active step index]``."""
    assert phase in PHASES and 0 <= rank < world
    return {
        "world_size": world,
        "rank": rank,
        "phase": phase,
        "slow_ms": float(slow_ms),
        "hiccup": list(hiccup) if hiccup else None,
        "seed": int(seed),
    }


def draw(gen: torch.Generator, world: int, phase: str, rank: int, hiccup=None) -> dict:
    """One job of the case set: the slowdown drawn in ``[SLOW_MS, SLOW_MAX_MS]``."""
    return spec(world, rank, phase, round(uniform(gen, SLOW_MS, SLOW_MAX_MS), 1), hiccup,
                randint(gen, 0, 10**6))  # fmt: skip


def _pause(spec: dict, rank: int, phase: str, step: int) -> None:
    """The job's slowdowns at (rank, phase, step): the straggler's and a hiccup's."""
    ms = spec["slow_ms"] if rank == spec["rank"] and phase == spec["phase"] else 0.0
    h = spec["hiccup"]
    if h and h[0] == rank and h[1] == phase and step == SCHEDULE[0] + SCHEDULE[1] + h[2]:
        ms += HICCUP_MS
    if ms:
        time.sleep(ms / 1e3)


@contextlib.contextmanager
def _no_compiler_import():
    """``torch.profiler`` asks ``hasattr(torch, "_inductor")`` (at its start and at each step
    of its schedule), which imports the compiler (2 s of CPU per rank) only to read a
    CUDA-graph flag: while the job runs, that lazy import is off (nothing else changes; a
    torch without ``_lazy_modules`` just starts slower)."""
    lazy = getattr(torch, "_lazy_modules", None)
    if not isinstance(lazy, set) or "_inductor" not in lazy or "torch._inductor" in sys.modules:
        yield
        return
    lazy.discard("_inductor")
    try:
        yield
    finally:
        lazy.add("_inductor")


def _train(spec: dict, group, rank: int, folder: str) -> list[dict]:
    """The job's loop on this rank; its trace's complete events."""
    from torch.profiler import ProfilerActivity, profile, record_function, schedule

    torch.manual_seed(spec["seed"])
    model = torch.nn.Sequential(
        torch.nn.Linear(WIDTH, WIDTH),
        torch.nn.ReLU(),
        torch.nn.Linear(WIDTH, WIDTH),
        torch.nn.ReLU(),
        torch.nn.Linear(WIDTH, 10),
    )
    params = list(model.parameters())
    for p in params:  # every rank starts from rank 0's weights
        dist.broadcast(p.data, src=0, group=group)
    n = dist.get_world_size(group)
    g = torch.Generator().manual_seed(spec["seed"] * 31 + rank)
    xs = torch.randn(STEPS, BATCH, WIDTH, generator=g)
    ys = torch.randint(0, 10, (STEPS, BATCH), generator=g)
    path = os.path.join(folder, f"trace-rank{rank}.json")
    wait, warmup, active = SCHEDULE
    prof = profile(
        activities=[ProfilerActivity.CPU],
        schedule=schedule(wait=wait, warmup=warmup, active=active, repeat=1),
        on_trace_ready=lambda p: p.export_chrome_trace(path),
        record_shapes=False,
        profile_memory=False,
    )
    with _no_compiler_import():
        prof.start()
        for step in range(STEPS):
            with record_function(PREFIX + "data"):
                _pause(spec, rank, "data", step)
                x, y = xs[step].clone(), ys[step].clone()
            with record_function(PREFIX + "forward"):
                _pause(spec, rank, "forward", step)
                loss = torch.nn.functional.cross_entropy(model(x), y)
            with record_function(PREFIX + "backward"):
                _pause(spec, rank, "backward", step)
                loss.backward()
                with record_function(BUCKET + "0"):  # one bucket: every gradient, averaged
                    flat = torch.cat([p.grad.reshape(-1) for p in params])
                    dist.all_reduce(flat, group=group)
                    flat /= n
                    offset = 0
                    for p in params:
                        p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
                        offset += p.numel()
            with record_function(PREFIX + "optimizer"):
                _pause(spec, rank, "optimizer", step)
                with torch.no_grad():  # SGD by hand (torch.optim imports the compiler: seconds)
                    for p in params:
                        p -= LR * p.grad
                        p.grad = None
            prof.step()
        prof.stop()
    return jobs.complete_events(path)


def run_jobs(specs: list[dict]) -> list[list[list[dict]]]:
    """Run the jobs (one torchrun launch of 3 ranks); every job's traces, rank 0 first."""
    return jobs.launch("ddp_lab.checks.lab08.straggler_jobs", specs)


if __name__ == "__main__":
    jobs.worker(sys.argv[1], sys.argv[2], _train)
