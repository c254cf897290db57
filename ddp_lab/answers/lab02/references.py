"""Reference answers of lab 2: a ring all-reduce and the cost models (the parameter servers
are in :mod:`ddp_lab.answers.lab02.servers`).

**Instructor only** (``ddp_lab.answers`` is not in the student kit). What the solutions of
``solutions/lab02_collectives`` do, written as a small library that the grader's exact
checks (:mod:`ddp_lab.answers.lab02.hidden`), the tests and ``make bench`` use. The ring is
built from point-to-point messages only (``dist.isend`` / ``dist.recv``), so that every byte
that moves is a line you can point at, and it must agree with ``dist.all_reduce``.

**Ring all-reduce** (exercise 1). The ``n`` ranks sit on a ring; rank ``r`` only ever sends
to ``r + 1`` and receives from ``r - 1`` (mod ``n``). The tensor is flattened and cut into
``n`` chunks (``torch.tensor_split``: lengths that ``n`` does not divide give chunks of
unequal length, some empty when the tensor has fewer than ``n`` elements). Then two phases:

1. *reduce-scatter*, ``n - 1`` steps: at step ``s`` rank ``r`` sends chunk ``(r - s) % n``
   and adds what it receives into chunk ``(r - s - 1) % n``. Afterwards rank ``r`` holds the
   full sum of chunk ``(r + 1) % n`` (:func:`ring_owned_chunk`).
2. *all-gather*, ``n - 1`` steps: at step ``s`` rank ``r`` sends chunk ``(r + 1 - s) % n``
   and overwrites chunk ``(r - s) % n`` with what it receives.

:func:`ring_schedule` lists the same messages as plain Python, for checking a schedule (and
simulating a ring in the tests) without starting processes.

**Alpha-beta models** (exercise 4). Each of the ring's ``2(n - 1)`` steps pays a latency
``alpha`` and moves ``S / n`` bytes at bandwidth ``B``, so a ring all-reduce of ``S`` bytes
takes ``2(n - 1)/n * S/B + 2(n - 1) * alpha`` (:func:`ring_allreduce_time`). One step of the
synchronous server passes ``2(n - 1)`` whole messages through the server's one link, one after
the other: ``2(n - 1) * (alpha + S/B)`` (:func:`server_step_time`). :func:`fit_alpha_beta`
recovers ``alpha`` and ``B`` from measured times. Measuring them is runtime, not an answer:
:func:`ddp_lab.bandwidth.measure_all_reduce`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

# --------------------------------------------------------------------------- the ring


def ring_owned_chunk(rank: int, world_size: int) -> int:
    """The chunk that ``rank`` holds fully reduced after the ring's reduce-scatter.

    Args:
        rank: rank in the group, ``0 .. world_size - 1``.
        world_size: number of ranks on the ring.

    Returns:
        ``(rank + 1) % world_size``.

    Example:
        >>> [ring_owned_chunk(r, 4) for r in range(4)]
        [1, 2, 3, 0]
    """
    return (rank + 1) % world_size


def ring_schedule(world_size: int) -> list[list[tuple[int, int, int]]]:
    """Who sends which chunk to whom at each step of a ring all-reduce (pure Python).

    Args:
        world_size: number of ranks ``n`` (at least 1).

    Returns:
        ``2 * (n - 1)`` steps, each a list of ``(src, dst, chunk)`` messages, one per rank,
        with ``dst == (src + 1) % n``. The first ``n - 1`` steps are the reduce-scatter (the
        receiver *adds* the chunk into its own copy), the last ``n - 1`` the all-gather (the
        receiver *overwrites* its copy). One rank: no steps.

    Raises:
        ValueError: when ``world_size < 1``.

    Example:
        >>> steps = ring_schedule(3)
        >>> steps[0]            # reduce-scatter, step 0
        [(0, 1, 0), (1, 2, 1), (2, 0, 2)]
        >>> steps[2]            # all-gather, step 0: each rank passes on its reduced chunk
        [(0, 1, 1), (1, 2, 2), (2, 0, 0)]
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    n = world_size
    reduce_scatter = [[(r, (r + 1) % n, (r - s) % n) for r in range(n)] for s in range(n - 1)]
    all_gather = [[(r, (r + 1) % n, (r + 1 - s) % n) for r in range(n)] for s in range(n - 1)]
    return reduce_scatter + all_gather


def ring_chunks(flat: torch.Tensor, world_size: int) -> list[torch.Tensor]:
    """Cut a 1-D tensor into ``world_size`` contiguous views, as the ring does.

    Args:
        flat: a 1-D tensor.
        world_size: number of chunks.

    Returns:
        ``world_size`` views of ``flat`` (``torch.tensor_split``): the first
        ``len % world_size`` chunks are one element longer, and chunks are empty when
        ``len < world_size``. Writing into a chunk writes into ``flat``.

    Example:
        >>> [c.tolist() for c in ring_chunks(torch.arange(5.0), 3)]
        [[0.0, 1.0], [2.0, 3.0], [4.0]]
    """
    return list(torch.tensor_split(flat, world_size))


