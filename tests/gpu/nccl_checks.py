"""torchrun worker for tests/gpu/run.sh: NCCL process group, all_reduce, SyncBatchNorm.

Every rank computes; rank 0 prints PASS / FAIL lines. With one GPU the world has one rank:
the all-reduce is a copy and both SyncBatchNorms take their single-rank path (plain
BatchNorm), said in the line. With two or more GPUs the ranks hold unequal batches and the
synchronising paths of ``nn.SyncBatchNorm`` and ``ddp_lab.syncbn`` are compared: output,
input and weight gradients, running statistics. A failing check is reported and the next
one runs (every rank fails it alike, so no rank is left waiting in a collective).
"""

from __future__ import annotations

import copy
import sys
import traceback

import torch
import torch.distributed as dist
from torch import nn

from ddp_lab.dist import setup, teardown

env = setup("nccl", timeout_s=120, quiet=True)
ok = True


def report(name: str, fn) -> None:
    """Run one check on every rank; rank 0 prints its line."""
    global ok
    try:
        good, detail = fn()
    except Exception as err:  # noqa: BLE001 - report and go on
        good, detail = False, f"{type(err).__name__}: {err}"
        if env.is_rank0:
            traceback.print_exc(limit=3)
    ok &= good
    if env.is_rank0:
        print(f"{'PASS' if good else 'FAIL'} {name}: {detail}", flush=True)


def all_reduce():
    t = torch.full((1 << 20,), float(env.rank + 1), device=env.device)
    dist.all_reduce(t)
    expected = env.world_size * (env.world_size + 1) / 2
    return bool((t == expected).all()), (
        f"world {env.world_size}, backend {dist.get_backend()}, sum {t[0].item():g}"
    )


def syncbn():
    from ddp_lab.syncbn import convert_sync_batchnorm

    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU())
    ref = nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(net)).to(env.device)
    ours = convert_sync_batchnorm(copy.deepcopy(net)).to(env.device)
    torch.manual_seed(10 + env.rank)
    x = torch.randn(4 + env.rank, 3, 16, 16, device=env.device)  # unequal batches per rank
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ref(xa), ours(xb)
    w = torch.randn_like(ya)
    (ya * w).sum().backward()
    (yb * w).sum().backward()
    diffs = {
        "output": (ya - yb).abs().max().item(),
        "input grad": (xa.grad - xb.grad).abs().max().item(),
        "weight grad": (ref[1].weight.grad - ours[1].weight.grad).abs().max().item(),
        "bias grad": (ref[1].bias.grad - ours[1].bias.grad).abs().max().item(),
        "running_mean": (ref[1].running_mean - ours[1].running_mean).abs().max().item(),
        "running_var": (ref[1].running_var - ours[1].running_var).abs().max().item(),
    }
    worst = torch.tensor(max(diffs.values()), device=env.device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # every rank's rows and gradients
    alone = " (one rank: both are plain BatchNorm)" if env.world_size == 1 else ""
    detail = ", ".join(f"{k} {v:.1e}" for k, v in diffs.items())
    return worst.item() < 1e-4, f"max abs diff on rank 0: {detail}{alone}"


report("NCCL all_reduce", all_reduce)
report("nn.SyncBatchNorm vs ddp_lab.syncbn", syncbn)
teardown()
sys.exit(0 if ok else 1)
