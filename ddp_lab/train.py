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
from ddp_lab.checkpoint import Checkpoints, ResumableSampler
from ddp_lab.dist import (
    DEFAULT_TIMEOUT_S,
    CommMeter,
    DistEnv,
    ddp_bucket_count,
    print0,
    setup,
    teardown,
)
from ddp_lab.errors import UsageError, exit_on_usage_error
from ddp_lab.faults import KINDS, Events, Faults, InjectedFault, process_start_time
from ddp_lab.models import MODELS, build_model, has_batchnorm
from ddp_lab.monitor import Clock, NormWarning, Recorder, Window
from ddp_lab.syncbn import convert_sync_batchnorm_auto

PROG = "ddp_lab.train"

#: Flags that only make sense with ``--ckpt-dir``.
NEED_CKPT_DIR = {
    "ckpt_every": "--ckpt-every",
    "resume": "--resume",
    "rollback_drop": "--rollback-drop",
}

#: Flags a resumed run must share with the run that wrote the checkpoint.
MUST_MATCH = ("model", "dataset", "train_size", "seed", "amp", "sync_bn", "momentum")


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
        help="checkpoint every N optimizer steps (default with --ckpt-dir: at every epoch end)",
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
        help="the rank that fails at --fail-at-step (default: the last rank)",
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
    no_progress: bool
    dry_run: bool


def parse_args(argv: list[str] | None = None) -> Config:
    """Parse and validate the command line.

    Raises:
        UsageError: a value out of range, or a flag whose feature is not available yet.
    """
    cfg = Config(**vars(build_parser().parse_args(argv)))
    for name, flag in NEED_CKPT_DIR.items():
        if getattr(cfg, name) not in (None, False) and cfg.ckpt_dir is None:
            raise UsageError(f"{flag} needs --ckpt-dir DIR (where checkpoints are written)")
    positive = {
        "--epochs": cfg.epochs,
        "--batch-size": cfg.batch_size,
        "--accum-steps": cfg.accum_steps,
        "--train-size": cfg.train_size,
        "--test-size": cfg.test_size,
        "--log-every": cfg.log_every,
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
    return cfg


def check_environment(cfg: Config, env: DistEnv) -> None:
    """Refuse combinations this machine cannot run (with the fix in the message), and say in
    one line when a choice runs correctly but slowly here (fp16 or bf16 on an older CPU)."""
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


def make_loader(
    dataset: torch.utils.data.Dataset, cfg: Config, env: DistEnv
) -> tuple[torch.utils.data.DataLoader, ResumableSampler]:
    """This rank's training loader: ``DistributedSampler``'s order that can resume mid-epoch
    (:class:`~ddp_lab.checkpoint.ResumableSampler`), full batches only, and its own seeded
    generator, so that loading never draws from the global RNG."""
    sampler = ResumableSampler(len(dataset), env.world_size, env.rank, seed=cfg.seed)
    if len(sampler) < cfg.batch_size:
        raise UsageError(
            f"each of the {env.world_size} process(es) gets {len(sampler)} training samples, "
            f"fewer than one batch of {cfg.batch_size}; lower --batch-size or use more data"
        )
    workers = cfg.num_workers
    if workers is None:
        workers = 4 if env.device.type == "cuda" else 0
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=cfg.batch_size,
        sampler=sampler,
        drop_last=True,
        num_workers=workers,
        pin_memory=env.device.type == "cuda",
        generator=torch.Generator().manual_seed(cfg.seed),
        persistent_workers=workers > 0,
    )
    return loader, sampler


@dataclass
class Position:
    """Where training is: optimizer steps done, the epoch, and the global samples of that
    epoch already read (the same number at every world size)."""

    step: int = 0
    epoch: int = 0
    samples: int = 0


def training_state(
    cfg: Config,
    env: DistEnv,
    pos: Position,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    scheduler,
    loader: torch.utils.data.DataLoader,
    evals: list[dict],
) -> dict:
    """Everything a bit-identical resume needs (the RNG states are added by
    :meth:`~ddp_lab.checkpoint.Checkpoints.save`)."""
    return {
        "format": 1,
        "step": pos.step,
        "epoch": pos.epoch,
        "epoch_samples": pos.samples,
        "world_size": env.world_size,
        "global_batch": cfg.batch_size * env.world_size * cfg.accum_steps,
        "config": asdict(cfg),
        "model": unwrap(model).state_dict(),
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict(),
        "scheduler": scheduler.state_dict(),
        "loader_generator": loader.generator.get_state(),
        "evals": evals,
    }


