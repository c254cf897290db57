"""Time a collective over message sizes inside a distributed job (lab 2's sweep, ``make``
targets and cluster scripts).

:func:`measure_all_reduce` times any collective called as ``fn(tensor)``: ``dist.all_reduce``
by default, or your own ring all-reduce. Every rank of the job calls it; the times it returns
are what the alpha-beta model of lab 2 is fitted to.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist


def measure_all_reduce(
    sizes_bytes: Sequence[int],
    repeats: int = 10,
    fn: Callable[..., object] = dist.all_reduce,
    *,
    warmup: int = 2,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    group=None,
) -> list[float]:
    """Time a collective over message sizes; call it on every rank of a running job.

    For each size, ``fn`` runs ``warmup`` times untimed, then ``repeats`` times, each after a
    barrier so that all ranks start together. A repeat's time is the slowest rank's (the
    collective is not done until every rank is), and the median over repeats is reported.

    Args:
        sizes_bytes: message sizes in bytes; each becomes ``max(1, size // itemsize)``
            elements of ``dtype``.
        repeats: timed calls per size.
        fn: the collective, called as ``fn(tensor)`` (or ``fn(tensor, group=group)``), e.g.
            ``dist.all_reduce`` or a hand-written ring all-reduce.
        warmup: untimed calls per size first (connection set-up, allocator, caches).
        dtype: element type of the message.
        device: where the message lives (``"cuda:<local_rank>"`` with NCCL).
        group: the process group (default: the whole job).

    Returns:
        Median seconds per size, the same list on every rank.

    Raises:
        RuntimeError: when no process group is initialised (not under torchrun).
        ValueError: when ``repeats < 1`` or ``warmup < 0``.

    Example:
        >>> # inside a torchrun worker, after ddp_lab.dist.setup()
        >>> measure_all_reduce([1 << 10, 1 << 20], repeats=5)  # doctest: +SKIP
        [0.00011, 0.0021]
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "measure_all_reduce needs a process group: call it inside a torchrun worker "
            "after ddp_lab.dist.setup() (or dist.init_process_group)"
        )
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got {repeats} and {warmup}")
    device = torch.device(device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    kwargs = {} if group is None else {"group": group}
    times = torch.zeros(len(sizes_bytes), repeats, dtype=torch.float64)
    for i, size in enumerate(sizes_bytes):
        message = torch.zeros(max(1, int(size) // itemsize), dtype=dtype, device=device)
        for _ in range(warmup):
            fn(message, **kwargs)
        _synchronize(device)
        for j in range(repeats):
            dist.barrier(**kwargs)
            start = time.perf_counter()
            fn(message, **kwargs)
            _synchronize(device)
            times[i, j] = time.perf_counter() - start
    slowest = times.to(device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, **kwargs)
    return [statistics.median(row) for row in slowest.cpu().tolist()]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
