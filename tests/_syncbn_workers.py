"""Cases and spawned workers for ``tests/test_syncbn.py`` (and one for ``tests/test_lab04.py``).

They live in their own top-level module so that ``torch.multiprocessing`` (start method
"spawn", through ``_harness.spawn_gloo``) can import them in the child processes. The test
and the workers build the same data from the same seeds, so that the test can rebuild the
global batch and compare.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ddp_lab.syncbn import SyncBatchNorm, convert_sync_batchnorm

CHANNELS = 3
STEPS = 3
DDP_STEPS = 2
DDP_LR = 0.1


@dataclass(frozen=True)
class Case:
    """One comparison: per-rank batch sizes, input shape after (N, C), dtype, momentum."""

    name: str
    sizes: tuple[int, ...]
    tail: tuple[int, ...]
    dtype: torch.dtype
    momentum: float | None = 0.1

    @property
    def offsets(self) -> list[int]:
        out = [0]
        for n in self.sizes:
            out.append(out[-1] + n)
        return out


def cases(world_size: int) -> dict[str, Case]:
    """The BatchNorm cases run with ``world_size`` ranks, by name (same names for 2 and 3)."""
    uneven = {2: (3, 5), 3: (3, 5, 2)}[world_size]
    with_empty = {2: (6, 0), 3: (4, 0, 3)}[world_size]
    f32, f64 = torch.float32, torch.float64
    return {
        c.name: c
        for c in [
            Case("image_float64", uneven, (4, 4), f64),
            Case("image_float32", uneven, (4, 4), f32),
            Case("flat_float64_cumulative", uneven, (), f64, momentum=None),
            Case("sequence_float32", uneven, (5,), f32, momentum=0.3),
            Case("volume_float64", uneven, (2, 3, 3), f64),
            Case("image_float64_empty_rank", with_empty, (4, 4), f64),
        ]
    }


def ddp_sizes(world_size: int) -> tuple[int, ...]:
    """Per-rank batch sizes of the DDP + converted CNN check."""
    return {2: (3, 5), 3: (3, 5, 2)}[world_size]


def reference_bn(num_features: int, ndim: int, **kwargs) -> nn.Module:
    """The plain torch BatchNorm for an ndim-D input."""
    cls = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}[ndim]
    return cls(num_features, **kwargs)


def make_data(case: Case) -> dict:
    """Initial parameters and buffers, per-step global batches and upstream gradients.

    Each rank's rows get their own offset, like non-i.i.d. shards, so that averaging per-rank
    statistics is visibly wrong.
    """
    g = torch.Generator().manual_seed(1234 + len(case.sizes))
    n, c = sum(case.sizes), CHANNELS

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    rank_shift = torch.cat([torch.full((k,), 1.5 * r) for r, k in enumerate(case.sizes)])
    shape = (n, c, *case.tail)
    per_channel = (1, c, *([1] * len(case.tail)))
    rows = (n, *([1] * (len(shape) - 1)))

    def batch() -> torch.Tensor:
        x = 2.0 * rand(*shape) + torch.tensor([1.0, -2.0, 3.0]).reshape(per_channel)
        return (x + rank_shift.reshape(rows).to(torch.float64)).to(case.dtype)

    data = {
        "weight": (1.0 + 0.3 * rand(c)).to(case.dtype),
        "bias": (0.2 * rand(c)).to(case.dtype),
        "running_mean": (0.1 * rand(c)).to(case.dtype),
        "running_var": (1.0 + 0.5 * rand(c).abs()).to(case.dtype),
        "x": [],
        "dy": [],
    }
    for _ in range(STEPS):
        data["x"].append(batch())
        data["dy"].append(rand(*shape).to(case.dtype))  # a random weighting of the output
    data["x_eval"] = batch()
    return data


def load_state(bn: nn.Module, data: dict) -> None:
    """Copy the case's initial parameters and running stats into a BatchNorm layer."""
    with torch.no_grad():
        for key in ("weight", "bias", "running_mean", "running_var"):
            getattr(bn, key).copy_(data[key])