def check_resumable(state: dict, cfg: Config, env: DistEnv) -> None:
    """Refuse a checkpoint written with other essential flags; say so when the number of
    processes changed (the rest of the epoch is re-sharded)."""
    old = state["config"]
    diff = [f"--{k.replace('_', '-')} {old[k]} (now {getattr(cfg, k)})" for k in MUST_MATCH]
    diff = [d for d, k in zip(diff, MUST_MATCH, strict=True) if old[k] != getattr(cfg, k)]
    if diff:
        raise UsageError(
            f"the checkpoint {state['path']} was written with {', '.join(diff)}; resume "
            "with the same flags, or start afresh with another --ckpt-dir"
        )
    if state["world_size"] != env.world_size:
        left = cfg.train_size - state["epoch_samples"] if cfg.dataset == "synthetic" else "the"
        print0(
            f"{PROG}: resuming a {state['world_size']}-process checkpoint on "
            f"{env.world_size} process(es): {left} remaining samples of epoch "
            f"{state['epoch']} are re-sharded over the new ranks",
            env=env,
            file=sys.stderr,
        )


def settle_buckets(model: torch.nn.Module, cfg: Config, env: DistEnv) -> None:
    """Let DDP build its final gradient buckets now, with a backward pass that changes nothing.

    DDP starts with one bucket in registration order and rebuilds its buckets in the order
    gradients became ready after its first backward. An uninterrupted run takes step 1 on the
    first layout and every later step on the rebuilt one; a resumed run would take its first
    step on the first layout. With 3 or more ranks the ring all-reduce then adds the three
    gradients in another order (float addition is not associative) and the weights differ in
    the last bits. One zero-loss forward and backward here (buffers restored, gradients
    dropped) records the order, so the resumed run's first step uses the rebuilt layout:
    bit-identical again.
    """
    if not isinstance(model, DDP):
        return
    buffers = {k: v.clone() for k, v in unwrap(model).named_buffers()}
    x = torch.zeros(2, *data_mod.IMAGE_SHAPE, device=env.device)
    with _autocast(cfg, env):
        out = model(x)
    (out.float().sum() * 0.0).backward()
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        for k, v in unwrap(model).named_buffers():
            v.copy_(buffers[k])


def make_faults(cfg: Config, env: DistEnv) -> Faults:
    """The run's :class:`~ddp_lab.faults.Faults` from ``--fail-at-step``, ``--fault`` and
    ``--fail-rank`` (default: the last rank)."""
    rank = cfg.fail_rank if cfg.fail_rank is not None else env.world_size - 1

    def rebuild() -> torch.nn.Module:  # --fault scramble: a fresh init, same on every rank
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed + 1)
            return build_model(cfg.model)

    return Faults(cfg.fail_at_step, cfg.fault, rank, env, None, cfg.pg_timeout, rebuild)


