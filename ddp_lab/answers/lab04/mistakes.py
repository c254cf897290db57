"""Typical mistakes of lab 4 (SyncBatchNorm), and what the grader must say about each.

``MISTAKES``: the first one of each exercise is the sample class's "mistake" student; every
one must fail its own exercise with its ``reason`` in the verdict (``tests/test_mistakes.py``
and the property tests of ``tests/test_lab04.py``). ``HANGS``: a solution whose torchrun job
deadlocks, and ``HANG_LOSES``: the test cells that costs.
"""

from __future__ import annotations

from ddp_lab.answers import Mistake

_STATS_HEAD = """%%writefile sync_stats.py
import torch
import torch.distributed as dist


"""

# exercise 3's file with a forward written the long way; the mistakes below change one
# thing each (marked) and finish the backward
_FUNCTION = """%%writefile sync_bn.py
import torch
import torch.distributed as dist

from sync_grad import sync_input_grad
from sync_stats import sync_mean_var


class SyncBNFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, momentum, eps):
        shape = [1, x.shape[1]] + [1] * (x.dim() - 2)
        mu, sigma2, n = sync_mean_var(x)
        n = int(n)
        new_mean = (1 - momentum) * running_mean + momentum * mu
        new_var = (1 - momentum) * running_var + momentum * sigma2 * n / (n - 1)  # RUNNING_VAR
        running_mean.copy_(new_mean)  # IN_PLACE
        running_var.copy_(new_var)  # IN_PLACE
        inv = 1.0 / torch.sqrt(sigma2 + eps)
        xn = (x - mu.view(shape)) * inv.view(shape)
        ctx.save_for_backward(xn, inv, weight)
        ctx.n = n
        return weight.view(shape) * xn + bias.view(shape)

    @staticmethod
    def backward(ctx, grad):
        xn, inv, weight = ctx.saved_tensors
        axes = [0] + list(range(2, grad.dim()))
"""
_BACKWARD = """        dx = sync_input_grad(grad, xn, inv, weight, ctx.n)
        return dx, (grad * xn).sum(axes), grad.sum(axes), None, None, None, None
"""

