"""The course trainer: one readable loop where every distributed concern is a line.

Run it on every GPU of a node, on CPU processes, or as one plain process::

    torchrun --standalone --nproc_per_node=2 -m ddp_lab.train --model mlp --epochs 1
    python -m ddp_lab.train --model mlp --epochs 1        # one process, says so on start

Outputs land in ``--out``: ``summary.json`` (final loss, accuracy, steps, world size,
samples/s, seconds), ``metrics.jsonl`` (one record per optimizer step, from rank 0) and
``model.pt`` (the final state dict of the unwrapped model). ``--help`` lists every flag.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_lab import data as data_mod
from ddp_lab.dist import (
    DEFAULT_TIMEOUT_S,
    CommMeter,
    DistEnv,
    all_reduce_sum,
    ddp_bucket_count,
    print0,
    setup,
    teardown,
)
from ddp_lab.errors import UsageError, exit_on_usage_error
from ddp_lab.models import MODELS, build_model, has_batchnorm
from ddp_lab.syncbn import convert_sync_batchnorm_auto

PROG = "ddp_lab.train"

#: Flags whose feature arrives with a later lab; given, they stop the run with a clear line.
NOT_YET = {
    "ckpt_dir": "--ckpt-dir (checkpoints arrive with lab06)",
    "ckpt_every": "--ckpt-every (checkpoints arrive with lab06)",
    "keep_last": "--keep-last (checkpoints arrive with lab06)",
    "resume": "--resume (elastic restarts arrive with lab06)",
    "rollback_drop": "--rollback-drop (rollback arrives with lab06)",
    "fail_at_step": "--fail-at-step (fault injection arrives with lab06)",
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
        choices=["synthetic", "cifar10"],
        default="synthetic",
        help="synthetic: generated, CIFAR-shaped, no download; cifar10: from "
        "--data-dir, downloaded when missing and online",
    )
    d.add_argument("--data-dir", default="data", help="folder holding cifar-10-batches-py")
    d.add_argument("--train-size", type=int, default=10_000, help="synthetic training samples")
    d.add_argument("--test-size", type=int, default=2_000, help="synthetic test samples")
    d.add_argument(
        "--num-workers",
        type=int,
        default=None,
        help="DataLoader workers per process (default: 4 on CUDA, 0 on CPU)",
    )

    o = p.add_argument_group("model and optimisation")
    o.add_argument("--model", choices=MODELS, default="mlp")
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

    c = p.add_argument_group("checkpoints and faults")
    c.add_argument("--ckpt-dir", default=None, help="where checkpoints are written")
    c.add_argument("--ckpt-every", type=int, default=None, help="checkpoint every N steps")
    c.add_argument("--keep-last", type=int, default=None, help="checkpoints to keep")
    c.add_argument("--resume", action="store_true", help="resume from the newest checkpoint")
    c.add_argument(
        "--rollback-drop",
        type=float,
        default=None,
        help="restore the best checkpoint when accuracy drops by more than this",
    )
    c.add_argument(
        "--fail-at-step",
        type=int,
        default=None,
        help="fault injection: one rank raises once at this global step",
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
        help="seconds a collective may wait before the job fails (not hangs)",
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
    ckpt_dir: str | None
    ckpt_every: int | None
    keep_last: int | None
    resume: bool
    rollback_drop: float | None
    fail_at_step: int | None
    backend: str
    pg_timeout: float
    tensorboard: str | None
    out: str
    log_every: int
    no_progress: bool
    dry_run: bool


def parse_args(argv: list[str] | None = None) -> Config:
    """Parse and validate the command line.

    Raises:
        UsageError: a value out of range, or a flag whose feature is not available yet.
    """
    cfg = Config(**vars(build_parser().parse_args(argv)))
    for name, what in NOT_YET.items():
        value = getattr(cfg, name)
        if value not in (None, False):
            raise UsageError(f"{what} is not available yet in this version of ddp_lab")
    positive = {
        "--epochs": cfg.epochs,
        "--batch-size": cfg.batch_size,
        "--accum-steps": cfg.accum_steps,
        "--train-size": cfg.train_size,
        "--test-size": cfg.test_size,
        "--log-every": cfg.log_every,
    }
    if cfg.max_steps is not None:
        positive["--max-steps"] = cfg.max_steps
    for flag, value in positive.items():
        if value <= 0:
            raise UsageError(f"{flag} must be a positive integer, got {value}")
    if not (cfg.lr > 0 and math.isfinite(cfg.lr)):
        raise UsageError(f"--lr must be a positive number, got {cfg.lr}")
    if cfg.clip_grad_norm is not None and not cfg.clip_grad_norm > 0:
        raise UsageError(f"--clip-grad-norm must be positive, got {cfg.clip_grad_norm}")
    if cfg.warmup_steps < 0:
        raise UsageError(f"--warmup-steps must be >= 0, got {cfg.warmup_steps}")
    if not (cfg.grad_norm_warn >= 0 and math.isfinite(cfg.grad_norm_warn)):
        raise UsageError(f"--grad-norm-warn must be >= 0 (0: off), got {cfg.grad_norm_warn}")
    if cfg.num_workers is not None and cfg.num_workers < 0:
        raise UsageError(f"--num-workers must be >= 0, got {cfg.num_workers}")
    return cfg


def check_environment(cfg: Config, env: DistEnv) -> None:
    """Refuse combinations this machine cannot run (with the fix in the message), and say in
    one line when a choice runs correctly but slowly here (fp16 or bf16 on an older CPU)."""
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


def wrap_model(model: torch.nn.Module, cfg: Config, env: DistEnv) -> torch.nn.Module:
    """Move the model to its device, convert BatchNorm when asked, and wrap it in DDP."""
    if cfg.sync_bn and has_batchnorm(model):
        # nn.SyncBatchNorm on CUDA; ddp_lab's own on the CPU (nn.SyncBatchNorm refuses it).
        model = convert_sync_batchnorm_auto(model, env.device)
    model = model.to(env.device)
    if env.distributed:
        device_ids = [env.local_rank] if env.device.type == "cuda" else None
        model = DDP(model, device_ids=device_ids)
    return model


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The plain module inside a DDP wrapper (or the model itself)."""
    return model.module if isinstance(model, DDP) else model


