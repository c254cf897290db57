"""Single-process CUDA checks for tests/gpu/run.sh: each prints PASS, FAIL or SKIP.

``python tests/gpu/checks.py --preflight`` prints what this Python has on stderr (one line)
and ``<GPUs> <model>`` on stdout (``resnet18`` when torchvision is there, ``cnn`` otherwise).
Needs torch only (and ddp_lab from this tree): no nbgrader, no venv.
"""

from __future__ import annotations

import copy
import importlib.util
import platform
import sys
import traceback

import torch
from torch import nn

CHECKS = []


def grad_norm(params) -> torch.Tensor:
    """The 2-norm of all gradients together (what ``clip_grad_norm_`` measures)."""
    return torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(p.grad.float()) for p in params])
    )


def check(name):
    """Register ``fn`` as the check ``name``; it returns a detail line or raises."""

    def register(fn):
        CHECKS.append((name, fn))
        return fn

    return register


@check("fp16 autocast + GradScaler: unscale_ before clipping, an inf step skipped")
def fp16_scaler():
    torch.manual_seed(0)
    dev = torch.device("cuda")
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to(dev)
    plain = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cuda")
    x, y = torch.randn(8, 16, device=dev), torch.randint(0, 4, (8,), device=dev)
    with torch.autocast("cuda", dtype=torch.float16):
        out = model(x)
        assert out.dtype == torch.float16, out.dtype
        loss = nn.functional.cross_entropy(out, y)
    scaler.scale(loss).backward()
    scaled = grad_norm(model.parameters())
    scaler.unscale_(opt)
    norm = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    # the clipped norm is the true one (no scale in it): the same model without a scaler
    with torch.autocast("cuda", dtype=torch.float16):
        nn.functional.cross_entropy(plain(x), y).backward()
    true = grad_norm(plain.parameters())
    assert abs(float(norm) / float(true) - 1) < 1e-2, (float(norm), float(true))
    assert float(scaled) > 100 * float(true), "the gradients were not scaled"
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
        f"clipped norm {float(norm):.4f} = unscaled {float(true):.4f} (scaled "
        f"{float(scaled):.3g}), inf step skipped, scale {scale:g} -> {scaler.get_scale():g}"
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
    n = torch.cuda.device_count()
    alone = " (one GPU: DataParallel calls the module itself)" if n == 1 else ""
    return f"{n} device(s), max abs diff {diff:.2e}{alone}"


@check("ddp_lab.syncbn on CUDA without a process group equals nn.BatchNorm2d")
def syncbn_single():
    from ddp_lab.syncbn import SyncBatchNorm

    torch.manual_seed(0)
    x = torch.randn(8, 4, 5, 5, device="cuda")
    ref, ours = nn.BatchNorm2d(4).cuda(), SyncBatchNorm(4).cuda()
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    a, b = ref(xa), ours(xb)
    w = torch.randn_like(a)
    (a * w).sum().backward()
    (b * w).sum().backward()
    assert torch.allclose(a, b, atol=1e-6), (a - b).abs().max().item()
    assert torch.allclose(xa.grad, xb.grad, atol=1e-5), (xa.grad - xb.grad).abs().max().item()
    assert torch.allclose(ref.running_var, ours.running_var, atol=1e-6)
    return "forward, input gradient and running stats equal"


def preflight() -> int:
    """Say what this Python has; print ``<GPUs> <model>`` for run.sh."""
    have = {m: importlib.util.find_spec(m) is not None for m in ("torchvision", "matplotlib")}
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    nccl = torch.cuda.nccl.version() if gpus else "-"  # a tuple, or an int in old torch
    nccl = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl
    import ddp_lab.train  # noqa: F401 - the trainer imports without the course's extras

    model = "resnet18" if have["torchvision"] else "cnn"
    print(
        f"gpu checks: Python {platform.python_version()}, torch {torch.__version__}, "
        f"CUDA {torch.version.cuda}, NCCL {nccl}; "
        + ", ".join(f"{m} {'yes' if ok else 'no'}" for m, ok in have.items())
        + f"; trainer and bench runs use the {model}"
        + ("" if have["torchvision"] else " (resnet18 needs torchvision)"),
        file=sys.stderr,
        flush=True,
    )
    print(gpus, model)
    return 0


def main() -> int:
    failed = 0
    for name, fn in CHECKS:
        try:
            print(f"PASS {name}: {fn()}", flush=True)
        except Exception as err:  # noqa: BLE001 - report and go on
            failed += 1
            print(f"FAIL {name}: {type(err).__name__}: {err}", flush=True)
            traceback.print_exc(limit=3)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(preflight() if "--preflight" in sys.argv[1:] else main())
