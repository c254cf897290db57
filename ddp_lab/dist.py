"""Process-group setup from torchrun's environment, and the small helpers around it.

``torchrun`` starts one process per device and tells each who it is through environment
variables: ``RANK`` (global id), ``LOCAL_RANK`` (id on this node, picks the GPU),
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` (where rank 0's
rendezvous store listens). :func:`setup` reads them, checks them, picks the backend and the
device, and joins the process group. Run without torchrun, it returns a one-process
environment so that the same script also runs as plain ``python``.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import record_function

from ddp_lab.errors import UsageError
from ddp_lab.profiling import BUCKET

#: The variables torchrun sets for every worker; all or none must be present.
TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

#: Default process-group timeout in seconds (the seeds' 1800 s, torch's own default too).
DEFAULT_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class DistEnv:
    """Who this process is in the job.

    Attributes:
        rank: global rank, 0 .. world_size - 1.
        local_rank: rank on this node; selects the GPU.
        world_size: number of processes in the job.
        local_world_size: number of processes on this node.
        backend: ``"nccl"``, ``"gloo"`` or ``"none"`` (single process, no process group).
        device: the device this process computes on.
    """

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    backend: str = "none"
    device: torch.device = torch.device("cpu")

    @property
    def distributed(self) -> bool:
        """True when a process group is initialised (started by torchrun)."""
        return self.backend != "none"

    @property
    def is_rank0(self) -> bool:
        """True on the process that logs and saves."""
        return self.rank == 0


def torchrun_env(environ: dict[str, str] | None = None) -> dict[str, int] | None:
    """Read torchrun's variables, or ``None`` when the process was not started by torchrun.

    Args:
        environ: the environment to read (``os.environ`` by default).

    Returns:
        ``{"rank", "local_rank", "world_size", "local_world_size"}`` as integers, or ``None``.

    Raises:
        UsageError: when only some of the variables are set, or they are not integers or
            not consistent (e.g. ``RANK >= WORLD_SIZE``).

    Example:
        >>> torchrun_env({}) is None
        True
    """
    environ = os.environ if environ is None else environ
    present = [v for v in TORCHRUN_VARS if v in environ]
    if not present:
        return None
    missing = [v for v in TORCHRUN_VARS if v not in environ]
    if missing:
        raise UsageError(
            f"torchrun environment is incomplete: {', '.join(present)} set but "
            f"{', '.join(missing)} missing; start the script with `torchrun ...`, or unset "
            f"{', '.join(present)} to run as a single process"
        )
    try:
        rank = int(environ["RANK"])
        local_rank = int(environ["LOCAL_RANK"])
        world_size = int(environ["WORLD_SIZE"])
        local_world_size = int(environ.get("LOCAL_WORLD_SIZE", world_size))
        int(environ["MASTER_PORT"])
    except ValueError as err:
        raise UsageError(
            f"torchrun environment is malformed ({err}); RANK, LOCAL_RANK, WORLD_SIZE and "
            "MASTER_PORT must be integers: start the script with `torchrun ...`"
        ) from None
    if not (0 <= rank < world_size) or not (0 <= local_rank < local_world_size):
        raise UsageError(
            f"torchrun environment is inconsistent (RANK={rank}, WORLD_SIZE={world_size}, "
            f"LOCAL_RANK={local_rank}, LOCAL_WORLD_SIZE={local_world_size}); start the "
            "script with `torchrun ...` instead of setting these by hand"
        )
    return {
        "rank": rank,
        "local_rank": local_rank,
        "world_size": world_size,
        "local_world_size": local_world_size,
    }


def resolve_backend(requested: str, local_world_size: int) -> str:
    """Pick the collective backend and check that this machine can run it.

    Args:
        requested: ``"auto"``, ``"nccl"`` or ``"gloo"``.
        local_world_size: processes on this node (each NCCL process needs its own GPU).

    Returns:
        ``"nccl"`` or ``"gloo"``.

    Raises:
        UsageError: NCCL asked for without a GPU, or more local processes than GPUs.

    Example:
        >>> resolve_backend("gloo", 2)
        'gloo'
    """
    if requested not in ("auto", "nccl", "gloo"):
        raise UsageError(f"unknown backend {requested!r}; use auto, nccl or gloo")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend = requested if requested != "auto" else ("nccl" if gpus > 0 else "gloo")
    if backend == "nccl":
        if gpus == 0:
            raise UsageError(
                "--backend nccl needs CUDA GPUs but none is visible; use --backend gloo "
                "(or auto) to train on the CPU"
            )
        if local_world_size > gpus:
            raise UsageError(
                f"{local_world_size} processes on this node but only {gpus} GPU(s); use "
                f"--nproc_per_node={gpus} (one process per GPU), or --backend gloo for CPU"
            )
    return backend


def setup(
    backend: str = "auto", timeout_s: float = DEFAULT_TIMEOUT_S, quiet: bool = False
) -> DistEnv:
    """Join the process group that torchrun prepared, or describe a single process.

    Args:
        backend: ``"auto"`` (NCCL when CUDA is there, gloo otherwise), ``"nccl"`` or ``"gloo"``.
        timeout_s: how long a collective may wait before the job fails instead of hanging.
        quiet: do not print the one-line "single process" notice.

    Returns:
        The :class:`DistEnv` of this process. With NCCL the current CUDA device is set to
        ``cuda:LOCAL_RANK``.

    Raises:
        UsageError: on a half-set torchrun environment, NCCL without GPUs, or more local
            processes than GPUs.

    Example:
        >>> env = setup(quiet=True)   # plain `python`, not torchrun
        >>> env.world_size, env.distributed
        (1, False)
    """
    if timeout_s <= 0:
        raise UsageError(f"--pg-timeout must be positive, got {timeout_s}")
    info = torchrun_env()
    if info is None:
        resolve_backend(backend, 1)  # still refuse nccl without a GPU
        device = torch.device("cuda", 0) if _wants_cuda(backend) else torch.device("cpu")
        if not quiet:
            print(
                f"ddp_lab: not started by torchrun; running as a single process "
                f"(world size 1) on {device}",
                file=sys.stderr,
                flush=True,
            )
        return DistEnv(device=device)

    chosen = resolve_backend(backend, info["local_world_size"])
    if chosen == "nccl":
        device = torch.device("cuda", info["local_rank"])
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(backend=chosen, timeout=datetime.timedelta(seconds=timeout_s))
    return DistEnv(backend=chosen, device=device, **info)


def _wants_cuda(backend: str) -> bool:
    return backend in ("auto", "nccl") and torch.cuda.is_available()


def teardown() -> None:
    """Leave the process group (a no-op when there is none). Call it once, at the end."""
    if dist.is_available() and dist.is_initialized():
        # Free unreachable DDP wrappers and autograd graphs first: collected after the group
        # is gone (at interpreter exit), gloo work they hold can abort the process
        # ("terminate called without an active exception").
        gc.collect()
        dist.destroy_process_group()


def print0(*args, env: DistEnv | None = None, **kwargs) -> None:
    """``print`` on rank 0 only, so that N processes do not print N copies.

    Args:
        *args: what to print.
        env: the process's :class:`DistEnv`; read from the process group when omitted.
        **kwargs: passed to :func:`print` (``flush`` defaults to True).

    Example:
        >>> print0("epoch 1 done")
        epoch 1 done
    """
    rank = env.rank if env is not None else (dist.get_rank() if dist.is_initialized() else 0)
    if rank == 0:
        kwargs.setdefault("flush", True)
        print(*args, **kwargs)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The plain module inside a ``DistributedDataParallel`` wrapper (or the model itself).

    Example:
        >>> layer = torch.nn.Linear(2, 2)
        >>> unwrap(layer) is layer
        True
    """
    return model.module if isinstance(model, DistributedDataParallel) else model