def sync_buffers(model: torch.nn.Module, env: DistEnv) -> None:
    """Give every rank rank 0's buffers (BatchNorm running statistics), as DDP does."""
    if env.distributed:
        for buf in unwrap(model).buffers():
            dist.broadcast(buf, src=0)


def save_atomic(obj, path: str) -> None:
    """``torch.save`` to a temporary file, then rename: a crash never leaves half a file."""
    tmp = f"{path}.tmp-{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _autocast(cfg: Config, env: DistEnv):
    if cfg.amp == "off":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if cfg.amp == "bf16" else torch.float16
    return torch.autocast(device_type=env.device.type, dtype=dtype)


def _grad_norm(params: list[torch.nn.Parameter]) -> torch.Tensor:
    grads = [p.grad for p in params if p.grad is not None]
    return torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())


def optimizer_step(
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    params: list[torch.nn.Parameter],
    clip: float | None,
    need_norm: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """One optimizer step from accumulated (and, with fp16, scaled) gradients, in the order
    that keeps clipping right: unscale -> clip -> step (skipped on inf/NaN) -> update scale.

    Clipping before ``unscale_`` would compare the *scaled* norm with ``clip`` (the bug of
    the PyTorch examples' minGPT trainer). Nothing here reads a tensor on the host.

    Args:
        optimizer: the optimizer; its gradients are zeroed at the end.
        scaler: the GradScaler (disabled unless fp16: then unscale/step/update are plain).
        params: the parameters to clip and measure.
        clip: the maximum global gradient norm, or ``None``.
        need_norm: compute the gradient norm even without clipping.

    Returns:
        ``(grad_norm, skipped)``: the global norm before clipping (a 0-d device tensor, or
        ``None`` when neither clipping nor ``need_norm`` asked for it), and a 0-d device
        tensor that is 1 when the scaler skipped the step (``None`` without fp16).

    Example:
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> model(torch.ones(1, 2)).sum().backward()
        >>> scaler = torch.amp.GradScaler("cpu", enabled=False)
        >>> norm, skipped = optimizer_step(opt, scaler, list(model.parameters()), 1.0, False)
        >>> round(float(norm), 4), skipped
        (1.7321, None)
    """
    scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
    grad_norm = None
    if clip is not None:
        grad_norm = torch.nn.utils.clip_grad_norm_(params, clip)
    elif need_norm:  # the norm costs a pass over the gradients: only when asked
        grad_norm = _grad_norm(params)
    skipped = None
    if scaler.is_enabled():
        scale = scaler._scale.clone()  # the scale halves exactly when the step is skipped
        scaler.step(optimizer)
        scaler.update()
        skipped = (scaler._scale < scale).to(torch.int64)
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, skipped


def warmup_schedule(optimizer: torch.optim.Optimizer, warmup_steps: int):
    """Linear warm-up: optimizer step k uses ``min(1, k / warmup_steps)`` of the base rate.

    Call ``scheduler.step()`` after every optimizer step. With ``warmup_steps`` 0 the rate
    is the base rate from the first step (exactly: the factor is 1.0).

    Example:
        >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        >>> sched = warmup_schedule(opt, 4)
        >>> rates = []
        >>> for _ in range(5):
        ...     rates.append(opt.param_groups[0]["lr"])
        ...     opt.step()
        ...     sched.step()
        >>> rates
        [0.25, 0.5, 0.75, 1.0, 1.0]
    """
    if warmup_steps <= 0:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda done: 1.0)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda done: min(1.0, (done + 1) / warmup_steps)
    )