def ddp_batches(world_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Global (images, labels) batches, float64, for the DDP + CNN check."""
    g = torch.Generator().manual_seed(99)
    n = sum(ddp_sizes(world_size))
    return [
        (
            torch.randn(n, 3, 32, 32, generator=g, dtype=torch.float64) + 0.5,
            torch.randint(0, 10, (n,), generator=g),
        )
        for _ in range(DDP_STEPS)
    ]


def small_cnn() -> nn.Module:
    """The course's CNN, narrow, float64, with fixed initial weights."""
    from ddp_lab.models import SmallCNN

    torch.manual_seed(0)
    return SmallCNN(width=4).double()


def _run_case(rank: int, case: Case) -> dict:
    data = make_data(case)
    lo, hi = case.offsets[rank], case.offsets[rank + 1]
    bn = SyncBatchNorm(CHANNELS, momentum=case.momentum).to(case.dtype)
    load_state(bn, data)
    out: dict = {"y": [], "grad_x": [], "grad_weight": [], "grad_bias": []}
    for x_global, dy_global in zip(data["x"], data["dy"], strict=True):
        x = x_global[lo:hi].clone().requires_grad_(True)
        y = bn(x)
        (y * dy_global[lo:hi]).sum().backward()
        out["y"].append(y.detach())
        out["grad_x"].append(x.grad)
        out["grad_weight"].append(bn.weight.grad.clone())
        out["grad_bias"].append(bn.bias.grad.clone())
        bn.zero_grad(set_to_none=True)
    out["running_mean"] = bn.running_mean.clone()
    out["running_var"] = bn.running_var.clone()
    out["num_batches_tracked"] = int(bn.num_batches_tracked)
    bn.eval()
    with torch.no_grad():
        out["y_eval"] = bn(data["x_eval"][lo:hi])
    return out


def _run_ddp_cnn(rank: int, world_size: int) -> dict:
    sizes = ddp_sizes(world_size)
    lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
    n_global = sum(sizes)
    model = nn.parallel.DistributedDataParallel(convert_sync_batchnorm(small_cnn()))
    opt = torch.optim.SGD(model.parameters(), lr=DDP_LR)
    for images, labels in ddp_batches(world_size):
        opt.zero_grad(set_to_none=True)
        # DDP averages gradients over ranks: scale the local sum so the average is the
        # gradient of the mean loss over the global batch, whatever the per-rank sizes.
        loss = F.cross_entropy(model(images[lo:hi]), labels[lo:hi], reduction="sum")
        (loss * world_size / n_global).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.module.state_dict().items()}


def _mismatch_error(rank: int) -> str:
    """What every rank hears when the ranks' inputs differ beyond the batch dimension (rank 0
    holds 4x4 images, the others 3x3): the same error everywhere, and no rank left waiting."""
    side = 4 if rank == 0 else 3
    bn = SyncBatchNorm(CHANNELS)
    try:
        bn(torch.randn(2, CHANNELS, side, side))
    except ValueError as err:
        return str(err)
    return ""


def run_worker(rank: int, world_size: int, out_dir: str) -> None:
    """Spawned entry point (``_harness.spawn_gloo``, the gloo group joined already): run every
    case on this rank and save the results."""
    torch.set_num_threads(1)
    results = {name: _run_case(rank, case) for name, case in cases(world_size).items()}
    results["ddp_cnn"] = _run_ddp_cnn(rank, world_size)
    results["mismatch_error"] = _mismatch_error(rank)
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()


def per_run_worker(rank: int, world_size: int, out_dir: str) -> None:
    """Spawned entry point for ``tests/test_lab04.py``: lab 4's checker runs over 3, 2 and 3
    ranks of one job (:func:`ddp_lab.checks.lab04.common.per_run`); each run records the
    world size the code sees and an all-reduce (no ``group=``) of ``rank + 1``."""
    from ddp_lab.checks.lab04.common import per_run

    def seen(run: dict, r: int) -> list:
        t = torch.tensor([float(r + 1)])
        dist.all_reduce(t)
        return [dist.get_world_size(), float(t)]

    case = {"runs": [{"ranks": 3}, {"ranks": 2}, {"ranks": 3}]}
    out = per_run(case, rank, world_size, seen)
    torch.save(out, Path(out_dir) / f"per-run-{rank}.pt")
    dist.barrier()
