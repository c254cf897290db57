"""Reference answers of lab 1 (instructor only: not in the student kit).

What the solution notebook's cells compute, written once for the grader's exact checks and
diagnoses and for the tests. Float64 throughout.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn


def shard_sizes(batch: int, n: int) -> list[int]:
    """The balanced split of ``batch`` samples into ``n`` shards (first ``batch % n`` larger).

    Example:
        >>> shard_sizes(10, 4)
        [3, 3, 2, 2]
    """
    base, extra = divmod(batch, n)
    return [base + 1 if k < extra else base for k in range(n)]


def reference_split_batch(x: torch.Tensor, y: torch.Tensor, n: int) -> list[tuple]:
    """Exercise 1: ``n`` shards ``(x_k, y_k)`` of :func:`shard_sizes`, in order.

    Example:
        >>> [len(xk) for xk, _ in reference_split_batch(torch.zeros(10), torch.zeros(10), 4)]
        [3, 3, 2, 2]
    """
    sizes = shard_sizes(x.shape[0], n)
    return list(zip(torch.split(x, sizes), torch.split(y, sizes), strict=True))


def reference_average_gradients(grads: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """Exercise 2: mean over replicas of each parameter's gradient (``grads[replica][i]``).

    Example:
        >>> reference_average_gradients([[torch.ones(2)], [torch.zeros(2)]])
        [tensor([0.5000, 0.5000])]
    """
    return [torch.stack(g).mean(0) for g in zip(*grads, strict=True)]


def reference_data_parallel_gradients(
    model: nn.Module, shards: list[tuple[torch.Tensor, torch.Tensor]], loss_fn: Callable
) -> list[torch.Tensor]:
    """Exercise 3: one replica per shard, gradients combined with weights ``B_k / B``.

    Example:
        >>> m = nn.Linear(3, 2).double()
        >>> x, y = torch.randn(5, 3, dtype=torch.float64), torch.tensor([0, 1, 0, 1, 1])
        >>> import torch.nn.functional as F
        >>> g = reference_data_parallel_gradients(m, [(x[:4], y[:4]), (x[4:], y[4:])],
        ...                                       F.cross_entropy)
        >>> len(g), m.weight.grad is None
        (2, True)
    """
    total = sum(len(xk) for xk, _ in shards)
    combined = [torch.zeros_like(p) for p in model.parameters()]
    for xk, yk in shards:
        replica = copy.deepcopy(model)
        replica.zero_grad(set_to_none=True)
        loss_fn(replica(xk), yk).backward()
        for acc, p in zip(combined, replica.parameters(), strict=True):
            acc += p.grad * (len(xk) / total)
    return combined


def reference_combine_shard_stats(
    means: torch.Tensor, variances: torch.Tensor, counts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exercise 4: mean and biased variance of the union of shards from their means,
    biased variances and counts.

    Example:
        >>> m, v = reference_combine_shard_stats(torch.tensor([[0.0], [2.0]]),
        ...                                      torch.zeros(2, 1), torch.tensor([1, 1]))
        >>> m.item(), v.item()
        (1.0, 1.0)
    """
    w = counts.to(means.dtype).unsqueeze(1)
    mean = (w * means).sum(0) / w.sum()
    var = (w * (variances + (means - mean) ** 2)).sum(0) / w.sum()
    return mean, var


def within_shard_variance(variances: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The count-weighted mean of the shard variances: half of exercise 4's variance (a
    typical mistake leaves out the other half, the spread of the shard means).

    Example:
        >>> within_shard_variance(torch.tensor([[1.0], [4.0]]), torch.tensor([3, 1]))
        tensor([1.7500])
    """
    w = counts.to(variances.dtype).unsqueeze(1)
    return (w * variances).sum(0) / w.sum()


def step_time_terms(
    n: int,
    *,
    compute_s: float,
    param_bytes: float,
    batch_bytes: float,
    output_bytes: float,
    bandwidth: float,
    host_s: float,
) -> dict[str, float]:
    """Exercise 5: the terms of the notebook's ``nn.DataParallel`` step-time model, in seconds.

    Example:
        >>> t = step_time_terms(2, compute_s=1.0, param_bytes=1e9, batch_bytes=1e9,
        ...                     output_bytes=0.0, bandwidth=1e9, host_s=0.0)
        >>> sum(t.values())
        3.0
    """
    return {
        "compute": compute_s / n,
        "replicate": (n - 1) * param_bytes / bandwidth,
        "reduce": (n - 1) * param_bytes / bandwidth,
        "scatter": (n - 1) / n * batch_bytes / bandwidth,
        "gather": 2 * (n - 1) / n * output_bytes / bandwidth,
        "python": n * host_s,
    }


def reference_step_time(n: int, **costs: float) -> float:
    """Exercise 5: the predicted step time, the sum of :func:`step_time_terms`.

    Example:
        >>> reference_step_time(1, compute_s=0.5, param_bytes=1.0, batch_bytes=1.0,
        ...                     output_bytes=1.0, bandwidth=1.0, host_s=0.25)
        0.75
    """
    return sum(step_time_terms(n, **costs).values())
