"""Reference parameter servers of lab 2 (exercises 2 and 3), and the hub average that is not one.

**Instructor only.** :func:`parameter_server` is what the solutions of exercises 2 and 3 do:
rank 0, the server, holds the parameters and an optimizer; every other rank is a worker that
computes gradients on its own data, pushes them, and pulls parameters. With ``staleness = s``
the gradient of step ``t`` is computed on the parameters after step ``max(0, t - s)``: a worker
runs up to ``s`` steps ahead of the parameters it holds and never waits for parameters it
does not need yet. ``s = 0`` is the synchronous server of exercise 2.

:func:`reduce_broadcast_average` is the average through one rank that the first version of
lab 2 called a parameter server: a reduce and a broadcast, with no state of its own.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ddp_lab.answers.lab02.references import _peer, _rank_and_size


def parameter_server(
    params: torch.Tensor,
    optimizer: torch.optim.Optimizer | None,
    grad_fn,
    steps: int,
    staleness: int = 0,
) -> torch.Tensor:
    """Train ``params`` for ``steps`` steps with a parameter server on rank 0.

    Args:
        params: the parameters, the same initial values on every rank; updated in place.
        optimizer: on rank 0, an optimizer over ``[params]``; None on the workers.
        grad_fn: on a worker, ``grad_fn(params) -> gradient`` on its own data; None on rank 0.
        steps: optimizer steps.
        staleness: how many steps a worker may run ahead of the parameters it holds.

    Returns:
        ``params``, now the server's final parameters on every rank.

    Example:
        >>> # torchrun --nproc_per_node=3 ...: rank 0 serves, ranks 1 and 2 compute
        >>> parameter_server(p, opt if rank == 0 else None, grad, 10)  # doctest: +SKIP
    """
    rank, n = _rank_and_size(None)
    if rank == 0:
        incoming, pending = torch.empty_like(params), []
        for _ in range(steps):
            total = torch.zeros_like(params)
            for worker in range(1, n):
                dist.recv(incoming, src=worker)
                total += incoming
            params.grad = total / (n - 1)
            optimizer.step()
            version = params.detach().clone()  # isend reads it later: never change it
            pending += [dist.isend(version, dst=worker) for worker in range(1, n)]
        for request in pending:
            request.wait()
    else:
        pulled = 0  # versions of the parameters received so far
        for step in range(steps):
            while pulled < step - staleness:
                dist.recv(params, src=0)
                pulled += 1
            dist.send(grad_fn(params), dst=0)
        while pulled < steps:
            dist.recv(params, src=0)
            pulled += 1
    return params


def reduce_broadcast_average(
    tensor: torch.Tensor, server_rank: int = 0, group=None
) -> torch.Tensor:
    """Average ``tensor`` over all ranks, in place, through one central rank: a reduce and a
    broadcast through rank ``server_rank``, an all-reduce with a hub.

    Every other rank sends its tensor to the hub; the hub adds them up (in rank order),
    divides by the world size and sends the average back to every rank. Its link carries
    ``2(n - 1)`` full tensors, which is why the ring scales better. It holds no state of its
    own: this is what the first version of lab 2 called a parameter server, and is not one
    (:func:`parameter_server` is).

    Args:
        tensor: the local values (floating point; same shape on every rank).
        server_rank: the rank that plays the server (rank within ``group``).
        group: the process group (default: the whole job).

    Returns:
        ``tensor`` itself, now ``all_reduce(SUM) / world_size``. With one rank it is left
        unchanged.

    Raises:
        ValueError: when ``server_rank`` is not a rank of the group.

    Example:
        >>> # torchrun --nproc_per_node=2 ...; rank r holds [2.0 * r]
        >>> reduce_broadcast_average(torch.tensor([2.0 * r]))  # doctest: +SKIP
        tensor([1.])
    """
    rank, n = _rank_and_size(group)
    if not 0 <= server_rank < n:
        raise ValueError(f"server_rank must be in 0..{n - 1}, got {server_rank}")
    if n == 1 or tensor.numel() == 0:
        return tensor
    with torch.no_grad():
        flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
        server = _peer(group, server_rank)
        if rank == server_rank:
            total = torch.zeros_like(flat)
            incoming = torch.empty_like(flat)
            for r in range(n):  # rank order, like the reference sum
                if r == server_rank:
                    total.add_(flat)
                else:
                    dist.recv(incoming, _peer(group, r), group=group)
                    total.add_(incoming)
            flat.copy_(total.div_(n))
            sends = [dist.isend(flat, _peer(group, r), group=group) for r in range(n) if r != rank]
            for req in sends:
                req.wait()
        else:
            dist.send(flat, server, group=group)
            dist.recv(flat, server, group=group)
        if not tensor.is_contiguous():
            tensor.copy_(flat.view(tensor.shape))
    return tensor
