"""What the trainer measures while it trains, at (almost) no cost per step.

Per step the loop only adds to device tensors and host counters (:class:`Window`); every
``--log-every`` steps one all-reduce and a few host reads turn them into a record
(:class:`Recorder`: ``metrics.jsonl``, TensorBoard, the progress bar). :class:`Clock` keeps
evaluation and checkpoints out of the training time, :class:`NormWarning` warns about large
gradient norms without flooding the log.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time

import torch

from ddp_lab.dist import CommMeter, DistEnv, all_reduce_sum, print0
from ddp_lab.hostmem import minor_faults

PROG = "ddp_lab.train"


def _progress(total: int, env: DistEnv, disable: bool):
    from tqdm.auto import tqdm

    return tqdm(
        total=total,
        desc="train",
        unit="step",
        mininterval=1.0,
        dynamic_ncols=True,
        disable=not env.is_rank0 or disable,
        file=sys.stderr,
    )


class Clock:
    """Training time and page faults: from the end of the first step, without evaluation
    and checkpoints.

    The first step is warm-up (allocations, DDP's bucket rebuild) and is not counted.
    ``with clock.paused("eval"):`` keeps a block out of the training time (and its page
    faults out of the training faults) and adds its duration to ``clock.other["eval"]``.

    Example:
        >>> clock = Clock()
        >>> clock.start()
        >>> with clock.paused("eval"):
        ...     pass
        >>> clock.train_seconds() >= 0.0 and clock.train_faults() >= 0
        True
    """

    def __init__(self) -> None:
        self.t0: float | None = None
        self.pause = 0.0
        self.other: dict[str, float] = {}
        self.faults0 = self.pause_faults = 0

    def start(self) -> None:
        """Start the training clock (at the end of the first step)."""
        self.t0, self.pause = time.perf_counter(), 0.0
        self.faults0, self.pause_faults = minor_faults(), 0

    @contextlib.contextmanager
    def paused(self, what: str):
        """Keep the block's time out of the training time; add it to ``other[what]``."""
        t, faults = time.perf_counter(), minor_faults()
        try:
            yield
        finally:
            dt = time.perf_counter() - t
            self.pause += dt
            self.pause_faults += minor_faults() - faults
            self.other[what] = self.other.get(what, 0.0) + dt

    def train_seconds(self) -> float:
        """Seconds of training since :meth:`start` (NaN before it)."""
        return float("nan") if self.t0 is None else time.perf_counter() - self.t0 - self.pause

    def train_faults(self) -> int:
        """This process's minor page faults in training since :meth:`start` (0 before it;
        :mod:`ddp_lab.hostmem`)."""
        return 0 if self.t0 is None else minor_faults() - self.faults0 - self.pause_faults


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

    def close(self, global_batch: int, grad_norm: torch.Tensor) -> dict[str, float]:
        """The window's numbers (mean loss over its steps and all ranks, samples/s, this
        step's and the window's largest grad norm, skipped steps, communication), then
        start a new window. Two host reads: the reduced loss, and one small tensor."""
        mean = all_reduce_sum(self.loss.reshape(1), self.env).item()
        mean /= self.env.world_size * self.steps
        here = torch.stack([grad_norm.detach().float(), self.norm_max, self.skipped.float()])
        norm, norm_max, skipped = here.tolist()
        now = time.perf_counter()
        timed = now - self.t_timed - (self.clock.pause - self.pause_timed)
        wall = now - self.t_wall - (self.clock.pause - self.pause_wall)
        calls, comm_s = self.comm.take() if self.comm is not None else (0, 0.0)
        stats = {
            "loss": mean,
            "samples_per_s": (
                self.timed_steps * global_batch / timed if self.timed_steps else float("nan")
            ),
            "grad_norm": norm,  # this step's, before clipping
            "grad_norm_max": norm_max,
            "skipped": int(skipped),
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
    bar. On the other ranks every method does nothing.

    Args:
        cfg: the trainer's options (``out``, ``tensorboard``, ``no_progress`` are read).
        env: this process's :class:`~ddp_lab.dist.DistEnv`.
        total_steps: the run's optimizer steps (for the progress bar).
        resumed_step: the checkpoint's step when resuming: ``metrics.jsonl`` keeps its
            records up to that step and continues; ``None`` starts the file anew.
    """

    #: The record fields shown in TensorBoard (under ``train/``).
    SCALARS = ("loss", "lr", "grad_norm", "loss_scale", "samples_per_s", "comm_share")

    def __init__(
        self,
        cfg,
        env: DistEnv,
        total_steps: int,
        resumed_step: int | None = None,
    ) -> None:
        self.metrics = self.writer = None
        self.bar = _progress(total_steps, env, cfg.no_progress)
        self.bar.update(resumed_step or 0)
        if env.is_rank0:
            os.makedirs(cfg.out, exist_ok=True)
            path = os.path.join(cfg.out, "metrics.jsonl")
            kept = []
            if resumed_step is not None and os.path.exists(path):
                # a resumed run continues the file: records past the checkpoint are redone
                with open(path) as f:
                    kept = [line for line in f if _record_step(line) <= resumed_step]
            self.metrics = open(path, "w")
            self.metrics.writelines(kept)
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


def _record_step(line: str) -> float:
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return math.inf  # a line cut by a crash: dropped