def _progress(total: int, env: DistEnv, cfg: Config):
    from tqdm.auto import tqdm

    return tqdm(
        total=total,
        desc="train",
        unit="step",
        mininterval=1.0,
        dynamic_ncols=True,
        disable=not env.is_rank0 or cfg.no_progress,
        file=sys.stderr,
    )


class Clock:
    """Training time: from the end of the first step, without evaluation and checkpoints.

    The first step is warm-up (allocations, DDP's bucket rebuild) and is not timed.
    ``with clock.paused("eval"):`` keeps a block out of the training time and adds its
    duration to ``clock.other["eval"]``.

    Example:
        >>> clock = Clock()
        >>> clock.start()
        >>> with clock.paused("eval"):
        ...     pass
        >>> clock.train_seconds() >= 0.0
        True
    """

    def __init__(self) -> None:
        self.t0: float | None = None
        self.pause = 0.0
        self.other: dict[str, float] = {}

    def start(self) -> None:
        """Start the training clock (at the end of the first step)."""
        self.t0, self.pause = time.perf_counter(), 0.0

    @contextlib.contextmanager
    def paused(self, what: str):
        """Keep the block's time out of the training time; add it to ``other[what]``."""
        t = time.perf_counter()
        try:
            yield
        finally:
            dt = time.perf_counter() - t
            self.pause += dt
            self.other[what] = self.other.get(what, 0.0) + dt

    def train_seconds(self) -> float:
        """Seconds of training since :meth:`start` (NaN before it)."""
        return float("nan") if self.t0 is None else time.perf_counter() - self.t0 - self.pause