def sync_buffers(model: torch.nn.Module, env: DistEnv) -> None:
    """Give every rank rank 0's buffers (BatchNorm running statistics), as DDP does."""
    if env.distributed:
        for buf in unwrap(model).buffers():
            dist.broadcast(buf, src=0)


def all_reduce_sum(values: list[float] | torch.Tensor, env: DistEnv) -> torch.Tensor:
    """Sum numbers over all ranks (float64 on the process's device; identity on one process).

    Args:
        values: numbers to sum element-wise across ranks.
        env: the process's :class:`DistEnv`.

    Returns:
        A float64 tensor with the global sums, on the CPU.

    Example:
        >>> all_reduce_sum([1.0, 2.0], DistEnv()).tolist()
        [1.0, 2.0]
    """
    t = torch.as_tensor(values, dtype=torch.float64).clone().to(env.device)
    if env.distributed:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.cpu()


class CommMeter:
    """Count and time DDP's gradient all-reduces, through a DDP communication hook.

    The hook does what DDP's built-in path does (scale the bucket by 1 / world size, then
    ``all_reduce`` it; multiplying rather than dividing keeps the weights bit-identical to
    a DDP without a hook) and records, per bucket, one call and the moments the all-reduce
    was launched and completed. The time counted is the union of the intervals in which at
    least one all-reduce was in flight: communication plus the wait for the slowest rank to
    join. With several buckets it overlaps the rest of the backward pass, so it bounds the
    communication cost of a step from above. On CUDA (NCCL) the times are host-side
    launch-to-completion times. :meth:`take` reads and resets the numbers.

    Args:
        world_size: the number of processes (the divisor of the average).

    Example:
        >>> meter = CommMeter(world_size=1)
        >>> meter.take()
        (0, 0.0)
    """

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        #: set by ``--profile``: each launch inside a ``ddp_lab: all_reduce bucket <i>`` range
        self.label = False
        self.calls = 0
        self.seconds = 0.0
        self._pending = 0
        self._since = 0.0
        self._lock = threading.Lock()

    def attach(self, ddp_model: torch.nn.Module) -> CommMeter:
        """Register the hook on a ``DistributedDataParallel`` model (before its first step).

        Returns:
            The meter itself.
        """
        ddp_model.register_comm_hook(None, self._hook)
        return self

    def _hook(self, state, bucket):  # no annotations: DDP checks them, and they are strings
        with self._lock:
            if self._pending == 0:
                self._since = time.perf_counter()
            self._pending += 1
            self.calls += 1
        tensor = bucket.buffer()
        tensor.mul_(1.0 / self.world_size)  # DDP's own divisor, applied the same way
        label = record_function(f"{BUCKET}{bucket.index()}") if self.label else None
        with label or contextlib.nullcontext():
            work = dist.all_reduce(tensor, async_op=True)
        return work.get_future().then(self._done)

    def _done(self, fut: torch.futures.Future) -> torch.Tensor:
        with self._lock:  # runs on the backend's thread
            self._pending -= 1
            if self._pending == 0:
                self.seconds += time.perf_counter() - self._since
        return fut.value()[0]

    def take(self) -> tuple[int, float]:
        """``(all-reduce calls, seconds in flight)`` since the last call; resets both."""
        with self._lock:
            out = (self.calls, self.seconds)
            self.calls, self.seconds = 0, 0.0
        return out


