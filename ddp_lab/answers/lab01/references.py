"""Reference answers of lab 1 (instructor only: not in the student kit).

What the solution notebook's cells compute, written once for the grader's exact checks and
diagnoses and for the tests.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable

import torch
from torch import nn


def shard_sizes(batch: int, n: int) -> list[int]:
    """The balanced split of ``batch`` samples into ``n`` shards (first ``batch % n`` larger).

    Example:
        >>> shard_sizes(10, 4), shard_sizes(2, 3)
        ([3, 3, 2, 2], [1, 1, 0])
    """
    base, extra = divmod(batch, n)
    return [base + 1 if k < extra else base for k in range(n)]


def reference_split_batch(x: torch.Tensor, y: torch.Tensor, n: int) -> list[tuple]:
    """Exercise 1: ``n`` shards ``(x_k, y_k)`` of :func:`shard_sizes`, in order (empty ones
    when ``n`` exceeds the batch).

    Example:
        >>> [len(xk) for xk, _ in reference_split_batch(torch.zeros(10), torch.zeros(10), 4)]
        [3, 3, 2, 2]
    """
    sizes = shard_sizes(x.shape[0], n)
    return list(zip(torch.split(x, sizes), torch.split(y, sizes), strict=True))


def shard_gradients(
    model: nn.Module, shards: list[tuple[torch.Tensor, torch.Tensor]], loss_fn: Callable
) -> list[tuple[int, float, list[torch.Tensor]]]:
    """``(B_k, mean loss, gradients)`` of one replica per non-empty shard; ``model`` untouched."""
    out = []
    for xk, yk in shards:
        if len(yk) == 0:
            continue
        replica = copy.deepcopy(model)
        loss = loss_fn(replica(xk), yk)
        out.append((len(yk), loss.item(), list(torch.autograd.grad(loss, replica.parameters()))))
    return out


def reference_data_parallel_step(
    model: nn.Module, shards: list[tuple[torch.Tensor, torch.Tensor]], loss_fn: Callable, lr: float
) -> float:
    """Exercise 2: one replica per non-empty shard, gradients and losses combined with
    weights ``B_k / B``, the gradient left in ``.grad`` and one SGD step; returns the loss.

    Example:
        >>> import torch.nn.functional as F
        >>> m = nn.Linear(3, 2).double()
        >>> x, y = torch.randn(5, 3, dtype=torch.float64), torch.tensor([0, 1, 0, 1, 1])
        >>> loss = reference_data_parallel_step(m, [(x[:4], y[:4]), (x[4:], y[4:])],
        ...                                     F.cross_entropy, 0.1)
        >>> m.weight.grad.shape
        torch.Size([2, 3])
    """
    total = sum(len(yk) for _, yk in shards)
    params = list(model.parameters())
    combined = [torch.zeros_like(p) for p in params]
    loss = 0.0
    for size, shard_loss, grads in shard_gradients(model, shards, loss_fn):
        loss += size / total * shard_loss
        for acc, g in zip(combined, grads, strict=True):
            acc += size / total * g
    with torch.no_grad():
        for p, g in zip(params, combined, strict=True):
            p.grad = g
            p -= lr * g
    return loss


def reference_data_parallel_forward(module: nn.Module, x: torch.Tensor, n: int) -> torch.Tensor:
    """Exercise 3: ``torch.chunk`` pieces, one replica per piece whose parameters are clones
    of ``module``'s (autograd adds their gradients into ``module``), one thread each, outputs
    concatenated.

    Example:
        >>> m = nn.Linear(3, 2)
        >>> x = torch.randn(5, 3)
        >>> torch.allclose(reference_data_parallel_forward(m, x, 2), m(x))
        True
    """
    pieces = torch.chunk(x, n)
    replicas = [copy.deepcopy(module) for _ in pieces]
    params = [{k: p.clone() for k, p in module.named_parameters()} for _ in pieces]
    outputs: list = [None] * len(pieces)

    def work(k: int) -> None:
        outputs[k] = torch.func.functional_call(replicas[k], params[k], (pieces[k],))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(len(pieces))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return torch.cat(outputs)


def reference_combine_shard_stats(
    means: torch.Tensor, variances: torch.Tensor, counts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exercise 4: mean and biased variance of the union of shards from their means,
    biased variances and counts; empty shards (count 0, NaN statistics) left out. The
    variance adds the spread of the shard means around the batch mean (deviations: no
    large number is subtracted from another).

    Example:
        >>> m, v = reference_combine_shard_stats(torch.tensor([[0.0], [2.0]]),
        ...                                      torch.zeros(2, 1), torch.tensor([1, 1]))
        >>> m.item(), v.item()
        (1.0, 1.0)
    """
    keep = counts > 0
    w = counts[keep].to(means.dtype).unsqueeze(1) / counts.sum().to(means.dtype)
    mean = (w * means[keep]).sum(0)
    var = (w * (variances[keep] + (means[keep] - mean) ** 2)).sum(0)
    return mean, var


def within_shard_variance(variances: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The count-weighted mean of the shard variances: half of exercise 4's variance (a
    typical mistake leaves out the other half, the spread of the shard means).

    Example:
        >>> within_shard_variance(torch.tensor([[1.0], [4.0]]), torch.tensor([3, 1]))
        tensor([1.7500])
    """
    keep = counts > 0
    w = counts[keep].to(variances.dtype).unsqueeze(1)
    return (w * variances[keep]).sum(0) / w.sum()


def chain_transfer_s(n: int, nbytes: float, chunk_bytes: float, bandwidth: float) -> float:
    """Seconds of a pipelined transfer of ``nbytes`` along a chain of ``n`` devices in chunks
    of ``chunk_bytes``: the bytes pass the first link, then the last chunk (at most a chunk)
    has ``n - 2`` more links to go.

    Example:
        >>> chain_transfer_s(3, 4.0, 1.0, 1.0), chain_transfer_s(3, 0.5, 1.0, 1.0)
        (5.0, 1.0)
    """
    if n <= 1:
        return 0.0
    return (nbytes + (n - 2) * min(chunk_bytes, nbytes)) / bandwidth


def step_time_terms(
    n: int,
    *,
    compute_s: float,
    param_bytes: float,
    batch_bytes: float,
    output_bytes: float,
    bandwidth: float,
    host_s: float,
    chunk_bytes: float,
) -> dict[str, float]:
    """Exercise 5: the terms of the ``nn.DataParallel`` step-time model, in seconds.

    Example:
        >>> t = step_time_terms(3, compute_s=0.3, param_bytes=1e9, batch_bytes=0.0,
        ...                     output_bytes=0.0, bandwidth=1e9, host_s=0.0, chunk_bytes=2.5e8)
        >>> round(sum(t.values()), 9)
        2.6
    """
    pipeline = chain_transfer_s(n, param_bytes, chunk_bytes, bandwidth)
    return {
        "compute": compute_s / n,
        "replicate": pipeline,
        "reduce": pipeline,
        "scatter": (n - 1) / n * batch_bytes / bandwidth,
        "gather": 2 * (n - 1) / n * output_bytes / bandwidth,
        "python": n * host_s,
    }


def reference_step_time(n: int, **costs: float) -> float:
    """Exercise 5: the predicted step time, the sum of :func:`step_time_terms`.

    Example:
        >>> reference_step_time(1, compute_s=0.5, param_bytes=1.0, batch_bytes=1.0,
        ...                     output_bytes=1.0, bandwidth=1.0, host_s=0.25, chunk_bytes=1.0)
        0.75
    """
    return sum(step_time_terms(n, **costs).values())
