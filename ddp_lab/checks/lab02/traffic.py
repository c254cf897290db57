"""Who sends how much to whom: the point-to-point traffic of the student's code, recorded in
the checker's rank process, and what a ring's traffic must look like.

:func:`recorded` wraps ``isend`` and ``irecv`` in ``torch.distributed`` and in
``distributed_c10d`` before the student's file is loaded. Every way of moving data point to
point goes through them (``dist.send`` and ``dist.recv`` call them, and so does
``batch_isend_irecv`` with its ``P2POp``\\ s), so each message is recorded once, as
``(kind, src, dst, numel)`` in global ranks, ``src = -1`` for a receive from any rank.

:func:`ring_problem` is the ring's property: rank ``r`` sends only to its right neighbour
``(r + 1) % n``, and sends ``2(n - 1)/n`` of the tensor in total (within one chunk, the
rounding of a length that ``n`` does not divide).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist


def _global(group, peer, group_peer) -> int:
    if peer is not None:
        return int(peer)
    if group_peer is None:
        return -1
    return int(group_peer) if group is None else int(dist.get_global_rank(group, group_peer))


@contextmanager
def recorded(log: list) -> Iterator[None]:
    """While the block runs, every message sent or received is appended to ``log`` as
    ``("send" | "recv", src, dst, numel)``.

    Example:
        >>> log = []
        >>> with recorded(log):  # doctest: +SKIP
        ...     dist.send(torch.zeros(3), dst=1)
        >>> log  # doctest: +SKIP
        [('send', 0, 1, 3)]
    """
    import torch.distributed.distributed_c10d as c10d

    isend, irecv = c10d.isend, c10d.irecv

    def recorded_isend(tensor, dst=None, group=None, tag=0, group_dst=None):
        log.append(("send", dist.get_rank(), _global(group, dst, group_dst), tensor.numel()))
        return isend(tensor, dst, group, tag, group_dst=group_dst)

    def recorded_irecv(tensor, src=None, group=None, tag=0, group_src=None):
        log.append(("recv", _global(group, src, group_src), dist.get_rank(), tensor.numel()))
        return irecv(tensor, src, group, tag, group_src=group_src)

    saved = [(m, n, getattr(m, n)) for m in (dist, c10d) for n in ("isend", "irecv")]
    for module in (dist, c10d):
        module.isend, module.irecv = recorded_isend, recorded_irecv
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def sends(log: list, since: int = 0) -> list[list[int]]:
    """``[[dst, numel], ...]`` of the messages sent since entry ``since`` of ``log``."""
    return [[dst, numel] for kind, _, dst, numel in log[since:] if kind == "send"]


def ring_volume(numel: int, n: int) -> float:
    """Elements each rank of a ring all-reduce sends: ``2(n - 1)/n`` of the tensor."""
    return 2 * (n - 1) * numel / n


def ring_problem(shape: tuple, sent: list, n: int) -> str | None:
    """What is wrong with the traffic of one ring all-reduce, or None.

    Args:
        shape: the tensor's shape.
        sent: each rank's ``[[dst, numel], ...]``.
        n: ranks on the ring.
    """
    numel = math.prod(shape)
    where = f"with {n} ranks and a tensor of shape {tuple(shape)}"
    for rank, messages in enumerate(sent):
        right = (rank + 1) % n
        wrong = sorted({int(dst) for dst, _ in messages if int(dst) != right})
        if wrong:
            return (
                f"{where}: rank {rank} sent to rank(s) {wrong}: on a ring, rank r sends only to "
                f"its right neighbour (r + 1) % n, here rank {right} (and receives only from its "
                "left one), even where another order would reach the same sum"
            )
    ideal, chunk = ring_volume(numel, n), math.ceil(numel / n)
    for rank, messages in enumerate(sent):
        volume = sum(int(k) for _, k in messages)
        if abs(volume - ideal) > chunk:
            why = (
                "more than a ring needs: does each step pass on one chunk, not the whole tensor?"
                if volume > ideal
                else "less than a ring needs: does every chunk travel in both phases?"
            )
            return (
                f"{where}: rank {rank} sent {volume} elements in all; each rank of a ring "
                f"all-reduce sends 2(n - 1)/n of the tensor, {ideal:.4g} elements here (give or "
                f"take one chunk, {chunk}): {why}"
            )
    return None