def ddp_bucket_count(ddp_model: torch.nn.Module) -> int | None:
    """The number of gradient buckets of a ``DistributedDataParallel`` model (``None`` when
    this torch does not tell). Read it after the first step: DDP rebuilds its buckets then.

    Example:
        >>> ddp_bucket_count(torch.nn.Linear(2, 2)) is None
        True
    """
    reducer = getattr(ddp_model, "reducer", None)
    try:
        return len(reducer._get_zeros_like_grad_buckets())
    except (AttributeError, RuntimeError):
        return None


def settle_ddp_buckets(ddp_model: torch.nn.Module, example: torch.Tensor, autocast=None) -> None:
    """Let DDP build its final gradient buckets now, with a backward pass that changes nothing.

    DDP starts with one bucket in registration order and rebuilds its buckets, after its
    first backward, in the order the gradients became ready. An uninterrupted run takes step
    1 on the first layout and every later step on the rebuilt one; a run resumed from a
    checkpoint would take its first step on the first layout. With 3 or more ranks the
    ring all-reduce then adds the ranks' gradients in another order (float addition is not
    associative) and the weights differ in the last bits. One zero-loss forward and
    backward on ``example`` (buffers restored, gradients dropped; a collective: every rank
    calls it) records the order, so the resumed run's first step uses the rebuilt layout and
    stays bit-identical.

    Args:
        ddp_model: a ``DistributedDataParallel`` model (anything else: nothing happens).
        example: an input batch of the right shape (its values do not matter).
        autocast: the run's autocast context (``None``: none), so that the same kernels run.
    """
    if not hasattr(ddp_model, "no_sync"):
        return
    inner = ddp_model.module
    buffers = {k: v.clone() for k, v in inner.named_buffers()}
    with autocast or contextlib.nullcontext():
        out = ddp_model(example)
    (out.float().sum() * 0.0).backward()
    ddp_model.zero_grad(set_to_none=True)
    with torch.no_grad():
        for k, v in inner.named_buffers():
            v.copy_(buffers[k])


def free_port() -> int:
    """A TCP port that nothing listens on now (bind port 0 on 127.0.0.1, read it, close), the
    way ``torchrun --standalone`` picks one: used at once, it is free but for a rare race.

    Example:
        >>> 0 < free_port() < 65536
        True
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