class Window:
    """What the loop accumulates between two metrics records, without a host sync per step.

    Loss sum, skipped-step count and the running maximum of the gradient norm stay device
    tensors; counts and times are host numbers the loop has anyway. :meth:`close` does the
    record's one all-reduce (the loss) and its few host reads.

    Args:
        env: this process's :class:`DistEnv`.
        clock: the run's :class:`Clock` (its pauses are not training time).
        comm: the :class:`CommMeter` of the DDP model (``None`` on one process).
    """

    def __init__(self, env: DistEnv, clock: Clock, comm: CommMeter | None) -> None:
        self.env, self.clock, self.comm = env, clock, comm
        self.loss = torch.zeros((), device=env.device)
        self.skipped = torch.zeros((), dtype=torch.int64, device=env.device)
        self.norm_max = torch.zeros((), device=env.device)
        self.steps = self.timed_steps = 0
        self.t_wall, self.pause_wall = time.perf_counter(), 0.0
        self.t_timed: float | None = None
        self.pause_timed = 0.0

    def add_step(self, grad_norm: torch.Tensor | None, skipped: torch.Tensor | None) -> None:
        """Count one optimizer step; the first one of the run starts the clocks."""
        if grad_norm is not None:  # a skipped fp16 step has an inf norm: not a spike
            finite = torch.nan_to_num(grad_norm.detach().float(), nan=0.0, posinf=0.0)
            torch.maximum(self.norm_max, finite, out=self.norm_max)
        if skipped is not None:
            self.skipped += skipped
        self.steps += 1
        if self.clock.t0 is None:
            self.clock.start()
            self.t_timed, self.pause_timed = self.clock.t0, 0.0
        else:
            self.timed_steps += 1

    def close(self, global_batch: int) -> dict[str, float]:
        """The window's numbers (mean loss over its steps and all ranks, samples/s, max grad
        norm, skipped steps, communication), then start a new window."""
        mean = all_reduce_sum(self.loss.reshape(1), self.env).item()
        mean /= self.env.world_size * self.steps
        now = time.perf_counter()
        timed = now - self.t_timed - (self.clock.pause - self.pause_timed)
        wall = now - self.t_wall - (self.clock.pause - self.pause_wall)
        calls, comm_s = self.comm.take() if self.comm is not None else (0, 0.0)
        stats = {
            "loss": mean,
            "samples_per_s": (
                self.timed_steps * global_batch / timed if self.timed_steps else float("nan")
            ),
            "grad_norm_max": self.norm_max.item(),
            "skipped": int(self.skipped.item()),
            "comm_s": comm_s,
            "comm_share": comm_s / wall if wall > 0 else float("nan"),
            "allreduces_per_step": calls / self.steps,
        }
        self.loss.zero_()
        self.skipped.zero_()
        self.norm_max.zero_()
        self.steps = self.timed_steps = 0
        self.t_wall = self.t_timed = now
        self.pause_wall = self.pause_timed = self.clock.pause
        return stats


class NormWarning:
    """One stderr line when the gradient norm exceeds ``--grad-norm-warn`` (rank 0), at most
    one every ``every_s`` seconds; the lines in between are counted, not lost."""

    def __init__(self, limit: float, env: DistEnv, every_s: float = 10.0) -> None:
        self.limit, self.env, self.every_s = limit, env, every_s
        self.last = -math.inf
        self.quiet = 0

    def check(self, norm_max: float, step: int, clipping: float | None) -> bool:
        """True when ``norm_max`` exceeds the limit (0: off); warns when due."""
        if not self.limit or not norm_max > self.limit:
            return False
        now = time.monotonic()
        if now - self.last >= self.every_s:
            more = f" ({self.quiet} more record(s) above it since the last warning)"
            print0(
                f"{PROG}: warning: gradient norm {norm_max:.3g} > --grad-norm-warn "
                f"{self.limit:g} by step {step}"
                + (f"; clipped to {clipping:g}" if clipping else "; not clipped")
                + (more if self.quiet else ""),
                env=self.env,
                file=sys.stderr,
            )
            self.last, self.quiet = now, 0
        else:
            self.quiet += 1
        return True


class Recorder:
    """Rank 0's outputs while training: ``metrics.jsonl``, TensorBoard scalars, the progress
    bar. On the other ranks every method does nothing."""

    #: The record fields shown in TensorBoard (under ``train/``).
    SCALARS = ("loss", "lr", "grad_norm", "loss_scale", "samples_per_s", "comm_share")

    def __init__(self, cfg: Config, env: DistEnv, total_steps: int) -> None:
        self.metrics = self.writer = None
        self.bar = _progress(total_steps, env, cfg)
        if env.is_rank0:
            os.makedirs(cfg.out, exist_ok=True)
            self.metrics = open(os.path.join(cfg.out, "metrics.jsonl"), "w")
            if cfg.tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(cfg.tensorboard)

    def record(self, record: dict, steps: int) -> None:
        """Write one metrics record covering ``steps`` optimizer steps."""
        if self.metrics is None:
            return
        self.metrics.write(json.dumps(record) + "\n")
        self.metrics.flush()
        for key in self.SCALARS:
            if key in record:
                self.scalar(f"train/{key}", record[key], record["step"])
        self.bar.update(steps)
        self.bar.set_postfix(loss=f"{record['loss']:.3f}", refresh=False)

    def scalar(self, tag: str, value: float, step: int) -> None:
        """One TensorBoard scalar (when ``--tensorboard`` is given)."""
        if self.writer is not None:
            self.writer.add_scalar(tag, value, step)

    def close(self) -> None:
        """Close the bar, the metrics file and the TensorBoard writer."""
        self.bar.close()
        if self.metrics is not None:
            self.metrics.close()
        if self.writer is not None:
            self.writer.close()


