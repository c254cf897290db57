"""torchrun worker for tests/gpu/run.sh: NCCL process group, all_reduce, SyncBatchNorm.

Every rank computes; rank 0 prints PASS / FAIL lines. With one GPU the world has one rank,
so the SyncBatchNorm comparison runs nn.SyncBatchNorm's single-rank path; with two or
more GPUs it compares the synchronising paths of nn.SyncBatchNorm and ddp_lab.syncbn.
"""

from __future__ import annotations

import copy
import sys

import torch
import torch.distributed as dist
from torch import nn

from ddp_lab.dist import setup, teardown
from ddp_lab.syncbn import convert_sync_batchnorm

env = setup("nccl", timeout_s=120, quiet=True)
ok = True


def report(name: str, good: bool, detail: str) -> None:
    global ok
    ok &= good
    if env.is_rank0:
        print(f"{'PASS' if good else 'FAIL'} {name}: {detail}", flush=True)


t = torch.full((1000,), float(env.rank + 1), device=env.device)
dist.all_reduce(t)
expected = env.world_size * (env.world_size + 1) / 2
report(
    "NCCL all_reduce",
    bool((t == expected).all()),
    f"world {env.world_size}, backend {dist.get_backend()}, sum {t[0].item():g}",
)

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
d_out = (ya - yb).abs().max().item()
d_grad = (xa.grad - xb.grad).abs().max().item()
d_run = (ref[1].running_var - ours[1].running_var).abs().max().item()
report(
    "nn.SyncBatchNorm vs ddp_lab.syncbn",
    max(d_out, d_grad, d_run) < 1e-4,
    f"max abs diff output {d_out:.2e}, input grad {d_grad:.2e}, running_var {d_run:.2e}",
)
teardown()
sys.exit(0 if ok else 1)
