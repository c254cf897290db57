"""The trainer's command line: every flag with its help, the options dataclass, and the
checks that turn a bad value or an impossible combination into one line naming the fix.

``python -m ddp_lab.train --help`` prints it; :func:`parse_args` returns a :class:`Config`.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass

import torch

from ddp_lab.dist import DEFAULT_TIMEOUT_S, DistEnv, print0
from ddp_lab.errors import UsageError
from ddp_lab.faults import KINDS
from ddp_lab.gpt import GPTConfig
from ddp_lab.models import MODELS
from ddp_lab.profiling import parse_schedule
from ddp_lab.text import TEXT_DATASETS

PROG = "ddp_lab.train"
#: Data sets of images (for mlp, cnn, resnet18) and all of them.
IMAGE_DATASETS = ("synthetic", "cifar10")
DATASETS = IMAGE_DATASETS + TEXT_DATASETS

#: Flags that only make sense with ``--ckpt-dir``.
NEED_CKPT_DIR = {
    "ckpt_every": "--ckpt-every",
    "resume": "--resume",
    "rollback_drop": "--rollback-drop",
}


def build_parser() -> argparse.ArgumentParser:
    """The trainer's command line. ``allow_abbrev=False``: only whole flag names count."""
    p = argparse.ArgumentParser(
        prog=PROG,
        allow_abbrev=False,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Train a model with DistributedDataParallel (under torchrun) or in one "
        "process (plain python). --batch-size is per process: the global batch is "
        "batch-size x processes x accum-steps.",
    )
    d = p.add_argument_group("data")
    d.add_argument(
        "--dataset",
        choices=DATASETS,
        default=None,
        help="synthetic: generated, CIFAR-shaped, no download; cifar10: from --data-dir, "
        "downloaded when missing and online; text: Python's own documentation "
        "(pydoc_data.topics) as byte tokens, for --model gpt; tokens: a seeded synthetic "
        "token stream (tests). Default: text for --model gpt, synthetic otherwise",
    )
    d.add_argument("--data-dir", default="data", help="folder holding cifar-10-batches-py")
    d.add_argument(
        "--train-size",
        type=int,
        default=10_000,
        help="synthetic and tokens: training samples; text: at most this many sequences",
    )
    d.add_argument(
        "--test-size",
        type=int,
        default=2_000,
        help="synthetic and tokens: test samples; text: at most this many sequences",
    )
    d.add_argument(
        "--num-workers",
        type=int,
        default=None,
        help="DataLoader workers per process (default: 4 on CUDA, 0 on CPU)",
    )

    o = p.add_argument_group("model and optimisation")
    o.add_argument(
        "--model",
        choices=MODELS,
        default="mlp",
        help="mlp, cnn, resnet18: images; gpt: a small decoder-only transformer (text)",
    )
    o.add_argument("--epochs", type=int, default=1)
    o.add_argument(
        "--max-steps", type=int, default=None, help="stop after this many optimizer steps in total"
    )
    o.add_argument("--batch-size", type=int, default=32, help="samples per step per process")
    o.add_argument("--lr", type=float, default=0.05, help="learning rate actually used")
    o.add_argument(
        "--scale-lr",
        action="store_true",
        help="linear scaling rule: use lr x processes x accum-steps",
    )
    o.add_argument("--momentum", type=float, default=0.9)
    o.add_argument("--weight-decay", type=float, default=0.0)
    o.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seeds weights and shuffling; same seed and flags, same model.pt",
    )
    o.add_argument(
        "--sync-bn",
        action="store_true",
        help="synchronise BatchNorm statistics across processes (nn.SyncBatchNorm "
        "on CUDA, ddp_lab.syncbn on the CPU)",
    )
    o.add_argument(
        "--amp",
        choices=["off", "bf16", "fp16"],
        default="off",
        help="mixed precision: bf16 autocast, or fp16 autocast with a GradScaler (dynamic "
        "loss scaling, inf steps skipped); both on the CPU and on CUDA. A CPU without fast "
        "bf16/fp16 kernels runs them correctly but slowly (said in one line on start)",
    )
    o.add_argument(
        "--accum-steps",
        type=int,
        default=1,
        help="micro-batches per optimizer step (gradient accumulation)",
    )
    o.add_argument(
        "--clip-grad-norm",
        type=float,
        default=None,
        help="clip the global gradient norm to this value (the seeds use 1.0); with fp16 the "
        "gradients are unscaled first",
    )
    o.add_argument(
        "--warmup-steps",
        type=int,
        default=0,
        help="linear learning-rate warm-up: optimizer step k <= N uses k/N of the rate "
        "(the scaled rate with --scale-lr); 0: no warm-up",
    )
    o.add_argument(
        "--grad-norm-warn",
        type=float,
        default=10.0,
        help="flag a record (grad_norm_warn) and warn on stderr (rank 0, at most every 10 s) "
        "when the gradient norm before clipping exceeded this; checked every step when "
        "clipping (the norm is free then), at records otherwise; 0: off",
    )

    g = p.add_argument_group(
        "the transformer (--model gpt)", "Defaults train in about a minute on 2 CPU cores."
    )
    g.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    g.add_argument("--width", type=int, default=128, help="embedding width (a multiple of --heads)")
    g.add_argument("--heads", type=int, default=4, help="attention heads per block")
    g.add_argument("--layers", type=int, default=2, help="transformer blocks")

    c = p.add_argument_group(
        "checkpoints and faults",
        "Checkpoints hold everything a bit-identical resume needs (model, optimizer, scaler, "
        "LR schedule, epoch and position in it, every rank's RNG states, data order); rank 0 "
        "writes them atomically with a checksum. Resuming on another number of processes "
        "re-shards the rest of the epoch: no sample is read twice or skipped.",
    )
    c.add_argument(
        "--ckpt-dir",
        default=None,
        help="folder for checkpoints ckpt-<step>.pt (written by rank 0; every rank reads it)",
    )
    c.add_argument(
        "--ckpt-every",
        type=int,
        default=None,
        help="checkpoint every N optimizer steps (None: at every epoch end)",
    )
    c.add_argument(
        "--ckpt-format",
        choices=["file", "dcp"],
        default="file",
        help="file: one checksummed file per checkpoint, written by rank 0; dcp: a folder "
        "written by every rank through torch.distributed.checkpoint (its share of the "
        "tensors; loads at another world size, also when sharded). --resume reads either",
    )
    c.add_argument(
        "--keep-last",
        type=int,
        default=3,
        help="checkpoints kept (the newest ones; the best one for --rollback-drop stays too)",
    )
    c.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest valid checkpoint in --ckpt-dir when there is one "
        "(a corrupt newest one is reported and the previous one used), else start fresh; "
        "use it under torchrun --max-restarts",
    )
    c.add_argument(
        "--rollback-drop",
        type=float,
        default=None,
        help="evaluate at every checkpoint; when test accuracy falls more than this many "
        "percentage points below the best checkpoint's, restore that checkpoint's weights, "
        "optimizer and scaler (the step count and the data go on) and flag it in the "
        "metrics (the seeds use 5)",
    )
    c.add_argument(
        "--fail-at-step",
        type=int,
        default=None,
        help="fault injection: fail once at this global step, on the first attempt only "
        "(TORCHELASTIC_RESTART_COUNT 0: a restarted group does not fail again)",
    )
    c.add_argument(
        "--fault",
        choices=list(KINDS),
        default="raise",
        help="how --fail-at-step fails: " + "; ".join(f"{k}: {v}" for k, v in KINDS.items()),
    )
    c.add_argument(
        "--fail-rank",
        type=int,
        default=None,
        help="the rank that fails at --fail-at-step (None: the last rank)",
    )

    r = p.add_argument_group("runtime and outputs")
    r.add_argument(
        "--backend",
        choices=["auto", "nccl", "gloo"],
        default="auto",
        help="auto: nccl when CUDA GPUs are visible, gloo otherwise",
    )
    r.add_argument(
        "--pg-timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help="seconds a collective may wait before the job fails (instead of hanging): the "
        "error names the rank, the collective and the step, and the ranks that never "
        "arrived; lab 6 uses 10-30 s",
    )
    r.add_argument(
        "--tensorboard",
        metavar="DIR",
        default=None,
        help="write TensorBoard scalars to DIR (rank 0)",
    )
    r.add_argument(
        "--out", default="runs/train", help="folder for summary.json, metrics.jsonl and model.pt"
    )
    r.add_argument(
        "--log-every",
        type=int,
        default=10,
        help="write a metrics record (loss averaged over the steps since the last record "
        "and over ranks, lr, grad norm, samples/s) every N optimizer steps and on the last "
        "step; between records a step costs no host sync and no extra collective (1: every "
        "step, as a debugging aid)",
    )
    r.add_argument(
        "--profile",
        metavar="DIR",
        default=None,
        help="torch.profiler over a few steps (--profile-steps): every rank's trace as "
        "Chrome trace JSON in DIR (Perfetto, TensorBoard), with ranges for data, forward, "
        "backward, each DDP bucket's all-reduce and the optimizer step; memory too",
    )
    r.add_argument(
        "--profile-steps",
        metavar="WAIT,WARMUP,ACTIVE",
        default="2,1,3",
        help="optimizer steps the profiler skips, warms up on (recorded, thrown away) and keeps",
    )
    r.add_argument(
        "--host-memory",
        choices=["keep", "release"],
        default="keep",
        help="keep: the C library keeps host memory freed in a step for the next step "
        "(glibc's mallopt; ddp_lab.hostmem); release: glibc's defaults, which hand freed "
        "activations back to the kernel and fault them in again every step (on the CPU "
        "thousands of page faults per step and rank, slower; the same weights)",
    )
    r.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    r.add_argument(
        "--dry-run",
        action="store_true",
        help="check the flags and the environment, print the configuration, exit",
    )
    return p


