"""Single-process CUDA checks for tests/gpu/run.sh: each prints PASS, FAIL or SKIP."""

from __future__ import annotations

import sys
import traceback

import torch
from torch import nn

FAILED = []


def check(name):
    def wrap(fn):
        try:
            msg = fn()
            print(f"PASS {name}: {msg}")
        except Exception as err:  # noqa: BLE001 - report and go on
            FAILED.append(name)
            print(f"FAIL {name}: {type(err).__name__}: {err}")
            traceback.print_exc(limit=3)
        return fn

    return wrap


@check("fp16 autocast + GradScaler skips an inf step and unscales before clipping")
def fp16_scaler():
    torch.manual_seed(0)
    dev = torch.device("cuda")
    model = nn.Linear(16, 4).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cuda")
    x, y = torch.randn(8, 16, device=dev), torch.randint(0, 4, (8,), device=dev)
    with torch.autocast("cuda", dtype=torch.float16):
        out = model(x)
        assert out.dtype == torch.float16
        loss = nn.functional.cross_entropy(out, y)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    norm = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    before = [p.detach().clone() for p in model.parameters()]
    scale = scaler.get_scale()
    opt.zero_grad()
    with torch.autocast("cuda", dtype=torch.float16):
        loss = nn.functional.cross_entropy(model(x * float("inf")), y)
    scaler.scale(loss).backward()
    scaler.step(opt)  # must be skipped: the gradients are inf/nan
    scaler.update()
    same = all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert same, "the optimizer stepped on inf gradients"
    assert scaler.get_scale() < scale, "the scale did not back off"
    return (
        f"grad norm {float(norm):.3f} after unscale_, inf step skipped, scale {scale:g} -> "
        f"{scaler.get_scale():g}"
    )


@check("nn.DataParallel gradient equals the one-device gradient")
def data_parallel():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10)).cuda()
    x, y = torch.randn(64, 32, device="cuda"), torch.randint(0, 10, (64,), device="cuda")
    nn.functional.cross_entropy(model(x), y).backward()
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    dp = nn.DataParallel(model)
    nn.functional.cross_entropy(dp(x), y).backward()
    diff = max(
        (p.grad - r).abs().max().item() for p, r in zip(model.parameters(), ref, strict=True)
    )
    assert diff < 1e-5, diff
    return f"{torch.cuda.device_count()} device(s), max abs diff {diff:.2e}"


@check("ddp_lab.syncbn on CUDA without a process group equals nn.BatchNorm2d")
def syncbn_single():
    from ddp_lab.syncbn import SyncBatchNorm

    torch.manual_seed(0)
    x = torch.randn(8, 4, 5, 5, device="cuda", requires_grad=True)
    ref, ours = nn.BatchNorm2d(4).cuda(), SyncBatchNorm(4).cuda()
    a, b = ref(x), ours(x)
    assert torch.allclose(a, b, atol=1e-6)
    return "forward equal"


if __name__ == "__main__":
    sys.exit(1 if FAILED else 0)