def train(cfg: Config, env: DistEnv) -> dict:
    """Train as ``cfg`` says on the process group ``env``; rank 0 writes the outputs.

    Per step the loop does no host sync and no collective besides DDP's gradient
    all-reduce: the loss stays on the device and is averaged over ranks and steps only
    every ``--log-every`` steps (and on the last step); the gradient norm is computed only
    on those steps or when clipping needs it.

    Returns:
        The summary dict (also written to ``cfg.out/summary.json`` by rank 0).
    """
    torch.manual_seed(cfg.seed)

    # Data: rank 0 first, so that only one process downloads.
    if env.distributed and not env.is_rank0:
        dist.barrier()
    train_set, test_set = data_mod.make_datasets(
        cfg.dataset, cfg.data_dir, cfg.train_size, cfg.test_size
    )
    if env.distributed and env.is_rank0:
        dist.barrier()
    workers = (
        cfg.num_workers if cfg.num_workers is not None else (4 if env.device.type == "cuda" else 0)
    )
    micro_batches, sampler = data_mod.make_train_loader(
        train_set, cfg.batch_size, env, seed=cfg.seed, num_workers=workers
    )
    steps_per_epoch = len(micro_batches) // cfg.accum_steps
    if steps_per_epoch == 0:
        raise UsageError(
            f"one epoch has {len(micro_batches)} micro-batches per process, fewer than "
            f"--accum-steps {cfg.accum_steps}; lower --accum-steps or --batch-size"
        )
    total_steps = steps_per_epoch * cfg.epochs
    if cfg.max_steps is not None:
        total_steps = min(total_steps, cfg.max_steps)

    # Model: same seed on every rank; DDP also broadcasts rank 0's weights at wrap time.
    model = wrap_model(build_model(cfg.model), cfg, env)
    comm = CommMeter(env.world_size).attach(model) if env.distributed else None
    params = [p for p in model.parameters() if p.requires_grad]
    lr = cfg.lr * (env.world_size * cfg.accum_steps if cfg.scale_lr else 1)
    optimizer = torch.optim.SGD(params, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    scheduler = warmup_schedule(optimizer, cfg.warmup_steps)
    scaler = torch.amp.GradScaler(env.device.type, enabled=cfg.amp == "fp16")
    global_batch = cfg.batch_size * env.world_size * cfg.accum_steps

    recorder = Recorder(cfg, env, total_steps)
    print0(
        f"{PROG}: {env.world_size} process(es), backend {env.backend}, device "
        f"{env.device.type}; model {cfg.model}, dataset {cfg.dataset} ({len(train_set)} "
        f"train / {len(test_set)} test); {total_steps} steps of global batch {global_batch}, "
        f"lr {lr:g}"
        + (f" after {cfg.warmup_steps} warm-up steps" if cfg.warmup_steps else "")
        + f"; a record every {cfg.log_every} step(s)",
        env=env,
        file=sys.stderr,
    )

    step, last_loss, evals = 0, float("nan"), []
    clock = Clock()
    window = Window(env, clock, comm)  # between two records: no .item(), no extra collective
    norm_warning = NormWarning(cfg.grad_norm_warn, env)
    t_start = time.perf_counter()
    for epoch in range(cfg.epochs):
        if step >= total_steps:
            break
        sampler.set_epoch(epoch)  # without it every epoch repeats the same order
        batches = iter(micro_batches)
        for _ in range(steps_per_epoch):
            if step >= total_steps:
                break
            for micro in range(cfg.accum_steps):
                x, y = next(batches)
                x = x.to(env.device, non_blocking=True)
                y = y.to(env.device, non_blocking=True)
                # Gradients are all-reduced only on the last micro-step of the group.
                last_micro = micro == cfg.accum_steps - 1
                sync = (
                    contextlib.nullcontext()
                    if last_micro or not env.distributed
                    else (model.no_sync())
                )
                with sync:
                    with _autocast(cfg, env):
                        loss = torch.nn.functional.cross_entropy(model(x), y)
                    scaler.scale(loss / cfg.accum_steps).backward()  # loss / K: a mean
                window.loss += loss.detach().float() / cfg.accum_steps
            log_now = (step + 1) % cfg.log_every == 0 or step + 1 == total_steps
            step_lr = optimizer.param_groups[0]["lr"]
            # unscale -> clip -> step (skipped on inf with fp16) -> update the loss scale
            grad_norm, skipped = optimizer_step(
                optimizer, scaler, params, cfg.clip_grad_norm, need_norm=log_now
            )
            scheduler.step()  # the warm-up's next rate
            step += 1
            window.add_step(grad_norm, skipped)

            if log_now:  # one all-reduce and a few host reads per record, not per step
                steps_in_window = window.steps
                stats = window.close(global_batch)
                last_loss = stats["loss"]
                record = {
                    "step": step,
                    "epoch": epoch,
                    **stats,
                    "lr": step_lr,
                    "grad_norm": float(grad_norm),  # this step's, before clipping
                    "grad_norm_warn": norm_warning.check(
                        stats["grad_norm_max"], step, cfg.clip_grad_norm
                    ),
                }
                if scaler.is_enabled():
                    record["loss_scale"] = scaler.get_scale()
                else:
                    del record["skipped"]
                recorder.record(record, steps_in_window)
        with clock.paused("eval"):
            sync_buffers(model, env)
            ev = data_mod.evaluate(unwrap(model), test_set, env)
        evals.append({"epoch": epoch, "step": step, **ev})
        recorder.scalar("eval/accuracy", ev["accuracy"], step)
        print0(
            f"epoch {epoch}: step {step}, test accuracy {ev['accuracy']:.4f}, "
            f"test loss {ev['loss']:.4f}",
            env=env,
            file=sys.stderr,
        )
    seconds = time.perf_counter() - t_start
    train_seconds = clock.train_seconds()
    summary = {
        "final_loss": last_loss,
        "accuracy": evals[-1]["accuracy"],
        "test_loss": evals[-1]["loss"],
        "steps": step,
        "epochs": len(evals),
        "world_size": env.world_size,
        "backend": env.backend,
        "device": env.device.type,
        # training steps only: from the end of the first step, evaluation excluded
        "samples_per_s": (step - 1) * global_batch / train_seconds if step > 1 else float("nan"),
        "train_seconds": train_seconds,
        "eval_seconds": clock.other.get("eval", 0.0),
        "seconds": seconds,
        "global_batch": global_batch,
        "lr": lr,
        "log_every": cfg.log_every,
        "ddp_buckets": ddp_bucket_count(model) if env.distributed else None,
        "evals": evals,
        "config": asdict(cfg),
    }
    recorder.close()
    if env.is_rank0:
        save_atomic(unwrap(model).state_dict(), os.path.join(cfg.out, "model.pt"))
        with open(os.path.join(cfg.out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        print0(
            f"{PROG}: done in {seconds:.1f} s, {summary['samples_per_s']:.0f} samples/s; "
            f"results in {cfg.out}/",
            env=env,
            file=sys.stderr,
        )
    return summary


@exit_on_usage_error(PROG)
def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m ddp_lab.train`` and of torchrun's ``-m ddp_lab.train``."""
    cfg = parse_args(argv)
    env = setup(cfg.backend, cfg.pg_timeout)
    try:
        check_environment(cfg, env)
        if cfg.dry_run:
            print0(
                json.dumps(
                    {
                        "config": asdict(cfg),
                        "world_size": env.world_size,
                        "backend": env.backend,
                        "device": str(env.device),
                    }
                ),
                env=env,
            )
            return 0
        train(cfg, env)
    finally:
        teardown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
