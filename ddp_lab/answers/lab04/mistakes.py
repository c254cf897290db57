"""Typical mistakes of lab 4 (SyncBatchNorm), and what the grader must say about each.

``MISTAKES``: the first one of each exercise is the sample class's "mistake" student; every
one must fail its own exercise with its ``reason`` in the verdict (``tests/test_mistakes.py``
and the property tests of ``tests/test_lab04.py``). ``HANGS``: a solution whose torchrun job
deadlocks, and ``HANG_LOSES``: the test cells that costs.
"""

from __future__ import annotations

from ddp_lab.answers import Mistake

# exercise 4's file with a right forward; the mistakes below finish its backward
_FUNCTION_HEAD = """%%writefile sync_bn.py
import torch
import torch.distributed as dist

from sync_grad import sync_input_grad
from sync_stats import sync_mean_var


class SyncBNFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, momentum, eps):
        dims = [0, *range(2, x.dim())]
        n = torch.tensor(float(x.numel() // x.size(1)), dtype=torch.float64)
        mean, var, count = sync_mean_var(x.double().sum(dims), x.double().square().sum(dims), n)
        count = float(count)
        running_mean.mul_(1 - momentum).add_(momentum * mean)
        running_var.mul_(1 - momentum).add_(momentum * var * count / (count - 1))
        view = (1, -1, *([1] * (x.dim() - 2)))
        invstd = (var + eps).rsqrt()
        x_hat = (x - mean.reshape(view)) * invstd.reshape(view)
        ctx.save_for_backward(x_hat, invstd, weight)
        ctx.count = count
        return x_hat * weight.reshape(view) + bias.reshape(view)

    @staticmethod
    def backward(ctx, dy):
        x_hat, invstd, weight = ctx.saved_tensors
        dims = [0, *range(2, dy.dim())]
"""

