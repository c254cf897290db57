"""What lab 4's exercises share: the case builders, the runs over 2 and 3 ranks, the oracles.

Every distributed exercise is graded in ONE torchrun job of 3 ranks (each job costs
seconds): a case holds several *runs*, some over all 3 ranks, some over ranks 0 and 1 only.
A run over 2 ranks sees a process group of ranks 0 and 1 as *the* world (:func:`as_world`:
``dist.get_world_size()``, collectives without ``group=``), so the student's code never
hears of the subgroup; rank 2 goes on to the next run, whose collectives no call of ranks
0 and 1 can answer by mistake (they belong to another process group).

Inside a run, the ranks hold batches of *different* sizes (one rank may hold none), each
rank's data shifted by :data:`RANK_SHIFT` and scaled by its own factor (shards that are not
identically distributed, so that combining per-rank statistics the wrong way is visibly
wrong), in float32 or float64, near 0 or far from it. The oracle is always the concatenated
global batch: ``torch.var_mean`` of it, or autograd through ``F.batch_norm`` on it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from ddp_lab.checks import guards
from ddp_lab.checks.failure import CheckFailed
from ddp_lab.checks.values import randint, uniform

#: Files the notebook's distributed solution cells write (``%%writefile``).
STATS_FILE, GRAD_FILE, FUNCTION_FILE = "sync_stats.py", "sync_grad.py", "sync_bn.py"
#: How far apart the ranks' data are (per rank, in units of the noise).
RANK_SHIFT = 1.5
#: BatchNorm's epsilon in every case.
EPS = 1e-5
#: The runtime module students may not use: its SyncBatchNorm is finished BatchNorm.
RUNTIME = ("ddp_lab.syncbn",)
#: Dtypes by name (inputs keep the name: plain values).
DTYPES = {"float32": torch.float32, "float64": torch.float64}


def eps_of(dtype: str) -> float:
    """Machine epsilon of a dtype name: ``eps_of("float32")`` is about ``1.2e-7``."""
    return float(torch.finfo(DTYPES[dtype]).eps)


def sizes(
    gen: torch.Generator, world: int, lo: int, hi: int, empty: bool = False, single: bool = False
) -> list[int]:
    """Per-rank batch sizes in ``[lo, hi]``, the non-empty ones not all equal (else
    averaging the ranks' statistics would be right); with ``empty`` one random rank holds
    no sample, with ``single`` one rank holds exactly one."""
    while True:
        out = [randint(gen, lo, hi) for _ in range(world)]
        if single:
            out[randint(gen, 0, world - 1)] = 1
        if empty:
            out[randint(gen, 0, world - 1)] = 0
        kept = [s for s in out if s]
        unequal = len(kept) == 1 or len(set(kept)) > 1
        if kept and unequal and (not single or 1 in kept):
            return out


def rank_batches(
    gen: torch.Generator,
    sizes: list[int],
    channels: int,
    tail: tuple[int, ...],
    dtype: str = "float64",
    offset: float = 0.0,
) -> list[torch.Tensor]:
    """Batches ``(n_r, C, *tail)`` of ``dtype``, one per rank; rank r's data shifted by
    ``r * RANK_SHIFT`` and scaled by its own factor; every channel by its own offset
    (``offset`` times 1 to 1.5, random sign, plus a little)."""
    sign = torch.where(torch.rand(channels, generator=gen) < 0.5, -1.0, 1.0).double()
    offsets = sign * offset * (1 + 0.5 * torch.rand(channels, generator=gen, dtype=torch.float64))
    offsets += torch.randn(channels, generator=gen, dtype=torch.float64) * 2
    view = (1, channels, *([1] * len(tail)))
    return [
        (
            uniform(gen, 0.5, 2.0)
            * torch.randn(n, channels, *tail, generator=gen, dtype=torch.float64)
            + offsets.reshape(view)
            + RANK_SHIFT * r
        ).to(DTYPES[dtype])
        for r, n in enumerate(sizes)
    ]


def channel_dims(x: torch.Tensor) -> tuple[int, ...]:
    """Every dimension of ``x`` but the channel dimension 1."""
    return tuple(d for d in range(x.dim()) if d != 1)


def values_per_channel(x: torch.Tensor) -> int:
    """How many values each channel of ``x`` holds (batch size times spatial size)."""
    return x[:, 0].numel()


def var_mean(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel biased variance and mean of ``x`` in float64 (``torch.var_mean``)."""
    return torch.var_mean(x.double(), dim=channel_dims(x), correction=0)


def global_stats(xs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean, biased variance and ``1 / sqrt(var + EPS)`` of the concatenated global batch
    (float64)."""
    var, mean = var_mean(torch.cat(xs))
    return mean, var, (var + EPS).rsqrt()


def global_count(xs: list[torch.Tensor]) -> float:
    """Values per channel in the global batch."""
    return float(sum(values_per_channel(x) for x in xs))


def run_text(run: dict) -> str:
    """``"3 ranks holding [2, 0, 5] samples of (C, 4, 4) float32"``."""
    tail = "".join(f", {d}" for d in run["tail"])
    return (
        f"{run['ranks']} ranks holding {run['sizes']} samples of shape (N, {run['channels']}"
        f"{tail}), {run['dtype']}"
    )


def worlds_text(inputs: dict) -> str:
    """``"2 and 3"``: the world sizes of the runs."""
    worlds = sorted({r["ranks"] for c in inputs["cases"] for r in c["runs"]})
    return " and ".join(str(w) for w in worlds)


def runs_of(inputs: dict, outputs: dict) -> Iterator[tuple[dict, list]]:
    """``(run, [rank 0's output, rank 1's, ...])`` for every run of every case (the judge's
    view of the job's ``[rank][run]`` outputs)."""
    for case, ranks in zip(inputs["cases"], outputs["cases"], strict=True):
        for i, run in enumerate(case["runs"]):
            yield (
                run,
                [ranks[r][i] if isinstance(ranks[r], list) else None for r in range(run["ranks"])],
            )


def shift_hint(dys: list[torch.Tensor], grads: list) -> str:
    """A property every right input gradient has, said when the ranks' gradients break it.

    Shifting every input of a channel by the same amount does not change BatchNorm's output,
    so its input gradient summed over the whole global batch is 0 per channel.
    """
    if not all(
        isinstance(g, torch.Tensor) and g.shape == d.shape for g, d in zip(grads, dys, strict=True)
    ):
        return ""
    total = torch.stack([g.double().sum(channel_dims(g)) for g in grads]).sum(0)
    scale = max(float(g.double().abs().max()) if g.numel() else 0.0 for g in grads)
    if float(total.abs().max()) <= 1e-4 * max(scale, 1.0):
        return ""
    return (
        f" (summed over all ranks, your gradients give {total.abs().max().item():.3g} for a "
        "channel where BatchNorm's give 0: every sample of the global batch moves the mean and "
        "the variance, so each rank needs sums over the GLOBAL batch, and its count)"
    )


def triple(got, what: str) -> list:
    """``got`` as a list of 3 values, or :class:`CheckFailed` saying what came back."""
    if not isinstance(got, (list, tuple)) or len(got) != 3:
        said = f"{len(got)} values" if isinstance(got, (list, tuple)) else repr(got)[:60]
        raise CheckFailed(f"{what} should return 3 values, got {said}")
    return list(got)


def load_file(name: str) -> dict:
    """The namespace of the student's file ``name`` (in the working folder), refused when it
    uses the runtime's SyncBatchNorm (:data:`RUNTIME`). The working folder is importable, so
    that ``sync_bn.py`` can import the student's ``sync_stats.py`` and ``sync_grad.py``."""
    path = Path(name)
    if path.is_file():
        guards.refuse_mentions({name: path.read_text()}, RUNTIME)
    here = os.getcwd()
    if here not in sys.path:
        sys.path.insert(0, here)
    return guards.load_student_file(path)


# --- runs over 2 and 3 ranks in one job -----------------------------------------------


@contextmanager
def as_world(group) -> Iterator[None]:
    """While the block runs, ``group`` is the default process group (``None``: no change):
    ``dist.get_world_size()``, ``dist.group.WORLD`` and collectives without ``group=``
    see ranks 0 .. n-1 only. The checker's business: the student's code does not know."""
    if group is None:
        yield
        return
    import torch.distributed.distributed_c10d as c10d

    world = c10d._world.default_pg
    c10d._world.default_pg = group
    try:
        yield
    finally:
        c10d._world.default_pg = world


def per_run(case: dict, rank: int, world: int, one_run: Callable[[dict, int], object]) -> list:
    """``one_run(run, rank)`` for every run of ``case["runs"]`` this rank takes part in
    (``None`` for the others), each over its own number of ranks ``run["ranks"]``: a run over
    fewer ranks than the job's sees a group of ranks ``0 .. n-1`` as its world. Every rank
    creates the groups first (``new_group`` is collective), in the same order."""
    sizes = sorted({run["ranks"] for run in case["runs"] if run["ranks"] < world})
    groups = {n: dist.new_group(list(range(n))) for n in sizes}
    out = []
    for run in case["runs"]:
        if rank >= run["ranks"]:
            out.append(None)
            continue
        with as_world(groups.get(run["ranks"])):
            out.append(one_run(run, rank))
    return out
