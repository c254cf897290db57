"""One model trained four ways under torchrun: DDP, ZeRO-1 (torch's and yours), FSDP.

``torchrun --standalone --nproc_per_node=N -m ddp_lab.parallel.compare [--zero zero.py]``

Every rank draws its own batches (the same ones in every run); each run starts from the
same weights and takes ``--steps`` AdamW steps:

- ``ddp``: ``DistributedDataParallel`` and ``torch.optim.AdamW`` (every rank holds all);
- ``zero1 (torch)``: DDP and ``torch.distributed.optim.ZeroRedundancyOptimizer``, which gives
  each rank *whole parameters* to own (uneven when the parameters differ in size);
- ``zero (yours)``: with ``--zero FILE``, the ``ShardedAdamW`` of that file (lab 7, exercise 2)
  on the plain model, every rank's own gradients handed to it;
- ``fsdp``: ``torch.distributed.fsdp.fully_shard`` on every ``Linear`` and on the model
  (FSDP2: each parameter cut along its first dimension over the ranks, gathered for the
  forward and backward passes, freed afterwards; gradients reduce-scattered).

Rank 0 also trains the model alone on the concatenation of every rank's batches (the
oracle). The result (``ddp_lab.launch.write_result``) holds, per run: the largest
difference of the final weights from the oracle, and per rank the bytes of parameters,
gradients and optimizer state it holds after the last step (measured,
:mod:`ddp_lab.parallel.memory`), and the median time of a step. Runs on CPU with gloo or on
GPUs with NCCL (``--device cuda``; ``auto`` picks CUDA when there is a GPU); on GPUs it
also records each run's peak allocated memory.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ddp_lab.dist import setup, teardown
from ddp_lab.launch import write_result
from ddp_lab.parallel.memory import held_bytes, model_bytes, optimizer_bytes

PROG = "ddp_lab.parallel.compare"
LR = 1e-3


def build(width: int, layers: int, inputs: int = 64, classes: int = 10) -> nn.Sequential:
    """An MLP of ``layers`` Linear layers, ``width`` wide, with the same weights on every rank."""
    torch.manual_seed(0)
    dims = [inputs] + [width] * (layers - 1) + [classes]
    parts: list[nn.Module] = []
    for i in range(layers):
        parts.append(nn.Linear(dims[i], dims[i + 1]))
        if i < layers - 1:
            parts.append(nn.ReLU())
    return nn.Sequential(*parts)


def batches(rank: int, steps: int, batch: int, inputs: int = 64) -> list[tuple]:
    """Rank ``rank``'s batches: its own seed, so every run sees the same data."""
    g = torch.Generator().manual_seed(1000 + rank)
    return [
        (torch.randn(batch, inputs, generator=g), torch.randint(0, 10, (batch,), generator=g))
        for _ in range(steps)
    ]


def flat(model: nn.Module) -> torch.Tensor:
    """Every parameter, whole (a sharded one gathered), flattened, on the CPU."""
    out = []
    for p in model.parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out.append(full.detach().reshape(-1).cpu())
    return torch.cat(out)


def _student_class(path: str):
    spec = importlib.util.spec_from_file_location("student_zero", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ShardedAdamW


def _train(kind: str, args, device, data, zero_cls=None) -> dict:
    model = build(args.width, args.layers).to(device)
    if kind == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        net, opt = model, torch.optim.AdamW(model.parameters(), lr=LR)
    elif kind == "zero (yours)":
        net, opt = model, zero_cls(list(model.parameters()), lr=LR)
    else:
        from torch.nn.parallel import DistributedDataParallel

        net = DistributedDataParallel(model)
        if kind == "ddp":
            opt = torch.optim.AdamW(model.parameters(), lr=LR)
        else:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            opt = ZeroRedundancyOptimizer(
                model.parameters(), optimizer_class=torch.optim.AdamW, lr=LR
            )
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for x, y in data:
        start = time.perf_counter()
        for p in model.parameters():  # fresh gradients each step (kept after the last one)
            p.grad = None
        F.cross_entropy(net(x.to(device)), y.to(device)).backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    sizes = model_bytes(model)
    if kind == "zero (yours)":
        grads = [p.grad for p in model.parameters()]
        state = held_bytes(opt, exclude=[*model.parameters(), *grads])
    else:
        state = optimizer_bytes(opt)
    out = {
        **sizes,
        "optimizer": state,
        "ms_per_step": 1e3 * statistics.median(times[1:] or times),
        "weights": flat(model),
    }
    if device.type == "cuda":
        out["peak_allocated"] = torch.cuda.max_memory_allocated(device)
    return out


def oracle(args, world: int) -> torch.Tensor:
    """The model alone on every rank's batches together: its final weights."""
    model = build(args.width, args.layers)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    per_rank = [batches(r, args.steps, args.batch) for r in range(world)]
    for s in range(args.steps):
        x = torch.cat([b[s][0] for b in per_rank])
        y = torch.cat([b[s][1] for b in per_rank])
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return flat(model)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--width", type=int, default=256, help="hidden width of the MLP")
    p.add_argument("--layers", type=int, default=3, help="Linear layers")
    p.add_argument("--steps", type=int, default=10, help="AdamW steps per run")
    p.add_argument("--batch", type=int, default=16, help="samples per rank and step")
    p.add_argument("--zero", metavar="FILE", help="a zero.py holding your ShardedAdamW")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*ZeroRedundancyOptimizer.*")
    env = setup("gloo" if args.device == "cpu" else "auto", quiet=True)
    if not env.distributed:
        print(f"{PROG}: start it with torchrun (--nproc_per_node=2 or more)", file=sys.stderr)
        return 2
    device = env.device
    data = batches(env.rank, args.steps, args.batch)
    kinds = ["ddp", "zero1 (torch)", "fsdp"]
    zero_cls = None
    if args.zero and Path(args.zero).is_file():
        zero_cls = _student_class(args.zero)
        kinds.insert(2, "zero (yours)")
    want = oracle(args, env.world_size) if env.rank == 0 else None
    runs = {}
    for kind in kinds:
        got = _train(kind, args, device, data, zero_cls)
        weights = got.pop("weights")
        rows = [None] * env.world_size
        dist.all_gather_object(rows, got)
        if env.rank == 0:
            runs[kind] = {
                "max_abs_diff": float((weights - want).abs().max()),
                "ranks": rows,
            }
    n = sum(p.numel() for p in build(args.width, args.layers).parameters())
    write_result(
        {
            "world_size": env.world_size,
            "backend": env.backend,
            "device": str(device.type),
            "parameters": n,
            "numels": [p.numel() for p in build(args.width, args.layers).parameters()],
            "steps": args.steps,
            "runs": runs,
        }
    )
    if env.rank == 0:
        for kind, r in runs.items():
            mb = [sum(row[k] for k in ("params", "grads", "optimizer")) / 1e6 for row in r["ranks"]]
            print(
                f"{kind:>14}: max |w - w_alone| {r['max_abs_diff']:.1e}, per rank "
                + ", ".join(f"{v:.2f}" for v in mb)
                + " MB"
            )
    teardown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