@dataclass
class Config:
    """The trainer's options (the parsed command line)."""

    dataset: str
    data_dir: str
    train_size: int
    test_size: int
    num_workers: int | None
    model: str
    epochs: int
    max_steps: int | None
    batch_size: int
    lr: float
    scale_lr: bool
    momentum: float
    weight_decay: float
    seed: int
    sync_bn: bool
    amp: str
    accum_steps: int
    clip_grad_norm: float | None
    warmup_steps: int
    grad_norm_warn: float
    seq_len: int
    width: int
    heads: int
    layers: int
    ckpt_dir: str | None
    ckpt_every: int | None
    ckpt_format: str
    keep_last: int
    resume: bool
    rollback_drop: float | None
    fail_at_step: int | None
    fault: str
    fail_rank: int | None
    backend: str
    pg_timeout: float
    tensorboard: str | None
    out: str
    log_every: int
    profile: str | None
    profile_steps: str
    host_memory: str
    no_progress: bool
    dry_run: bool


def parse_args(argv: list[str] | None = None) -> Config:
    """Parse and validate the command line.

    Raises:
        UsageError: a value out of range, or a flag whose feature is not available yet.
    """
    cfg = Config(**vars(build_parser().parse_args(argv)))
    if cfg.dataset is None:
        cfg.dataset = "text" if cfg.model == "gpt" else "synthetic"
    if (cfg.model == "gpt") != (cfg.dataset in TEXT_DATASETS):
        fix = (
            "--dataset text (or tokens)"
            if cfg.model == "gpt"
            else f"--model gpt, or an image set (--dataset {' or '.join(IMAGE_DATASETS)})"
        )
        raise UsageError(
            f"--model {cfg.model} cannot train on --dataset {cfg.dataset} "
            f"({'tokens' if cfg.model == 'gpt' else 'images'} in, "
            f"{'images' if cfg.model == 'gpt' else 'tokens'} given); use {fix}"
        )
    for name, flag in NEED_CKPT_DIR.items():
        if getattr(cfg, name) not in (None, False) and cfg.ckpt_dir is None:
            raise UsageError(f"{flag} needs --ckpt-dir DIR (where checkpoints are written)")
    if cfg.ckpt_format != "file" and cfg.ckpt_dir is None:
        raise UsageError("--ckpt-format needs --ckpt-dir DIR (where checkpoints are written)")
    positive = {
        "--epochs": cfg.epochs,
        "--batch-size": cfg.batch_size,
        "--accum-steps": cfg.accum_steps,
        "--train-size": cfg.train_size,
        "--test-size": cfg.test_size,
        "--log-every": cfg.log_every,
        "--seq-len": cfg.seq_len,
        "--width": cfg.width,
        "--heads": cfg.heads,
        "--layers": cfg.layers,
    }
    optional = {
        "--max-steps": cfg.max_steps,
        "--ckpt-every": cfg.ckpt_every,
        "--keep-last": cfg.keep_last,
        "--fail-at-step": cfg.fail_at_step,
    }
    positive.update({flag: v for flag, v in optional.items() if v is not None})
    for flag, value in positive.items():
        if value <= 0:
            raise UsageError(f"{flag} must be a positive integer, got {value}")
    if not (cfg.lr > 0 and math.isfinite(cfg.lr)):
        raise UsageError(f"--lr must be a positive number, got {cfg.lr}")
    if cfg.clip_grad_norm is not None and not cfg.clip_grad_norm > 0:
        raise UsageError(f"--clip-grad-norm must be positive, got {cfg.clip_grad_norm}")
    if cfg.rollback_drop is not None and not (
        cfg.rollback_drop > 0 and math.isfinite(cfg.rollback_drop)
    ):
        raise UsageError(f"--rollback-drop must be positive (points), got {cfg.rollback_drop}")
    if cfg.fail_rank is not None and cfg.fail_rank < 0:
        raise UsageError(f"--fail-rank must be >= 0, got {cfg.fail_rank}")
    if cfg.warmup_steps < 0:
        raise UsageError(f"--warmup-steps must be >= 0, got {cfg.warmup_steps}")
    if not (cfg.grad_norm_warn >= 0 and math.isfinite(cfg.grad_norm_warn)):
        raise UsageError(f"--grad-norm-warn must be >= 0 (0: off), got {cfg.grad_norm_warn}")
    if cfg.num_workers is not None and cfg.num_workers < 0:
        raise UsageError(f"--num-workers must be >= 0, got {cfg.num_workers}")
    if cfg.width % cfg.heads:
        raise UsageError(f"--width {cfg.width} must be a multiple of --heads {cfg.heads}")
    try:
        parse_schedule(cfg.profile_steps)
    except ValueError as err:
        raise UsageError(f"--profile-steps: {err}") from None
    return cfg


