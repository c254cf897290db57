"""``make lab5``: lab 5's workload, mixed precision and gradient accumulation, through the
trainer on every GPU of this node (or 2 CPU processes with gloo).

Four runs with the same data, seed and global batch:

    fp32          --amp off
    bf16          --amp bf16
    fp16+scaler   --amp fp16 (GradScaler: dynamic loss scale, inf steps skipped)
    fp32 accum 4  --amp off, a quarter of the per-process batch, --accum-steps 4

and, under ``--out`` (default ``results/lab5``)::

    <run>/               each run's summary.json, metrics.jsonl, events.jsonl, model.pt
    runs.json            per run: ms per optimizer step (and the ratio to fp32), samples/s,
                         final loss, accuracy, skipped steps, all-reduces per step, the
                         communication share; and the accumulation run's max abs weight
                         difference to fp32 (the same global batch: equal to rounding)
    lab5.png             loss curves and step times

On a CPU without fast fp16 kernels fp16 is correct but slow (the trainer says so). Run it as
``make lab5`` (extra flags: ``make lab5 LAB5_ARGS="--max-steps 100"``) or
``python -m ddp_lab.workloads.lab5 --help``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from ddp_lab.errors import UsageError, exit_on_usage_error
from ddp_lab.workloads.labrun import (
    dataset_for,
    lab_parser,
    plan_hardware,
    read_jsonl,
    read_summary,
    train,
    weight_difference,
)

PROG = "ddp_lab.workloads.lab5"


def runs(batch: int, accum: int) -> dict[str, list[str]]:
    """The four runs' trainer flags (same global batch), by label.

    Example:
        >>> runs(32, 4)["fp32 accum 4"]
        ['--amp', 'off', '--batch-size', '8', '--accum-steps', '4']
    """
    return {
        "fp32": ["--amp", "off", "--batch-size", str(batch)],
        "bf16": ["--amp", "bf16", "--batch-size", str(batch)],
        "fp16+scaler": ["--amp", "fp16", "--batch-size", str(batch)],
        f"fp32 accum {accum}": [
            "--amp",
            "off",
            "--batch-size",
            str(batch // accum),
            "--accum-steps",
            str(accum),
        ],
    }


def build_parser() -> argparse.ArgumentParser:
    p = lab_parser(PROG, __doc__, "results/lab5", "default: resnet18 on GPUs, mlp on the CPU")
    p.add_argument(
        "--batch-size", type=int, default=None, help="per process (default: 128 GPU, 32 CPU)"
    )
    p.add_argument("--accum-steps", type=int, default=4, help="micro-batches of the accum run")
    p.add_argument(
        "--max-steps", type=int, default=None, help="steps per run (default: 200 GPU, 60 CPU)"
    )
    return p


@exit_on_usage_error(PROG)
def main(argv: list[str] | None = None) -> int:
    """Plan, say the plan, run the four trainings, write ``runs.json`` and ``lab5.png``."""
    args = build_parser().parse_args(argv)
    counts, backend, hw_reason = plan_hardware(args.max_procs)
    nproc, gpu = counts[-1], backend == "nccl"
    dataset, data_reason = dataset_for(args)
    model = args.model or ("resnet18" if gpu else "mlp")
    batch = args.batch_size or (128 if gpu else 32)
    steps = args.max_steps or (200 if gpu else 60)
    if batch % args.accum_steps:
        raise UsageError(
            f"--batch-size {batch} is not divisible by --accum-steps {args.accum_steps}: the "
            "accumulation run must keep the global batch"
        )
    print(f"{PROG}: {hw_reason}; {nproc} process(es)", flush=True)
    print(f"{PROG}: dataset {dataset}: {data_reason}", flush=True)
    common = ["--dataset", dataset, "--data-dir", args.data_dir, "--model", model]
    common += ["--train-size", str(args.train_size), "--max-steps", str(steps)]
    common += ["--backend", backend, "--log-every", "5", "--no-progress", "--seed", "0"]
    os.makedirs(args.out, exist_ok=True)
    results, curves = {}, {}
    for label, flags in runs(batch, args.accum_steps).items():
        out = os.path.join(args.out, label.replace(" ", "_").replace("+", "_"))
        print(f"{PROG}: {label}: {' '.join(flags)} ...", flush=True)
        train(label, [*common, *flags, "--out", out], nproc, args.timeout)
        s = read_summary(out)
        records = read_jsonl(os.path.join(out, "metrics.jsonl"))
        later = records[1:] or records
        results[label] = {
            "flags": flags,
            "folder": out,
            "ms_per_step": 1000 * s["train_seconds"] / max(1, s["steps"] - 1),
            "samples_per_s": s["samples_per_s"],
            "final_loss": s["final_loss"],
            "accuracy": s["accuracy"],
            "skipped_steps": sum(r.get("skipped", 0) for r in records),
            "allreduces_per_step": sum(r["allreduces_per_step"] for r in later) / len(later),
            "comm_share": sum(r["comm_share"] for r in later) / len(later),
        }
        curves[label] = ([r["step"] for r in records], [r["loss"] for r in records])
        r = results[label]
        print(
            f"{PROG}:   {r['ms_per_step']:.1f} ms/step, {r['samples_per_s']:.0f} samples/s, "
            f"final loss {r['final_loss']:.3f}, accuracy {r['accuracy']:.3f}, "
            f"{r['allreduces_per_step']:.2f} all-reduces/step",
            flush=True,
        )
    base = results["fp32"]["ms_per_step"]
    for r in results.values():
        r["step_time_vs_fp32"] = r["ms_per_step"] / base
    accum_label = f"fp32 accum {args.accum_steps}"
    _, diff = weight_difference(results["fp32"]["folder"], results[accum_label]["folder"])
    where = "GPU" if gpu else "CPU"
    summary = {
        "backend": backend,
        "device": where.lower(),
        "processes": nproc,
        "dataset": dataset,
        "model": model,
        "global_batch": batch * nproc,
        "hardware_reason": hw_reason,
        "dataset_reason": data_reason,
        "accumulation_max_abs_diff_vs_fp32": diff,
        "runs": results,
    }
    with open(os.path.join(args.out, "runs.json"), "w") as f:
        json.dump(summary, f, indent=2)
    from ddp_lab.figures.lab05_runs import lab5_runs

    fig = lab5_runs(
        curves,
        {k: v["ms_per_step"] for k, v in results.items()},
        f"{model} on {dataset}, {nproc} x {batch} per step, {backend} ({where})",
    )
    fig.savefig(os.path.join(args.out, "lab5.png"), dpi=100)
    ratios = ", ".join(f"{k} {v['step_time_vs_fp32']:.2f}x" for k, v in results.items())
    print(f"{PROG}: step time vs fp32: {ratios}", flush=True)
    print(
        f"{PROG}: accumulation {args.accum_steps} vs one batch of the same size: max abs "
        f"weight difference {diff:.2g}; see {args.out}/lab5.png",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
