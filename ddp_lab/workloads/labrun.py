"""What every ``make labN`` run shares: the hardware plan, the common flags, one trainer run
through torchrun, the comparison of two runs' weights, and the model's size as the trainer
will say it.

``ddp_lab.workloads.lab3`` (the scaling sweep), ``ddp_lab.workloads.lab5`` (number formats
and accumulation) and ``ddp_lab.workloads.lab6`` (a fault and its restart) each add their own
flags and runs on top.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex

import torch

from ddp_lab import options as train_options
from ddp_lab.data import choose_dataset, cifar10_present
from ddp_lab.errors import UsageError
from ddp_lab.launch import LaunchError, LaunchResult, torchrun
from ddp_lab.options import DATASETS, build_parser
from ddp_lab.text import make_text_datasets

#: Training images of CIFAR-10.
CIFAR10_TRAIN = 50_000


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
        choices=["auto", *DATASETS],
        default="auto",
        help="auto: text for --model gpt (Python's documentation as byte tokens); else "
        "CIFAR-10 when present or downloadable, synthetic otherwise",
    )
    p.add_argument("--model", default=None, help=model_help)
    p.add_argument("--train-size", type=int, default=10_000, help="synthetic training samples")
    p.add_argument("--max-procs", type=int, default=None, help="cap the process count")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    return p


def dataset_for(
    args: argparse.Namespace, data_dir: str | None = None, no_download: str | None = None
) -> tuple[str, str]:
    """``(dataset, why)``: ``--dataset`` when given; the text for ``--model gpt``; else
    CIFAR-10 when present in ``data_dir`` (default ``args.data_dir``) or downloadable (not
    tried when ``no_download`` names the flag that forbids it), else the synthetic set."""
    data_dir = data_dir or args.data_dir
    if args.dataset != "auto":
        return args.dataset, f"--dataset {args.dataset} asked for"
    if args.model == "gpt":
        return "text", (
            "--model gpt trains on Python's own documentation (pydoc_data.topics, about "
            "465 KB of English) as byte tokens: nothing to download"
        )
    if no_download and not cifar10_present(data_dir):
        return "synthetic", (
            f"CIFAR-10 is not in {data_dir!r} ({no_download}: no download tried); using the "
            "generated CIFAR-shaped set instead"
        )
    return choose_dataset(data_dir)


def training_samples(dataset: str, train_size: int) -> int:
    """Samples in one epoch of ``dataset`` (a warm-up's length depends on it).

    Example:
        >>> training_samples("synthetic", 10_000), training_samples("cifar10", 10_000)
        (10000, 50000)
    """
    if dataset == "cifar10":
        return CIFAR10_TRAIN
    if dataset == "text":  # sequences of the trainer's default --seq-len, at most train_size
        seq_len = build_parser().get_default("seq_len")
        return len(make_text_datasets(dataset, seq_len, train_size, 1)[0])
    return train_size


def perplexity(run: dict) -> str:
    """``" (perplexity P)"`` for a run on text (next-token accuracy alone says little),
    else nothing.

    Example:
        >>> perplexity({"perplexity": 9.87}), perplexity({})
        (' (perplexity 9.87)', '')
    """
    return f" (perplexity {run['perplexity']:.2f})" if "perplexity" in run else ""


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


def model_size(model: str, dataset: str) -> str:
    """What the trainer will build, as its first line says it (``gpt (2 layers x 4 heads,
    width 128, 64 tokens; 0.47 M parameters)``), with ``$DDP_LAB_TRAIN_ARGS`` applied."""
    from ddp_lab.models import build_model

    extra = shlex.split(os.environ.get("DDP_LAB_TRAIN_ARGS", ""))
    cfg = train_options.parse_args(["--model", model, "--dataset", dataset, *extra])
    return train_options.describe_model(cfg, build_model(cfg.model, train_options.gpt_config(cfg)))