def checkpoint(
    ckpts: Checkpoints,
    run: tuple,
    test_set: torch.utils.data.Dataset,
    faults: Faults,
    events: Events,
    accuracy: float | None = None,
) -> list[dict]:
    """Save the checkpoint of the current step (a collective: every rank calls it).

    With ``--rollback-drop`` the weights are evaluated first (unless ``accuracy`` is
    given); when the test accuracy fell more than that many points below the best
    checkpoint's, the best checkpoint's weights, optimizer and scaler state come back
    before saving (the step count, the LR schedule and the data order go on: the batches in
    between are skipped, as large training runs do after a loss spike).

    Args:
        ckpts: the run's checkpoints.
        run: ``(cfg, env, pos, model, optimizer, scaler, scheduler, loader, evals)``.
        test_set: the validation set of the rollback rule.
        faults: for the error context.
        events: the run's timeline.
        accuracy: the test accuracy of the current weights, when just measured.

    Returns:
        ``[rollback record]`` when it rolled back, else ``[]``.
    """
    cfg, env, pos, model, optimizer, scaler, scheduler, loader, evals = run
    faults.at(f"the checkpoint of step {pos.step}")
    rolled = []
    if cfg.rollback_drop is None:
        accuracy = None  # the best checkpoint matters only for a rollback
    else:
        if accuracy is None:
            sync_buffers(model, env)
            accuracy = data_mod.evaluate(unwrap(model), test_set, env)["accuracy"]
        if ckpts.dropped(accuracy, cfg.rollback_drop):
            best = ckpts.load_best()
            unwrap(model).load_state_dict(best["model"])
            optimizer.load_state_dict(best["optimizer"])
            scaler.load_state_dict(best["scaler"])
            rolled = [
                {
                    "step": pos.step,
                    "accuracy": accuracy,
                    "restored_step": best["step"],
                    "restored_accuracy": best["accuracy"],
                }
            ]
            events.log("rollback", **rolled[0])
            print0(
                f"{PROG}: rollback at step {pos.step}: test accuracy {accuracy:.4f} is more "
                f"than --rollback-drop {cfg.rollback_drop:g} points below the best "
                f"checkpoint's {best['accuracy']:.4f} (step {best['step']}); restored its "
                "weights, optimizer and scaler",
                env=env,
                file=sys.stderr,
            )
            accuracy = best["accuracy"]
    state = training_state(cfg, env, pos, model, optimizer, scaler, scheduler, loader, evals)
    info = ckpts.save(pos.step, state, accuracy)
    events.log(
        "checkpoint",
        step=pos.step,
        path=info["path"],
        bytes=info["bytes"],
        seconds=info["seconds"],
        accuracy=accuracy,
    )
    return rolled


