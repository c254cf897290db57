"""Lab 7's tensor-parallel mistake that assumes a bias: a ``RowParallelLinear`` whose forward
adds ``self.bias`` whatever it is, right on every layer with a bias, a ``TypeError`` on the
grading run's row layer without one (``self.bias`` None), on every rank of its group alike.

Inserted into ``MISTAKES`` by ``mistakes.py`` as exercise 4's second mistake (after the
sample class's): a wrong answer that raises gives no outputs to judge, so it goes through
the grader in ``tests/test_mistakes.py``; ``tests/test_lab07.py`` runs it on torchrun too.
"""

from __future__ import annotations

from ddp_lab.answers import Mistake

_ASSUMES_BIAS = """%%writefile tp.py
import torch
import torch.distributed as dist
from torch import nn


def my_features(n, group):
    return torch.tensor_split(torch.arange(n), dist.get_world_size(group))[dist.get_rank(group)]


class EnterParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class LeaveParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ColumnParallelLinear(nn.Module):
    def __init__(self, linear, group=None):
        super().__init__()
        self.group = group
        rows = my_features(linear.out_features, group)
        self.weight = nn.Parameter(linear.weight.detach()[rows].clone())
        self.bias = None
        if linear.bias is not None:
            self.bias = nn.Parameter(linear.bias.detach()[rows].clone())

    def forward(self, x):
        x = EnterParallel.apply(x, self.group)
        return nn.functional.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    def __init__(self, linear, group=None):
        super().__init__()
        self.group = group
        cols = my_features(linear.in_features, group)
        self.weight = nn.Parameter(linear.weight.detach()[:, cols].clone())
        self.bias = None
        if linear.bias is not None:
            self.bias = nn.Parameter(linear.bias.detach().clone())

    def forward(self, x):
        y = LeaveParallel.apply(x @ self.weight.t(), self.group)
        return y + self.bias  # the bias once, after the sum: but is there one?
"""

TP_MISTAKES = [
    Mistake(
        "ex4_tensor_parallel",
        "row_assumes_bias",  # right with a bias; raises on the row layer without one
        _ASSUMES_BIAS,
        "built from an nn.Linear without a bias",
    ),
]