MISTAKES = [
    # --- exercise 1 -----------------------------------------------------------------------
    Mistake(
        "ex1_sync_mean_var",
        "typical",  # the ranks' means and variances averaged (NaN on an empty rank)
        _STATS_HEAD
        + """def sync_mean_var(x):
    dims = [0] + list(range(2, x.dim()))
    n = torch.tensor(float(x.numel() // x.shape[1]))
    mu = x.mean(dim=dims)
    sigma2 = x.var(dim=dims, unbiased=False)
    ranks = dist.get_world_size()
    dist.all_reduce(mu)
    dist.all_reduce(sigma2)
    dist.all_reduce(n)
    return mu / ranks, sigma2 / ranks, n
""",
        "averaged the ranks' means",
    ),
    Mistake(
        "ex1_sync_mean_var",
        "float32_sums",  # sum and sum of squares in the input's dtype: E[x^2] - mean^2
        _STATS_HEAD
        + """def sync_mean_var(x):
    axes = tuple(d for d in range(x.dim()) if d != 1)
    count = torch.full((1,), x.numel() / x.shape[1], dtype=x.dtype)
    packed = torch.cat([x.sum(axes), (x * x).sum(axes), count])
    dist.all_reduce(packed)
    C = x.shape[1]
    n = packed[-1]
    mean = packed[:C] / n
    return mean, packed[C : 2 * C] / n - mean**2, n
""",
        "two large numbers",
    ),
    Mistake(
        "ex1_sync_mean_var",
        "float64_sums",  # the same in float64: right for float32 data, not near 1e8
        _STATS_HEAD
        + """def sync_mean_var(x):
    d = [0, *range(2, x.dim())]
    x64 = x.double()
    s = torch.stack([x64.sum(d), x64.pow(2).sum(d)])
    n = torch.tensor(x.numel() // x.size(1), dtype=torch.float64)
    dist.all_reduce(s)
    dist.all_reduce(n)
    m = s[0] / n
    return m, s[1] / n - m * m, n
""",
        "two large numbers",
    ),
    Mistake(
        "ex1_sync_mean_var",
        "within_only",  # count-weighted means and variances: the spread between ranks lost
        _STATS_HEAD
        + """def sync_mean_var(x):
    dims = [0] + list(range(2, x.dim()))
    n = x.numel() // x.shape[1]
    if n:
        local_var, local_mean = torch.var_mean(x, dim=dims, unbiased=False)
    else:
        local_var = local_mean = torch.zeros(x.shape[1], dtype=x.dtype)
    buf = torch.cat([n * local_mean, n * local_var, x.new_tensor([n])])
    dist.all_reduce(buf)
    C = x.shape[1]
    return buf[:C] / buf[-1], buf[C:-1] / buf[-1], buf[-1]
""",
        "between the ranks' means",
    ),
    Mistake(
        "ex1_sync_mean_var",
        "unbiased",  # right pooling, but divided by n - 1
        _STATS_HEAD
        + """def sync_mean_var(x):
    dims = [0] + list(range(2, x.dim()))
    n = x.numel() // x.shape[1]
    if n:
        v, m = torch.var_mean(x, dim=dims, unbiased=False)
    else:
        v = m = torch.zeros(x.shape[1], dtype=x.dtype)
    counts = torch.tensor([float(n)], dtype=x.dtype)
    dist.all_reduce(counts)
    total = counts[0]
    mean = n * m
    dist.all_reduce(mean)
    mean = mean / total
    ss = n * (v + (m - mean) ** 2)
    dist.all_reduce(ss)
    return mean, ss / (total - 1), total
""",
        "unbiased variance",
    ),
    Mistake(
        "ex1_sync_mean_var",
        "all_gather",  # right numbers (lab 1's pooling of a table), traffic that grows with n
        _STATS_HEAD
        + """def sync_mean_var(x):
    dims = [0, *range(2, x.dim())]
    c = x.size(1)
    n = x.numel() // c
    if n > 0:
        var, mean = torch.var_mean(x, dim=dims, correction=0)
    else:
        var = mean = torch.zeros(c, dtype=x.dtype)
    mine = torch.cat([x.new_tensor([n]), mean, var])
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    table = torch.stack(gathered)
    counts, means, variances = table[:, :1], table[:, 1 : 1 + c], table[:, 1 + c :]
    total = counts.sum()
    w = counts / total
    mean = (w * means).sum(0)
    return mean, (w * (variances + (means - mean) ** 2)).sum(0), total
""",
        "grows with the world size",
    ),
    Mistake(
        "ex1_sync_mean_var",
        "one_pass",  # ONE all-reduce of [count, sum, sum of squares], even in float64: unsafe
        _STATS_HEAD
        + """def sync_mean_var(x):
    dims = [0, *range(2, x.dim())]
    c = x.size(1)
    x64 = x.double()
    packed = torch.cat(
        [x64.new_tensor([x.numel() // c]), x64.sum(dims), (x64 * x64).sum(dims)]
    )
    dist.all_reduce(packed)
    count = packed[0]
    mean = packed[1 : 1 + c] / count
    var = packed[1 + c :] / count - mean * mean
    return mean.to(x.dtype), var.to(x.dtype), count
""",
        "two large numbers",
    ),
    Mistake(
        "ex1_sync_mean_var",
        "uses_runtime",  # the course's runtime module instead of one's own code: refused
        """%%writefile sync_stats.py
from ddp_lab.syncbn import SyncBatchNorm


def sync_mean_var(x):
    bn = SyncBatchNorm(x.shape[1], affine=False, momentum=1.0)
    bn(x)
    return bn.running_mean, bn.running_var, x.shape[0]
""",
        "uses ddp_lab.syncbn",
    ),
    # --- exercise 2 -----------------------------------------------------------------------
    Mistake(
        "ex2_sync_input_grad",
        "typical",  # no all-reduce in backward: this rank's sums with the global count
        """%%writefile sync_grad.py
import torch
import torch.distributed as dist


def sync_input_grad(dy, x_hat, invstd, weight, count):
    axes = [0] + list(range(2, dy.dim()))
    shape = [1, -1] + [1] * (dy.dim() - 2)
    g = dy * weight.view(shape)
    term1 = g.sum(axes, keepdim=True) / count
    term2 = x_hat * (g * x_hat).sum(axes, keepdim=True) / count
    return invstd.view(shape) * (g - term1 - term2)
""",
        "must be all-reduced",
    ),
    Mistake(
        "ex2_sync_input_grad",
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
    local = max(dy.numel() // c, 1)
    return (weight * invstd).reshape(view) * (
        dy - (sums[:c] / local).reshape(view) - x_hat * (sums[c:] / local).reshape(view))
""",
        "this rank's count",
    ),
    Mistake(
        "ex2_sync_input_grad",
        "mean_path_only",  # the mean's dependence on x, but not the variance's
        """%%writefile sync_grad.py
import torch
import torch.distributed as dist


def sync_input_grad(dy, x_hat, invstd, weight, count):
    red = tuple([0] + list(range(2, dy.dim())))
    s = dy.sum(red)
    dist.all_reduce(s)
    b = [1, len(weight)] + [1] * (dy.dim() - 2)
    return weight.view(b) * invstd.view(b) * (dy - s.view(b) / count)
""",
        "the variance depends on x",
    ),
    Mistake(
        "ex2_sync_input_grad",
        "float64_gradient",  # right numbers, computed and returned in float64
        """%%writefile sync_grad.py
import torch
import torch.distributed as dist


def sync_input_grad(dy, x_hat, invstd, weight, count):
    dims = [0, *range(2, dy.dim())]
    view = (1, -1, *([1] * (dy.dim() - 2)))
    dy, x_hat = dy.double(), x_hat.double()
    sums = torch.cat([dy.sum(dims), (dy * x_hat).sum(dims)])
    dist.all_reduce(sums)
    c = weight.numel()
    scale = (weight.double() * invstd.double()).reshape(view)
    mean_dy, mean_dy_xhat = (sums[:c] / count).reshape(view), (sums[c:] / count).reshape(view)
    return scale * (dy - mean_dy - x_hat * mean_dy_xhat)
""",
        "promises it in dy's dtype",
    ),
    Mistake(
        "ex2_sync_input_grad",
        "no_weight",  # gamma left out of the chain rule
        """%%writefile sync_grad.py
import torch
import torch.distributed as dist


def sync_input_grad(dy, x_hat, invstd, weight, count):
    red = tuple([0] + list(range(2, dy.dim())))
    b = [1, len(weight)] + [1] * (dy.dim() - 2)
    a = dy.sum(red)
    c = (dy * x_hat).sum(red)
    dist.all_reduce(a)
    dist.all_reduce(c)
    return invstd.view(b) * (dy - a.view(b) / count - x_hat * c.view(b) / count)
""",
        "weight (gamma) is missing",
    ),
    # --- exercise 3 -----------------------------------------------------------------------
    Mistake(
        "ex3_sync_bn_function",
        "typical",  # running_var tracked with the biased variance, everything else right
        _FUNCTION.replace("momentum * sigma2 * n / (n - 1)", "momentum * sigma2") + _BACKWARD,
        "biased variance",
    ),
    Mistake(
        "ex3_sync_bn_function",
        "reduced_param_grads",  # weight and bias gradients all-reduced: DDP counts them twice
        _FUNCTION
        + """        dx = sync_input_grad(grad, xn, inv, weight, ctx.n)
        dw, db = (grad * xn).sum(axes), grad.sum(axes)
        dist.all_reduce(dw)
        dist.all_reduce(db)
        return dx, dw, db, None, None, None, None
""",
        "counts them twice",
    ),
    Mistake(
        "ex3_sync_bn_function",
        "local_backward",  # dx written out with this rank's sums instead of sync_input_grad
        _FUNCTION
        + """        shape = [1, -1] + [1] * (grad.dim() - 2)
        m1 = grad.sum(axes).view(shape) / ctx.n
        m2 = (grad * xn).sum(axes).view(shape) / ctx.n
        dx = (weight * inv).view(shape) * (grad - m1 - xn * m2)
        return dx, (grad * xn).sum(axes), grad.sum(axes), None, None, None, None
""",
        "input gradient",
    ),
    Mistake(
        "ex3_sync_bn_function",
        "not_in_place",  # the buffers' names rebound: the caller's tensors never change
        _FUNCTION.replace("running_mean.copy_(new_mean)", "running_mean = new_mean").replace(
            "running_var.copy_(new_var)", "running_var = new_var"
        )
        + _BACKWARD,
        "IN PLACE",
    ),
    Mistake(
        "ex3_sync_bn_function",
        "uses_runtime",  # the runtime's finished SyncBatchNorm: refused
        """%%writefile sync_bn.py
import torch
from ddp_lab.syncbn import SyncBatchNorm


class SyncBNFunction:
    @staticmethod
    def apply(x, weight, bias, running_mean, running_var, momentum, eps):
        bn = SyncBatchNorm(x.shape[1], eps=eps, momentum=momentum)
        bn.weight, bn.bias = torch.nn.Parameter(weight), torch.nn.Parameter(bias)
        return bn(x)
""",
        "uses ddp_lab.syncbn",
    ),
]

# A rank with no samples skips the collective: the other ranks wait for it forever. The
# grader's first run with an empty rank is over 2 ranks (its partner waits in that group's
# collective), so the job is stopped after its timeout.
HANGS = {
    "ex1_sync_mean_var": _STATS_HEAD
    + """def sync_mean_var(x):
    dims = [0, *range(2, x.dim())]
    n = x.numel() // x.size(1)
    if n == 0:  # "nothing to contribute": but the others wait for this rank
        nan = torch.full((x.size(1),), float("nan"), dtype=x.dtype)
        return nan, nan, 0
    shape = [1, -1] + [1] * (x.dim() - 2)
    s = torch.cat([x.new_tensor([n]), x.sum(dims)])
    dist.all_reduce(s)
    m = s[1:] / s[0]
    q = ((x - m.view(shape)) ** 2).sum(dims)
    dist.all_reduce(q)
    return m, q / s[0], s[0]
""",
}
HANG_LOSES = ["test_ex1_sync_mean_var"]