def train(cfg: Config, env: DistEnv, faults: Faults | None = None) -> dict:
    """Train as ``cfg`` says on the process group ``env``; rank 0 writes the outputs.

    Per step the loop does no host sync and no collective besides DDP's gradient
    all-reduce: the loss stays on the device and is averaged over ranks and steps only
    every ``--log-every`` steps (and on the last step); the gradient norm is computed only
    on those steps or when clipping needs it. With ``--ckpt-dir`` it checkpoints, with
    ``--resume`` it continues from the newest valid checkpoint, bit-identically.

    Args:
        cfg: the options (:func:`parse_args`).
        env: this process's :class:`~ddp_lab.dist.DistEnv`.
        faults: fault injection and error context (made from ``cfg`` when omitted).

    Returns:
        The summary dict (also written to ``cfg.out/summary.json`` by rank 0).
    """
    torch.manual_seed(cfg.seed)
    events = Events(cfg.out, env, fresh=not cfg.resume)
    events.log("start", when=process_start_time())
    events.log("joined")  # the process group is up (setup ran before)
    if faults is None:
        faults = make_faults(cfg, env)
    faults.events = events

    # Data: rank 0 first, so that only one process downloads.
    faults.at("the data barrier (rank 0 prepares the data set)")
    if env.distributed and not env.is_rank0:
        dist.barrier()
    train_set, test_set = data_mod.make_datasets(
        cfg.dataset, cfg.data_dir, cfg.train_size, cfg.test_size
    )
    if env.distributed and env.is_rank0:
        dist.barrier()
    loader, sampler = make_loader(train_set, cfg, env)
    micro_per_step = cfg.batch_size * cfg.accum_steps  # samples per rank per optimizer step
    steps_per_epoch = len(sampler) // micro_per_step
    if steps_per_epoch == 0:
        raise UsageError(
            f"one epoch has {len(sampler) // cfg.batch_size} micro-batches per process, "
            f"fewer than --accum-steps {cfg.accum_steps}; lower --accum-steps or --batch-size"
        )

    # Model: same seed on every rank; DDP also broadcasts rank 0's weights at wrap time.
    model = wrap_model(build_model(cfg.model), cfg, env)
    comm = CommMeter(env.world_size).attach(model) if env.distributed else None
    params = [p for p in model.parameters() if p.requires_grad]
    lr = cfg.lr * (env.world_size * cfg.accum_steps if cfg.scale_lr else 1)
    optimizer = torch.optim.SGD(params, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    scheduler = warmup_schedule(optimizer, cfg.warmup_steps)
    scaler = torch.amp.GradScaler(env.device.type, enabled=cfg.amp == "fp16")
    global_batch = cfg.batch_size * env.world_size * cfg.accum_steps

    # Resume: every rank loads the same checkpoint onto its own device.
    pos, evals, resumed = Position(), [], None
    ckpts = Checkpoints(cfg.ckpt_dir, env, cfg.keep_last) if cfg.ckpt_dir else None
    if cfg.resume:
        faults.at("loading the checkpoint")
        resumed = ckpts.load_latest()  # also restores this rank's RNG states
    if resumed is not None:
        check_resumable(resumed, cfg, env)
        unwrap(model).load_state_dict(resumed["model"])
        optimizer.load_state_dict(resumed["optimizer"])
        scaler.load_state_dict(resumed["scaler"])
        scheduler.load_state_dict(resumed["scheduler"])
        loader.generator.set_state(resumed["loader_generator"].cpu())
        pos = Position(resumed["step"], resumed["epoch"], resumed["epoch_samples"])
        if pos.step > 0:
            settle_buckets(model, cfg, env)  # the bucket layout of an uninterrupted run
            if comm is not None:
                comm.take()
        evals = resumed["evals"]
        events.log("resumed", step=pos.step, path=resumed["path"])
        print0(
            f"{PROG}: resumed from {resumed['path']} (step {pos.step}, epoch {pos.epoch})",
            env=env,
            file=sys.stderr,
        )
    sampler.set_epoch(pos.epoch, start=pos.samples)
    total_steps = pos.step + len(sampler) // micro_per_step
    total_steps += steps_per_epoch * max(0, cfg.epochs - pos.epoch - 1)
    if cfg.max_steps is not None:
        total_steps = min(total_steps, cfg.max_steps)

    recorder = Recorder(cfg, env, total_steps, pos.step if resumed else None)
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

    first_step, last_loss, rollbacks, pending = pos.step + 1, float("nan"), [], {}
    clock = Clock()
    window = Window(env, clock, comm)  # between two records: no .item(), no extra collective
    norm_warning = NormWarning(cfg.grad_norm_warn, env)
    t_start = time.perf_counter()
    for epoch in range(pos.epoch, cfg.epochs):
        if pos.step >= total_steps:
            break
        # The epoch's order from (seed, epoch); after a resume, from where it stopped.
        sampler.set_epoch(epoch, start=pos.samples if epoch == pos.epoch else 0)
        pos.epoch, pos.samples = epoch, sampler.start
        steps_this_epoch = len(sampler) // micro_per_step
        batches = iter(loader)
        for _ in range(steps_this_epoch):
            if pos.step >= total_steps:
                break
            faults.before_step(pos.step + 1, model)  # --fail-at-step: raise, kill, hang, ...
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
            log_now = (pos.step + 1) % cfg.log_every == 0 or pos.step + 1 == total_steps
            step_lr = optimizer.param_groups[0]["lr"]
            # unscale -> clip -> step (skipped on inf with fp16) -> update the loss scale
            grad_norm, skipped = optimizer_step(
                optimizer, scaler, params, cfg.clip_grad_norm, need_norm=log_now
            )
            scheduler.step()  # the warm-up's next rate
            pos.step += 1
            pos.samples += global_batch
            window.add_step(grad_norm, skipped)
            if pos.step == first_step:
                events.log("first_step", step=pos.step)

            if ckpts is not None and cfg.ckpt_every and pos.step % cfg.ckpt_every == 0:
                with clock.paused("checkpoint"):
                    state = (cfg, env, pos, model, optimizer, scaler, scheduler, loader, evals)
                    done = checkpoint(ckpts, state, test_set, faults, events)
                rollbacks += done
                pending.update({"rollback": done[-1]} if done else {})
            if log_now:  # one all-reduce and a few host reads per record, not per step
                faults.at(f"the loss all-reduce of the record at step {pos.step}")
                steps_in_window = window.steps
                stats = window.close(global_batch, grad_norm)
                last_loss = stats["loss"]
                record = {
                    "step": pos.step,
                    "epoch": epoch,
                    **stats,
                    "lr": step_lr,
                    "grad_norm_warn": norm_warning.check(
                        stats["grad_norm_max"], pos.step, cfg.clip_grad_norm
                    ),
                    **pending,  # a rollback since the last record
                }
                pending = {}
                if scaler.is_enabled():
                    record["loss_scale"] = scaler.get_scale()
                else:
                    del record["skipped"]
                recorder.record(record, steps_in_window)

        epoch_done = pos.samples - sampler.start == steps_this_epoch * global_batch
        with clock.paused("eval"):
            faults.at(f"the evaluation after epoch {epoch}")
            sync_buffers(model, env)
            ev = data_mod.evaluate(unwrap(model), test_set, env)
        evals.append({"epoch": epoch, "step": pos.step, **ev})
        recorder.scalar("eval/accuracy", ev["accuracy"], pos.step)
        print0(
            f"epoch {epoch}: step {pos.step}, test accuracy {ev['accuracy']:.4f}, "
            f"test loss {ev['loss']:.4f}",
            env=env,
            file=sys.stderr,
        )
        if ckpts is not None and cfg.ckpt_every is None:  # default: at every epoch end
            if epoch_done:
                pos.epoch, pos.samples = epoch + 1, 0
            with clock.paused("checkpoint"):
                state = (cfg, env, pos, model, optimizer, scaler, scheduler, loader, evals)
                done = checkpoint(ckpts, state, test_set, faults, events, ev["accuracy"])
            rollbacks += done
            pending.update({"rollback": done[-1]} if done else {})
    recorder.close()
    seconds = time.perf_counter() - t_start
    train_seconds = clock.train_seconds()
    done_here = pos.step - first_step + 1  # steps this process ran (after a resume: fewer)
    summary = {
        "final_loss": last_loss,
        "accuracy": evals[-1]["accuracy"] if evals else float("nan"),
        "test_loss": evals[-1]["loss"] if evals else float("nan"),
        "steps": pos.step,
        "epochs": len(evals),
        "world_size": env.world_size,
        "backend": env.backend,
        "device": env.device.type,
        # training steps only: from the end of the first step, evaluation excluded
        "samples_per_s": (
            (done_here - 1) * global_batch / train_seconds if done_here > 1 else float("nan")
        ),
        "train_seconds": train_seconds,
        "eval_seconds": clock.other.get("eval", 0.0),
        "checkpoint_seconds": clock.other.get("checkpoint", 0.0),
        "seconds": seconds,
        "global_batch": global_batch,
        "lr": lr,
        "log_every": cfg.log_every,
        "ddp_buckets": ddp_bucket_count(model) if env.distributed else None,
        "resumed_from": resumed["step"] if resumed else None,
        "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
        "rollbacks": rollbacks,
        "evals": evals,
        "config": asdict(cfg),
    }
    if env.is_rank0:
        save_atomic(unwrap(model).state_dict(), os.path.join(cfg.out, "model.pt"))
        with open(os.path.join(cfg.out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        events.log("done", step=pos.step)
        print0(
            f"{PROG}: done in {seconds:.1f} s, {summary['samples_per_s']:.0f} samples/s; "
            f"results in {cfg.out}/",
            env=env,
            file=sys.stderr,
        )
    return summary


@exit_on_usage_error(PROG)
def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m ddp_lab.train`` and of torchrun's ``-m ddp_lab.train``.

    Returns 0 on success, 1 when an injected fault fired or a collective failed (timeout,
    lost peer: one ``error:`` line naming the rank, the collective and the step); usage
    errors exit with 2 (:mod:`ddp_lab.errors`).
    """
    cfg = parse_args(argv)
    env = setup(cfg.backend, cfg.pg_timeout)
    faults = make_faults(cfg, env)
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
        train(cfg, env, faults)
    except InjectedFault as err:
        return _failed(env, str(err))
    except RuntimeError as err:
        line = faults.explain(err)
        if line is None:
            raise
        return _failed(env, line)
    finally:
        teardown()
    return 0


def _failed(env: DistEnv, line: str) -> int:
    print(f"{PROG}: error: [rank {env.rank}] {line}", file=sys.stderr, flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
