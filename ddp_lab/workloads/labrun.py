"""What every ``make labN`` run shares: the hardware plan, the common flags, one trainer run
through torchrun, and the comparison of two runs' weights.

``ddp_lab.workloads.lab3`` (the scaling sweep), ``ddp_lab.workloads.lab5`` (number formats
and accumulation) and ``ddp_lab.workloads.lab6`` (a fault and its restart) each add their own
flags and runs on top.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from ddp_lab.data import choose_dataset
from ddp_lab.errors import UsageError
from ddp_lab.launch import LaunchError, LaunchResult, torchrun


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


def lab_parser(
    prog: str, doc: str | None, out: str | None, model_help: str, out_help: str | None = None
) -> argparse.ArgumentParser:
    """A lab run's parser with the flags every lab run has: ``--out`` (default ``out``),
    ``--data-dir``, ``--dataset``, ``--model``, ``--train-size``, ``--max-procs``,
    ``--timeout``.

    Example:
        >>> p = lab_parser("ddp_lab.labX", None, "results/labX", "default: mlp")
        >>> a = p.parse_args(["--max-procs", "1"])
        >>> a.out, a.dataset, a.max_procs, a.timeout
        ('results/labX', 'auto', 1, 1800)
    """
    p = argparse.ArgumentParser(
        prog=prog,
        allow_abbrev=False,
        description=doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", default=out, help=out_help or f"results folder (default: {out})")
    p.add_argument("--data-dir", default="data", help="where CIFAR-10 is (or goes)")
    p.add_argument(
        "--dataset",
        choices=["auto", "synthetic", "cifar10"],
        default="auto",
        help="auto: CIFAR-10 when present or downloadable, synthetic otherwise",
    )
    p.add_argument("--model", default=None, help=model_help)
    p.add_argument("--train-size", type=int, default=10_000, help="synthetic training samples")
    p.add_argument("--max-procs", type=int, default=None, help="cap the process count")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    return p


def dataset_for(args: argparse.Namespace) -> tuple[str, str]:
    """``(dataset, why)``: ``--dataset`` when given, else CIFAR-10 when present or
    downloadable, else the synthetic set."""
    if args.dataset != "auto":
        return args.dataset, f"--dataset {args.dataset} asked for"
    return choose_dataset(args.data_dir)


def train(
    label: str, flags: list[str], nproc: int, timeout: float, max_restarts: int = 0
) -> LaunchResult:
    """``torchrun -m ddp_lab.train FLAGS`` on ``nproc`` processes, quietly; a failed run
    becomes a one-line :class:`UsageError` that names it."""
    try:
        return torchrun(
            "ddp_lab.train",
            flags,
            nproc=nproc,
            module=True,
            timeout=timeout,
            max_restarts=max_restarts,
            stream=False,
        )
    except LaunchError as err:
        raise UsageError(f"the {label} run failed: {err}") from None


def read_summary(out: str) -> dict:
    """The trainer's ``summary.json`` in ``out``."""
    with open(os.path.join(out, "summary.json")) as f:
        return json.load(f)


def read_jsonl(path: str) -> list[dict]:
    """The records of a JSON-lines file (the trainer's metrics or events)."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def weight_difference(out_a: str, out_b: str) -> tuple[bool, float]:
    """``(bit_identical, max_abs_difference)`` of two runs' final weights (``model.pt``)."""
    a = torch.load(os.path.join(out_a, "model.pt"), weights_only=True)
    b = torch.load(os.path.join(out_b, "model.pt"), weights_only=True)
    identical = all(torch.equal(a[k], b[k]) for k in a)
    diff = max((a[k].double() - b[k].double()).abs().max().item() for k in a)
    return identical, diff
