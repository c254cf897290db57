"""``make lab3``: lab 3's distributed workload on whatever this machine has.

On a GPU node it trains on every GPU with NCCL; on a CPU-only machine it runs 2 processes
with gloo. It trains on CIFAR-10 when the files are in ``--data-dir`` (or can be
downloaded), on the synthetic set otherwise, and says which and why. It also runs the
scaling sweep (1, 2, 4, ... processes up to every GPU; 1 and 2 on a CPU) and writes, under
``--out`` (default ``results/lab3``)::

    np1/ np2/ ...        each run's summary.json, metrics.jsonl, model.pt
    scaling.json         processes, samples/s, speed-up and efficiency per run
    scaling.png          the plot the lab03 notebook shows

Run it as ``make lab3`` (extra flags: ``make lab3 LAB3_ARGS="--model resnet18"``) or
``python -m ddp_lab.lab3 --help``. Multi-node runs go through ``cluster/lab3.sbatch``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from ddp_lab.data import choose_dataset
from ddp_lab.errors import UsageError, exit_on_usage_error
from ddp_lab.launch import LaunchError, torchrun

PROG = "ddp_lab.lab3"


def plan_hardware(max_procs: int | None = None) -> tuple[list[int], str, str]:
    """Process counts of the sweep, the backend, and why.

    Returns:
        ``(counts, backend, reason)``: ``[1, 2, 4, ..., n_gpus]`` with NCCL when CUDA GPUs
        are visible, ``[1, 2]`` with gloo otherwise; ``max_procs`` caps the counts.

    Example:
        >>> plan_hardware(max_procs=1)[0]
        [1]
    """
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus > 0:
        top, backend = gpus, "nccl"
        reason = f"found {gpus} CUDA GPU(s): one process per GPU with NCCL"
    else:
        top, backend = 2, "gloo"
        reason = "no CUDA GPU visible: 2 CPU processes with gloo"
    if max_procs is not None:
        top = min(top, max_procs)
    counts = sorted({2**i for i in range(top.bit_length()) if 2**i <= top} | {top})
    return counts, backend, reason


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        allow_abbrev=False,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", default="results/lab3", help="results folder")
    p.add_argument("--data-dir", default="data", help="where CIFAR-10 is (or goes)")
    p.add_argument(
        "--dataset",
        choices=["auto", "synthetic", "cifar10"],
        default="auto",
        help="auto: CIFAR-10 when present or downloadable, synthetic otherwise",
    )
    p.add_argument("--model", default=None, help="default: resnet18 on GPUs, cnn on the CPU")
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="per process (default: 128 on GPUs, 32 on the CPU)",
    )
    p.add_argument(
        "--max-steps",
        type=int,
        default=None,
        help="steps per sweep point (default: 200 on GPUs, one epoch on the CPU)",
    )
    p.add_argument("--train-size", type=int, default=10_000, help="synthetic training samples")
    p.add_argument("--max-procs", type=int, default=None, help="cap the process count")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per sweep point")
    return p


@exit_on_usage_error(PROG)
def main(argv: list[str] | None = None) -> int:
    """Plan, say the plan, run the sweep, write ``scaling.json`` and ``scaling.png``."""
    args = build_parser().parse_args(argv)
    counts, backend, hw_reason = plan_hardware(args.max_procs)
    gpu = backend == "nccl"
    if args.dataset == "auto":
        dataset, data_reason = choose_dataset(args.data_dir)
    else:
        dataset, data_reason = args.dataset, f"--dataset {args.dataset} asked for"
    model = args.model or ("resnet18" if gpu else "cnn")
    batch = args.batch_size or (128 if gpu else 32)
    steps = args.max_steps or (200 if gpu else None)
    print(f"{PROG}: {hw_reason}", flush=True)
    print(f"{PROG}: dataset {dataset}: {data_reason}", flush=True)
    print(
        f"{PROG}: model {model}, batch {batch} per process, sweep over {counts} "
        f"process(es); results in {args.out}/",
        flush=True,
    )

    os.makedirs(args.out, exist_ok=True)
    records = []
    for n in counts:
        out = os.path.join(args.out, f"np{n}")
        flags = [
            "--dataset",
            dataset,
            "--data-dir",
            args.data_dir,
            "--model",
            model,
            "--batch-size",
            str(batch),
            "--train-size",
            str(args.train_size),
            "--backend",
            backend,
            "--out",
            out,
            "--no-progress",
        ]
        if steps:
            flags += ["--max-steps", str(steps)]
        print(f"{PROG}: training with {n} process(es) ...", flush=True)
        try:
            torchrun(
                "ddp_lab.train", flags, nproc=n, module=True, timeout=args.timeout, stream=False
            )
        except LaunchError as err:
            raise UsageError(f"the {n}-process run failed: {err}") from None
        with open(os.path.join(out, "summary.json")) as f:
            s = json.load(f)
        records.append(
            {
                "processes": n,
                "samples_per_s": s["samples_per_s"],
                "seconds": s["seconds"],
                "accuracy": s["accuracy"],
                "steps": s["steps"],
            }
        )
        print(
            f"{PROG}:   {n} process(es): {s['samples_per_s']:.0f} samples/s, "
            f"test accuracy {s['accuracy']:.3f}, {s['seconds']:.1f} s",
            flush=True,
        )
    base = records[0]["samples_per_s"] / records[0]["processes"]
    for r in records:
        r["speedup"] = r["samples_per_s"] / records[0]["samples_per_s"]
        r["efficiency"] = r["samples_per_s"] / (base * r["processes"])
    where = "GPU" if gpu else "CPU"
    result = {
        "backend": backend,
        "device": where.lower(),
        "dataset": dataset,
        "model": model,
        "batch_per_process": batch,
        "hardware_reason": hw_reason,
        "dataset_reason": data_reason,
        "runs": records,
    }
    with open(os.path.join(args.out, "scaling.json"), "w") as f:
        json.dump(result, f, indent=2)
    from ddp_lab.figures.scaling import plot_scaling

    plot_scaling(
        [r["processes"] for r in records],
        [r["samples_per_s"] for r in records],
        title=f"{model} on {dataset}, {backend} ({where})",
        path=os.path.join(args.out, "scaling.png"),
    )
    top = records[-1]
    print(
        f"{PROG}: {top['processes']} process(es) ran at {top['speedup']:.2f}x the 1-process "
        f"throughput (efficiency {top['efficiency']:.0%}); see {args.out}/scaling.png",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
