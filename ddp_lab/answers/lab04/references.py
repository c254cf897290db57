"""Reference answers of lab 4 (SyncBatchNorm): instructor only, not in the student kit.

The three exercises as the notebook's solution files hold them (self-contained: the grader
writes :data:`STATS_SOURCE` and :data:`GRAD_SOURCE` as ``sync_stats.py`` and
``sync_grad.py`` next to a student's ``sync_bn.py``, see ``hidden.py``), and the pieces the
tests use to simulate every rank in one process:

- :func:`sync_mean_var` (exercise 1): two all-reduces whose size does not depend on the
  world size: ``[n_k, sum_k(x)]`` (``C + 1`` values) gives every rank the global count and
  mean; then each rank's sum of squared deviations from that GLOBAL mean (``C`` values) gives
  the variance, numerically safe far from 0 (deviations, not ``E[x^2] - mean^2``); an empty
  slice contributes zeros and divides by nothing of its own. :func:`two_pass` is the same
  computation for every rank in one process (the tests' simulation); :func:`pool` is lab 1's
  combination of the ranks' ``(count, mean, variance)``, what an all-gather answer does,
  ``mean = sum_k w_k m_k`` and ``var = sum_k w_k (v_k + (m_k - mean)^2)`` with
  ``w_k = n_k / n``;
- :func:`sync_input_grad` (exercise 2): ``dx = weight * invstd * (dy - sum(dy) / n
  - x_hat * sum(dy * x_hat) / n)`` with both sums all-reduced (one collective);
  :func:`input_grad` is that formula for given sums;
- ``SyncBNFunction`` (exercise 3) is the notebook's ``sync_bn.py``: its forward calls
  :func:`sync_mean_var`, updates the running statistics in place (the unbiased variance for
  ``running_var``) and normalises; its backward calls :func:`sync_input_grad` and returns
  this rank's own ``sum(dy * x_hat)`` and ``sum(dy)`` for the weight and bias.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist

_FILE_HEAD = "import torch\nimport torch.distributed as dist\n\n\n"


def _dims(x: torch.Tensor) -> list[int]:
    return [0, *range(2, x.dim())]


def local_stats(x: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
    """``(n, mean, biased var)`` of one slice per channel, in its dtype (zeros when empty).

    Example:
        >>> n, m, v = local_stats(torch.tensor([[1.0], [3.0]]))
        >>> n, m.tolist(), v.tolist()
        (2, [2.0], [1.0])
    """
    c = x.size(1)
    n = x.numel() // c
    if n == 0:
        zeros = torch.zeros(c, dtype=x.dtype)
        return 0, zeros, zeros.clone()
    var, mean = torch.var_mean(x, dim=_dims(x), correction=0)
    return n, mean, var


def pool(counts, means: torch.Tensor, variances: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The global ``(mean, var, count)`` from every rank's ``(n_k, m_k, v_k)`` (rows).

    Example:
        >>> m, v, n = pool([1, 1], torch.tensor([[0.0], [2.0]]), torch.zeros(2, 1))
        >>> m.item(), v.item(), n.item()
        (1.0, 1.0, 2.0)
    """
    counts = torch.as_tensor(counts, dtype=means.dtype).reshape(-1, 1)
    total = counts.sum()
    w = counts / total
    mean = (w * means).sum(0)
    return mean, (w * (variances + (means - mean) ** 2)).sum(0), total


def sync_mean_var(x):
    """The per-channel mean, biased variance and count of the GLOBAL batch, on every rank."""
    dims = [0, *range(2, x.dim())]
    view = (1, -1, *([1] * (x.dim() - 2)))
    n = x.numel() // x.size(1)
    sums = torch.cat([x.new_tensor([n]), x.sum(dims)])  # an empty slice: zeros, weighs nothing
    dist.all_reduce(sums)  # the global count and per-channel sums: C + 1 values, any world
    count = sums[0]
    mean = sums[1:] / count
    squares = ((x - mean.reshape(view)) ** 2).sum(dims)  # deviations from the GLOBAL mean
    dist.all_reduce(squares)  # C values: the global sum of squared deviations
    return mean, squares / count, count


def two_pass(xs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`sync_mean_var` for every rank's slice ``xs`` in one process (the all-reduces
    as sums over the ranks, in rank order): the ``(mean, var, count)`` every rank gets."""
    dims = [0, *range(2, xs[0].dim())]
    view = (1, -1, *([1] * (xs[0].dim() - 2)))
    sums = sum(torch.cat([x.new_tensor([x.numel() // x.size(1)]), x.sum(dims)]) for x in xs)
    count = sums[0]
    mean = sums[1:] / count
    squares = sum(((x - mean.reshape(view)) ** 2).sum(dims) for x in xs)
    return mean, squares / count, count


def input_grad(dy, x_hat, invstd, weight, sum_dy, sum_dy_xhat, count) -> torch.Tensor:
    """BatchNorm's input gradient of one slice from the given per-channel sums and count."""
    view = (1, -1, *([1] * (dy.dim() - 2)))
    mean_dy = (sum_dy / count).reshape(view)
    mean_dy_xhat = (sum_dy_xhat / count).reshape(view)
    return (weight * invstd).reshape(view) * (dy - mean_dy - x_hat * mean_dy_xhat)


def grad_sums(dy, x_hat) -> tuple[torch.Tensor, torch.Tensor]:
    """This slice's per-channel ``sum(dy)`` and ``sum(dy * x_hat)``."""
    return dy.sum(_dims(dy)), (dy * x_hat).sum(_dims(dy))


def sync_input_grad(dy, x_hat, invstd, weight, count):
    """BatchNorm's input gradient for this rank's slice of a batch split over ranks."""
    dims = [0, *range(2, dy.dim())]
    view = (1, -1, *([1] * (dy.dim() - 2)))
    c = weight.numel()
    sums = torch.cat([dy.sum(dims), (dy * x_hat).sum(dims)])
    dist.all_reduce(sums)  # global sum(dy) and sum(dy * x_hat), one collective
    mean_dy = (sums[:c] / count).reshape(view)
    mean_dy_xhat = (sums[c:] / count).reshape(view)
    return (weight * invstd).reshape(view) * (dy - mean_dy - x_hat * mean_dy_xhat)


#: The notebook's ``sync_stats.py`` and ``sync_grad.py`` (exercises 1 and 2).
STATS_SOURCE = _FILE_HEAD + inspect.getsource(sync_mean_var)
GRAD_SOURCE = _FILE_HEAD + inspect.getsource(sync_input_grad)