MISTAKES = [
    # --- exercise 1 -----------------------------------------------------------------------
    Mistake(
        "ex1_local_moments",
        "typical",  # reducing over the batch dimension only: right for (N, C) only
        """
def local_moments(x):
    x64 = x.double()
    return x64.sum(0), (x64 * x64).sum(0), x.shape[0]
""",
        "every dimension except the channel",
    ),
    Mistake(
        "ex1_local_moments",
        "count_without_spatial",  # the sums are right, the count forgets the positions
        """
def local_moments(x):
    dims = [0, *range(2, x.dim())]
    return x.double().sum(dims), x.double().square().sum(dims), x.shape[0]
""",
        "number of values per channel",
    ),
    # --- exercise 2 -----------------------------------------------------------------------
    Mistake(
        "ex2_sync_mean_var",
        "typical",  # averaging the ranks' means and variances (NaN on the empty rank)
        """%%writefile sync_stats.py
import torch
import torch.distributed as dist


def sync_mean_var(s, ss, n):
    mean = s / n
    var = ss / n - mean * mean
    world = dist.get_world_size()
    dist.all_reduce(mean)
    dist.all_reduce(var)
    dist.all_reduce(n)
    return mean / world, var / world, n
""",
        "not means",
    ),
    Mistake(
        "ex2_sync_mean_var",
        "no_all_reduce",  # every rank keeps its own statistics (plain BatchNorm)
        """%%writefile sync_stats.py
import torch


def sync_mean_var(s, ss, n):
    mean = s / n
    return mean, ss / n - mean * mean, n
""",
        "global mean",
    ),
    Mistake(
        "ex2_sync_mean_var",
        "unbiased_variance",  # BatchNorm normalises with the biased variance
        """%%writefile sync_stats.py
import torch
import torch.distributed as dist


def sync_mean_var(s, ss, n):
    packed = torch.cat([s, ss, n.reshape(1)])
    dist.all_reduce(packed)
    c = s.numel()
    mean = packed[:c] / packed[-1]
    var = (packed[c:2 * c] - packed[-1] * mean * mean) / (packed[-1] - 1)
    return mean, var, packed[-1]
""",
        "biased) variance",
    ),
    Mistake(
        "ex2_sync_mean_var",
        "uses_runtime",  # the course's runtime module instead of one's own code: refused
        """%%writefile sync_stats.py
from ddp_lab.syncbn import all_reduce_packed, global_mean_var


def sync_mean_var(s, ss, n):
    s, ss, n = all_reduce_packed([s, ss, n])
    return (*global_mean_var(s, ss, n), n)
""",
        "uses ddp_lab.syncbn",
    ),
    # --- exercise 3 -----------------------------------------------------------------------
    Mistake(
        "ex3_sync_input_grad",
        "typical",  # no all-reduce in backward: this rank's sums with the global count
        """%%writefile sync_grad.py
import torch
import torch.distributed as dist


def sync_input_grad(dy, x_hat, invstd, weight, count):
    dims = [0, *range(2, dy.dim())]
    view = (1, -1, *([1] * (dy.dim() - 2)))
    mean_dy = (dy.sum(dims) / count).reshape(view)
    mean_dy_xhat = ((dy * x_hat).sum(dims) / count).reshape(view)
    return (weight * invstd).reshape(view) * (dy - mean_dy - x_hat * mean_dy_xhat)
""",
        "must be all-reduced",
    ),
    Mistake(
        "ex3_sync_input_grad",
        "local_count",  # sums all-reduced, but divided by this rank's count
        """%%writefile sync_grad.py
import torch
import torch.distributed as dist


def sync_input_grad(dy, x_hat, invstd, weight, count):
    dims = [0, *range(2, dy.dim())]
    view = (1, -1, *([1] * (dy.dim() - 2)))
    sums = torch.cat([dy.sum(dims), (dy * x_hat).sum(dims)])
    dist.all_reduce(sums)
    c = weight.numel()
    local = dy.numel() // c
    return (weight * invstd).reshape(view) * (
        dy - (sums[:c] / local).reshape(view) - x_hat * (sums[c:] / local).reshape(view))
""",
        "input gradient",
    ),
    # --- exercise 4 -----------------------------------------------------------------------
    Mistake(
        "ex4_sync_bn_function",
        "typical",  # running_var tracked with the biased variance, everything else right
        _FUNCTION_HEAD.replace("momentum * var * count / (count - 1)", "momentum * var")
        + """
        dx = sync_input_grad(dy, x_hat, invstd, weight, ctx.count)
        return dx, (dy * x_hat).sum(dims), dy.sum(dims), None, None, None, None
""",
        "biased variance",
    ),
    Mistake(
        "ex4_sync_bn_function",
        "reduced_param_grads",  # weight and bias gradients all-reduced: DDP counts them twice
        _FUNCTION_HEAD
        + """
        dx = sync_input_grad(dy, x_hat, invstd, weight, ctx.count)
        sums = torch.cat([(dy * x_hat).sum(dims), dy.sum(dims)])
        dist.all_reduce(sums)
        d_weight, d_bias = sums.split(weight.numel())
        return dx, d_weight, d_bias, None, None, None, None
""",
        "counts them twice",
    ),
    Mistake(
        "ex4_sync_bn_function",
        "local_backward",  # dx written out with this rank's sums instead of sync_input_grad
        _FUNCTION_HEAD
        + """
        view = (1, -1, *([1] * (dy.dim() - 2)))
        mean_dy = (dy.sum(dims) / ctx.count).reshape(view)
        mean_dy_xhat = ((dy * x_hat).sum(dims) / ctx.count).reshape(view)
        dx = (weight * invstd).reshape(view) * (dy - mean_dy - x_hat * mean_dy_xhat)
        return dx, (dy * x_hat).sum(dims), dy.sum(dims), None, None, None, None
""",
        "input gradient",
    ),
    Mistake(
        "ex4_sync_bn_function",
        "uses_runtime",  # the runtime's finished SyncBatchNorm: refused
        """%%writefile sync_bn.py
import torch
from ddp_lab.syncbn import sync_batch_norm


class SyncBNFunction:
    @staticmethod
    def apply(x, weight, bias, running_mean, running_var, momentum, eps):
        return sync_batch_norm(x, running_mean, running_var, weight, bias, momentum, eps)
""",
        "uses ddp_lab.syncbn",
    ),
]

# A rank with no samples skips the all-reduce: the other ranks wait for it forever. The test
# cell's 2-rank run (no empty rank) passes; the grader's 3-rank case, with an empty rank, hangs.
HANGS = {
    "ex2_sync_mean_var": """%%writefile sync_stats.py
import torch
import torch.distributed as dist


def sync_mean_var(s, ss, n):
    packed = torch.cat([s, ss, n.reshape(1)])
    if n.item() > 0:  # "nothing to contribute": but the others wait for this rank
        dist.all_reduce(packed)
    c = s.numel()
    mean = packed[:c] / packed[-1]
    return mean, packed[c:2 * c] / packed[-1] - mean * mean, packed[-1]
""",
}
HANG_LOSES = ["test_ex2_sync_mean_var"]