def gpt_config(cfg: Config) -> GPTConfig:
    """The transformer's size from ``--seq-len``, ``--width``, ``--heads`` and ``--layers``."""
    return GPTConfig(seq_len=cfg.seq_len, width=cfg.width, heads=cfg.heads, layers=cfg.layers)


def describe_model(cfg: Config, model: torch.nn.Module) -> str:
    """The model's name and size, for the trainer's first line.

    Example:
        >>> cfg = parse_args(["--model", "gpt", "--layers", "1", "--width", "32"])
        >>> from ddp_lab.models import build_model
        >>> describe_model(cfg, build_model("gpt", gpt_config(cfg)))
        'gpt (1 layers x 4 heads, width 32, 64 tokens; 0.03 M parameters)'
    """
    size = sum(p.numel() for p in model.parameters()) / 1e6
    if cfg.model != "gpt":
        return f"{cfg.model} ({size:.2f} M parameters)"
    return (
        f"gpt ({cfg.layers} layers x {cfg.heads} heads, width {cfg.width}, {cfg.seq_len} "
        f"tokens; {size:.2f} M parameters)"
    )


def check_environment(cfg: Config, env: DistEnv) -> None:
    """Refuse combinations this machine cannot run (with the fix in the message), and say in
    one line when a choice runs correctly but slowly here (fp16 or bf16 on an older CPU)."""
    if cfg.fail_at_step is not None and cfg.fault == "hang" and not env.distributed:
        raise UsageError(
            "--fault hang needs 2 or more processes (the others time out after "
            "--pg-timeout); one process alone would wait forever: start it with torchrun"
        )
    if cfg.fail_rank is not None and cfg.fail_rank >= env.world_size:
        raise UsageError(
            f"--fail-rank {cfg.fail_rank} does not exist in a job of {env.world_size} "
            f"process(es); use 0 .. {env.world_size - 1}"
        )
    if cfg.amp != "off" and env.device.type == "cpu" and not fast_cpu_amp(cfg.amp):
        print0(
            f"{PROG}: note: this CPU has no fast {cfg.amp} kernels (oneDNN reports none); "
            f"--amp {cfg.amp} is correct but slower than fp32 here",
            env=env,
            file=sys.stderr,
        )


def fast_cpu_amp(dtype: str) -> bool:
    """True when oneDNN has fast kernels for ``dtype`` (``"bf16"`` or ``"fp16"``) on this
    CPU (AVX512-BF16/AMX for bf16, AVX512-FP16/AMX-FP16 for fp16). A cheap query, no timing.

    Example:
        >>> fast_cpu_amp("bf16") in (True, False)
        True
    """
    query = {
        "bf16": "_is_mkldnn_bf16_supported",
        "fp16": "_is_mkldnn_fp16_supported",
    }[dtype]
    try:
        return bool(getattr(torch.ops.mkldnn, query)())
    except (AttributeError, RuntimeError):
        return True  # unknown: say nothing rather than something wrong
