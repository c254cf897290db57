"""Typical mistakes of lab 4, SyncBatchNorm (see tests/mistakes.py).

``MISTAKES`` holds one wrong answer per exercise (the sample class's "mistake" student);
``MORE_MISTAKES`` holds further classic ones that ``tests/test_lab04.py`` also feeds to the
grader. ``HANGS``: a solution whose torchrun job deadlocks.
"""

LAB = "lab04_syncbn"

MISTAKES = {
    # reducing over the batch dimension only: right for (N, C), wrong shape for images
    "ex1_local_moments": """
def local_moments(x):
    x64 = x.double()
    return x64.sum(0), (x64 * x64).sum(0), x.shape[0]
""",
    # averaging the ranks' means and variances: wrong with unequal batch sizes
    "ex2_sync_mean_var": """%%writefile sync_stats.py
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
    # forgetting the all-reduce in backward: this rank's sums with the global count
    "ex3_sync_input_grad": """%%writefile sync_grad.py
import torch
import torch.distributed as dist


def sync_input_grad(dy, x_hat, invstd, weight, count):
    dims = [0, *range(2, dy.dim())]
    view = (1, -1, *([1] * (dy.dim() - 2)))
    mean_dy = (dy.sum(dims) / count).reshape(view)
    mean_dy_xhat = ((dy * x_hat).sum(dims) / count).reshape(view)
    return (weight * invstd).reshape(view) * (dy - mean_dy - x_hat * mean_dy_xhat)
""",
    # running_var tracked with the biased variance (everything else right)
    "ex4_sync_bn_function": """%%writefile sync_bn.py
import torch
import torch.distributed as dist

from ddp_lab import syncbn as ref


class SyncBNFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, momentum, eps):
        s, ss, n = ref.all_reduce_packed(ref.local_moments(x))
        count = n.item()
        mean, var = ref.global_mean_var(s, ss, n)
        with torch.no_grad():
            running_mean.mul_(1 - momentum).add_(momentum * mean)
            running_var.mul_(1 - momentum).add_(momentum * var)
        view = (1, -1, *([1] * (x.dim() - 2)))
        invstd = (var + eps).rsqrt()
        x_hat = (x - mean.reshape(view)) * invstd.reshape(view)
        ctx.save_for_backward(x_hat, invstd, weight)
        ctx.count = count
        return x_hat * weight.reshape(view) + bias.reshape(view)

    @staticmethod
    def backward(ctx, dy):
        x_hat, invstd, weight = ctx.saved_tensors
        sum_dy, sum_dy_xhat = ref.local_grad_sums(dy, x_hat)
        g1, g2 = ref.all_reduce_packed([sum_dy, sum_dy_xhat])
        dx = ref.batchnorm_input_grad(dy, x_hat, invstd, weight, g1, g2, ctx.count)
        return dx, sum_dy_xhat, sum_dy, None, None, None, None
""",
}

_FUNCTION_HEAD = """%%writefile sync_bn.py
import torch
import torch.distributed as dist

from ddp_lab import syncbn as ref


class SyncBNFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, momentum, eps):
        s, ss, n = ref.all_reduce_packed(ref.local_moments(x))
        count = n.item()
        mean, var = ref.global_mean_var(s, ss, n)
        with torch.no_grad():
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
        sum_dy, sum_dy_xhat = ref.local_grad_sums(dy, x_hat)
"""

#: ``(solution cell, label) -> source``: more classic mistakes, each must fail its exercise.
MORE_MISTAKES = {
    # the sums are right, the count is N (the spatial positions are forgotten)
    ("ex1_local_moments", "count_without_spatial"): """
def local_moments(x):
    dims = [0, *range(2, x.dim())]
    return x.double().sum(dims), x.double().square().sum(dims), x.shape[0]
""",
    # no communication at all: every rank keeps its own statistics (plain BatchNorm)
    ("ex2_sync_mean_var", "no_all_reduce"): """%%writefile sync_stats.py
import torch


def sync_mean_var(s, ss, n):
    mean = s / n
    return mean, ss / n - mean * mean, n
""",
    # the unbiased variance where BatchNorm normalises with the biased one
    ("ex2_sync_mean_var", "unbiased_variance"): """%%writefile sync_stats.py
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
    # sums all-reduced, but divided by this rank's count
    ("ex3_sync_input_grad", "local_count"): """%%writefile sync_grad.py
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
    # weight and bias gradients all-reduced too: DDP would count them twice
    ("ex4_sync_bn_function", "reduced_param_grads"): _FUNCTION_HEAD
    + """
        g1, g2 = ref.all_reduce_packed([sum_dy, sum_dy_xhat])
        dx = ref.batchnorm_input_grad(dy, x_hat, invstd, weight, g1, g2, ctx.count)
        return dx, g2, g1, None, None, None, None
""",
    # backward without the all-reduce: local gradient sums
    ("ex4_sync_bn_function", "local_backward"): _FUNCTION_HEAD
    + """
        dx = ref.batchnorm_input_grad(dy, x_hat, invstd, weight, sum_dy, sum_dy_xhat,
                                      ctx.count)
        return dx, sum_dy_xhat, sum_dy, None, None, None, None
""",
    # the course's reference instead of one's own code: refused before it runs
    ("ex2_sync_mean_var", "uses_reference"): """%%writefile sync_stats.py
from ddp_lab.syncbn import all_reduce_packed, global_mean_var


def sync_mean_var(s, ss, n):
    s, ss, n = all_reduce_packed([s, ss, n])
    return (*global_mean_var(s, ss, n), n)
""",
    # exercise 4 may use the pieces, not the finished Function: refused while it runs
    ("ex4_sync_bn_function", "calls_reference"): """%%writefile sync_bn.py
from ddp_lab import syncbn as ref


class SyncBNFunction:
    @staticmethod
    def apply(x, weight, bias, running_mean, running_var, momentum, eps):
        return ref.SyncBatchNormFunction.apply(
            x, weight, bias, running_mean, running_var, eps, momentum, None, True
        )
""",
}

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
