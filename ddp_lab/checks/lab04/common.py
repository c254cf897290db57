"""What lab 4's exercises share: the case builders and the oracle of every judge.

Cases hold one batch per rank, of *different* sizes (one rank may hold none), each rank's
data shifted by :data:`RANK_SHIFT` (shards that are not identically distributed, so that
combining per-rank statistics the wrong way is visibly wrong). The oracle is always the
concatenated global batch: ``torch.var_mean`` of it, or autograd through ``F.batch_norm``
on it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from ddp_lab.checks import guards
from ddp_lab.checks.failure import CheckFailed
from ddp_lab.checks.values import randint

#: Files the notebook's distributed solution cells write (``%%writefile``).
STATS_FILE, GRAD_FILE, FUNCTION_FILE = "sync_stats.py", "sync_grad.py", "sync_bn.py"
#: How far apart the ranks' data are (per rank, in units of the noise).
RANK_SHIFT = 1.5
#: BatchNorm's epsilon in every case.
EPS = 1e-5
#: The runtime module students may not use: its SyncBatchNorm is finished BatchNorm.
RUNTIME = ("ddp_lab.syncbn",)


def sizes(gen: torch.Generator, world: int, lo: int, hi: int, empty: bool = False) -> list[int]:
    """Per-rank batch sizes in ``[lo, hi]``; one rank empty with ``empty``; the non-empty
    ranks' sizes not all equal (else averaging the ranks' statistics would be right)."""
    if world < (3 if empty else 2):
        raise ValueError(f"{world} ranks cannot hold unequal non-empty batches")
    while True:
        out = [randint(gen, lo, hi) for _ in range(world)]
        if empty:
            out[randint(gen, 0, world - 1)] = 0
        if len({s for s in out if s}) > 1:
            return out


def rank_batches(
    gen: torch.Generator, sizes: list[int], channels: int, tail: tuple[int, ...]
) -> list[torch.Tensor]:
    """float64 batches ``(n_r, C, *tail)``, one per rank; rank r's data shifted by
    ``r * RANK_SHIFT``, every channel by its own offset, every step by its own scale."""
    offsets = torch.randn(channels, generator=gen, dtype=torch.float64) * 2
    view = (1, channels, *([1] * len(tail)))
    return [
        (1 + torch.rand(1, generator=gen, dtype=torch.float64))
        * torch.randn(n, channels, *tail, generator=gen, dtype=torch.float64)
        + offsets.reshape(view)
        + RANK_SHIFT * r
        for r, n in enumerate(sizes)
    ]


def channel_dims(x: torch.Tensor) -> tuple[int, ...]:
    """Every dimension of ``x`` but the channel dimension 1."""
    return tuple(d for d in range(x.dim()) if d != 1)


def values_per_channel(x: torch.Tensor) -> int:
    """How many values each channel of ``x`` holds (batch size times spatial size)."""
    return x[:, 0].numel()


def var_mean(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel biased variance and mean of ``x`` (``torch.var_mean``; NaN when empty)."""
    return torch.var_mean(x, dim=channel_dims(x), correction=0)


def moments(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(sum, sum of squares, count)`` of ``x`` per channel, from ``torch.var_mean``:
    ``sum = mean * n`` and ``sumsq = (var + mean^2) * n``; zeros for an empty batch."""
    n = values_per_channel(x)
    if n == 0:
        zeros = torch.zeros(x.size(1), dtype=torch.float64)
        return zeros, zeros.clone(), torch.tensor(0.0, dtype=torch.float64)
    var, mean = var_mean(x.double())
    return mean * n, (var + mean.square()) * n, torch.tensor(float(n), dtype=torch.float64)


def global_stats(xs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean, biased variance and ``1 / sqrt(var + EPS)`` of the concatenated global batch."""
    var, mean = var_mean(torch.cat(xs))
    return mean, var, (var + EPS).rsqrt()


def sizes_text(case: dict) -> str:
    """``"3 ranks holding [2, 0, 5] samples"``."""
    return f"{case['world_size']} ranks holding {case['sizes']} samples"


def worlds_text(inputs: dict) -> str:
    """``"2 and 3"``: the world sizes of the cases."""
    return " and ".join(str(c["world_size"]) for c in inputs["cases"])


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
    if float(total.abs().max()) <= 1e-6:
        return ""
    return (
        f" (summed over all ranks, your gradients give {total.abs().max().item():.3g} for a "
        "channel where BatchNorm's give 0: every sample of the global batch moves the mean and "
        "the variance, so each rank needs the GLOBAL sums and count)"
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