def ring_reduce_scatter(chunks: list[torch.Tensor], group=None) -> torch.Tensor:
    """Phase 1 of the ring: sum the chunks so that each rank ends with one of them complete.

    Args:
        chunks: this rank's ``world_size`` chunks (see :func:`ring_chunks`); modified in place.
        group: the process group (default: the whole job).

    Returns:
        ``chunks[ring_owned_chunk(rank, world_size)]``, now the sum over all ranks. The other
        chunks hold partial sums.

    Example:
        >>> # inside a 2-process job, rank r holding [r, r] split in 2 chunks
        >>> ring_reduce_scatter(ring_chunks(torch.full((2,), float(r)), 2))  # doctest: +SKIP
        tensor([1.])
    """
    rank, n = _rank_and_size(group)
    _check_chunks(chunks, n)
    right, left = _peer(group, (rank + 1) % n), _peer(group, (rank - 1) % n)
    with torch.no_grad():
        for step in range(n - 1):
            send_idx, recv_idx = (rank - step) % n, (rank - step - 1) % n
            received = _exchange(chunks[send_idx], right, chunks[recv_idx], left, group)
            chunks[recv_idx].add_(received)
    return chunks[ring_owned_chunk(rank, n)]


def ring_all_gather(chunks: list[torch.Tensor], group=None) -> list[torch.Tensor]:
    """Phase 2 of the ring: pass each completed chunk around until every rank has all.

    Args:
        chunks: this rank's chunks after :func:`ring_reduce_scatter` (the owned one complete);
            modified in place.
        group: the process group (default: the whole job).

    Returns:
        ``chunks``, every one now equal to the owning rank's chunk.

    Example:
        >>> chunks = ring_chunks(flat, dist.get_world_size())  # doctest: +SKIP
        >>> ring_all_gather(chunks)                             # doctest: +SKIP
    """
    rank, n = _rank_and_size(group)
    _check_chunks(chunks, n)
    right, left = _peer(group, (rank + 1) % n), _peer(group, (rank - 1) % n)
    with torch.no_grad():
        for step in range(n - 1):
            send_idx, recv_idx = (rank + 1 - step) % n, (rank - step) % n
            received = _exchange(chunks[send_idx], right, chunks[recv_idx], left, group)
            chunks[recv_idx].copy_(received)
    return chunks


def ring_all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Sum ``tensor`` over all ranks, in place, with a ring of sends and receives.

    Equivalent to ``dist.all_reduce(tensor, op=dist.ReduceOp.SUM)`` up to floating-point
    summation order. Any shape and length works (lengths not divisible by the world size, and
    fewer elements than ranks, included); every rank must call it with the same shape.

    Args:
        tensor: the local values (float32 or float64, on a device the backend supports).
        group: the process group (default: the whole job).

    Returns:
        ``tensor`` itself, now holding the sum. With one rank it is left unchanged.

    Example:
        >>> # torchrun --nproc_per_node=2 ...; rank r holds [r + 1.0, r + 1.0]
        >>> ring_all_reduce(torch.full((2,), r + 1.0))  # doctest: +SKIP
        tensor([3., 3.])
    """
    _, n = _rank_and_size(group)
    if n == 1:
        return tensor
    with torch.no_grad():
        flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
        chunks = ring_chunks(flat, n)
        ring_reduce_scatter(chunks, group)
        ring_all_gather(chunks, group)
        if not tensor.is_contiguous():
            tensor.copy_(flat.view(tensor.shape))
    return tensor


# --------------------------------------------------------------------------- alpha-beta model


def ring_allreduce_time(
    size_bytes: float | np.ndarray, world_size: int, alpha: float, beta_bytes_per_s: float
) -> float | np.ndarray:
    """Predicted time of a ring all-reduce under the alpha-beta model.

    ``T = 2(n - 1)/n * S/B + 2(n - 1) * alpha``: ``2(n - 1)`` steps, each paying the latency
    ``alpha`` and moving ``S / n`` bytes at bandwidth ``B``.

    Args:
        size_bytes: message size ``S`` in bytes (a number or a numpy array).
        world_size: number of ranks ``n`` (at least 1; one rank costs nothing).
        alpha: per-message latency in seconds.
        beta_bytes_per_s: link bandwidth ``B`` in bytes per second.

    Returns:
        Seconds, a float (or an array shaped like ``size_bytes``).

    Example:
        >>> ring_allreduce_time(1e9, 4, alpha=1e-5, beta_bytes_per_s=1e10)
        0.15006
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    n = world_size
    t = 2 * (n - 1) / n * np.asarray(size_bytes, dtype=float) / beta_bytes_per_s
    t = t + 2 * (n - 1) * alpha
    return float(t) if t.ndim == 0 else t


