"""``make bench``: the trainer's throughput next to plain PyTorch, in the same run.

Four measurements, one after the other on the same machine, same model, same data, same
per-process batch:

1. ``plain-1``: a plain PyTorch loop (model, SGD, cross-entropy) over tensors in memory;
2. ``ddp_lab-1``: ``python -m ddp_lab.train`` (one process);
3. ``plain-ddp-N``: a plain PyTorch DDP script (``DistributedSampler``, ``DDP``) under
   torchrun with N processes;
4. ``ddp_lab-N``: ``torchrun -m ddp_lab.train`` with N processes.

It reports samples/s and the ratios that matter: trainer / plain at 1 and N processes
(the trainer's own overhead: data path, logging, loss all-reduce), and N / 1 (scaling).
Single times mean little on a shared machine; ratios taken minutes apart mean more, and
``--repeats`` takes the best of several. Results: ``results/bench/bench.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time

import torch

from ddp_lab.launch import torchrun, write_result

PROG = "ddp_lab.bench"


def plain_loop(model_name: str, steps: int, batch: int, warmup: int = 5) -> float:
    """Samples/s of a plain single-process PyTorch training loop on in-memory tensors."""
    from ddp_lab.models import build_model

    torch.manual_seed(0)
    model = build_model(model_name)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x = torch.randn(steps + warmup, batch, 3, 32, 32)
    y = torch.randint(0, 10, (steps + warmup, batch))
    for i in range(steps + warmup):
        if i == warmup:
            t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x[i]), y[i]).backward()
        opt.step()
    return steps * batch / (time.perf_counter() - t0)


def plain_ddp_worker(model_name: str, steps: int, batch: int, warmup: int = 5) -> None:
    """One rank of the plain DDP reference (run under torchrun); rank 0 writes samples/s."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from ddp_lab.models import build_model

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(build_model(model_name))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    n = (steps + warmup) * batch * world
    data = TensorDataset(torch.randn(n, 3, 32, 32), torch.randint(0, 10, (n,)))
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=batch, sampler=sampler, drop_last=True)
    for i, (x, y) in enumerate(loader):
        if i == warmup:
            t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    dist.barrier()
    write_result({"samples_per_s": steps * batch * world / (time.perf_counter() - t0)})
    gc.collect()  # see ddp_lab.dist.teardown
    dist.destroy_process_group()


def trainer(model_name: str, steps: int, batch: int, nproc: int) -> float:
    """Samples/s that ``ddp_lab.train`` reports for ``steps`` steps on ``nproc`` processes."""
    with tempfile.TemporaryDirectory() as out:
        args = [
            "--model",
            model_name,
            "--batch-size",
            str(batch),
            "--max-steps",
            str(steps),
            "--train-size",
            str((steps + 1) * batch * nproc),
            "--test-size",
            "64",
            "--backend",
            "gloo",
            "--out",
            out,
            "--no-progress",
        ]
        torchrun("ddp_lab.train", args, nproc=nproc, module=True, timeout=1800, stream=False)
        with open(os.path.join(out, "summary.json")) as f:
            return json.load(f)["samples_per_s"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="cnn")
    p.add_argument("--steps", type=int, default=60, help="timed steps per measurement")
    p.add_argument("--batch-size", type=int, default=32, help="per process")
    p.add_argument("--nproc", type=int, default=2, help="processes of the DDP runs")
    p.add_argument("--repeats", type=int, default=1, help="best of this many runs each")
    p.add_argument("--out", default="results/bench")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        plain_ddp_worker(args.model, args.steps, args.batch_size)
        return 0

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    m, s, b, n = args.model, args.steps, args.batch_size, args.nproc
    worker = [
        sys.executable,
        "-m",
        PROG,
        "--worker",
        "--model",
        m,
        "--steps",
        str(s),
        "--batch-size",
        str(b),
    ]
    runs = {
        "plain-1": lambda: plain_loop(m, s, b),
        "ddp_lab-1": lambda: trainer(m, s, b, 1),
        f"plain-ddp-{n}": lambda: torchrun(
            PROG, worker[3:], nproc=n, module=True, timeout=1800, stream=False
        ).result["samples_per_s"],
        f"ddp_lab-{n}": lambda: trainer(m, s, b, n),
    }
    results = {}
    for name, fn in runs.items():
        results[name] = max(fn() for _ in range(args.repeats))
        print(f"{PROG}: {name:<14} {results[name]:8.0f} samples/s", flush=True)
    ratios = {
        "ddp_lab-1 / plain-1": results["ddp_lab-1"] / results["plain-1"],
        f"ddp_lab-{n} / plain-ddp-{n}": results[f"ddp_lab-{n}"] / results[f"plain-ddp-{n}"],
        f"plain-ddp-{n} / plain-1": results[f"plain-ddp-{n}"] / results["plain-1"],
        f"ddp_lab-{n} / ddp_lab-1": results[f"ddp_lab-{n}"] / results["ddp_lab-1"],
    }
    for name, r in ratios.items():
        print(f"{PROG}: {name:<26} {r:5.2f}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench.json"), "w") as f:
        json.dump(
            {
                "model": m,
                "steps": s,
                "batch_per_process": b,
                "nproc": n,
                "device": "cuda" if torch.cuda.is_available() else "cpu",
                "samples_per_s": results,
                "ratios": ratios,
            },
            f,
            indent=2,
        )
    print(f"{PROG}: wrote {args.out}/bench.json", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