def server_step_time(
    size_bytes: float | np.ndarray, world_size: int, alpha: float, beta_bytes_per_s: float
) -> float | np.ndarray:
    """Predicted time of one synchronous parameter-server step under the alpha-beta model.

    ``T = 2(n - 1) * (alpha + S/B)``: the server's one link receives the ``n - 1`` workers'
    gradients, then sends the parameters back to each of them, one message after the other.

    Example:
        >>> server_step_time(1e9, 4, alpha=1e-5, beta_bytes_per_s=1e10)
        0.60006
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    t = 2 * (world_size - 1) * (alpha + np.asarray(size_bytes, dtype=float) / beta_bytes_per_s)
    return float(t) if t.ndim == 0 else t


def fit_alpha_beta(
    sizes_bytes: Sequence[float] | np.ndarray,
    seconds: Sequence[float] | np.ndarray,
    world_size: int,
    *,
    relative: bool = False,
) -> tuple[float, float]:
    """Fit latency and bandwidth of the ring model to measured times by least squares.

    The model is linear in ``alpha`` and ``1/B``: ``T = 2(n - 1) * alpha + 2(n - 1)/n * S * (1/B)``.

    Args:
        sizes_bytes: message sizes ``S`` in bytes (at least two distinct ones).
        seconds: measured times, one per size.
        world_size: number of ranks ``n`` the times were measured with (at least 2).
        relative: minimise relative instead of absolute errors. Times over sizes that span
            orders of magnitude are otherwise fitted by the largest messages alone, and the
            latency of the small ones is lost.

    Returns:
        ``(alpha, bandwidth)``: seconds per message and bytes per second. Noise can make
        ``alpha`` slightly negative; ``bandwidth`` is ``inf`` when the fitted slope is not
        positive (times that do not grow with size).

    Raises:
        ValueError: on mismatched lengths, fewer than two distinct sizes, non-finite values
            or ``world_size < 2``.

    Example:
        >>> sizes = [1e3, 1e6, 1e8]
        >>> times = [ring_allreduce_time(s, 4, 2e-5, 1e9) for s in sizes]
        >>> alpha, bw = fit_alpha_beta(sizes, times, 4)
        >>> round(alpha * 1e6, 6), round(bw / 1e9, 6)
        (20.0, 1.0)
    """
    if world_size < 2:
        raise ValueError(f"the ring model needs world_size >= 2, got {world_size}")
    s = np.asarray(sizes_bytes, dtype=float).ravel()
    t = np.asarray(seconds, dtype=float).ravel()
    if s.shape != t.shape:
        raise ValueError(f"{s.size} sizes but {t.size} times; give one time per size")
    if not (np.all(np.isfinite(s)) and np.all(np.isfinite(t))):
        raise ValueError("sizes and times must be finite numbers")
    if np.unique(s).size < 2:
        raise ValueError("need at least two distinct message sizes to separate alpha from B")
    n = world_size
    design = np.column_stack([np.full_like(s, 2.0 * (n - 1)), 2.0 * (n - 1) / n * s])
    target = t
    if relative:
        if np.any(t <= 0):
            raise ValueError("relative=True needs positive times")
        design, target = design / t[:, None], np.ones_like(t)
    scale = np.linalg.norm(design, axis=0)  # columns differ by ~1e8; scale for conditioning
    coef, *_ = np.linalg.lstsq(design / scale, target, rcond=None)
    alpha, inv_bandwidth = coef / scale
    bandwidth = 1.0 / inv_bandwidth if inv_bandwidth > 0 else math.inf
    return float(alpha), float(bandwidth)


# --------------------------------------------------------------------------- helpers


def _rank_and_size(group) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _peer(group, group_rank: int) -> int:
    """Global rank of ``group_rank`` (send/recv address peers by global rank)."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def _check_chunks(chunks: list[torch.Tensor], world_size: int) -> None:
    if len(chunks) != world_size:
        raise ValueError(f"expected {world_size} chunks (one per rank), got {len(chunks)}")


def _exchange(
    send: torch.Tensor, dst: int, recv_like: torch.Tensor, src: int, group
) -> torch.Tensor:
    """Send ``send`` to ``dst`` while receiving a tensor shaped like ``recv_like`` from ``src``.

    The send is non-blocking so that every rank of the ring can post it and then block in its
    receive without deadlock. Empty chunks are not sent: both ends know the chunk lengths.
    """
    request = dist.isend(send, dst, group=group) if send.numel() else None
    received = torch.empty_like(recv_like)
    if received.numel():
        dist.recv(received, src, group=group)
    if request is not None:
        request.wait()
    return received
