"""Typical wrong answers of lab 7, and what the grader must say about each.

Each source replaces the whole solution cell, as a student would write it (not an edit of
the reference). The first of each exercise is the sample class's ``mistake`` student's; each
must fail its own exercise with its ``reason`` in the verdict: ``MISTAKES`` on the grader's
path (``tests/test_mistakes.py``: exercises 1 and 5 in this process, the others in grader
rounds), ``MORE_MISTAKES`` in ``tests/test_lab07.py``. More in ``mistakes_*.py``.
"""

from __future__ import annotations

from ddp_lab.answers import Mistake
from ddp_lab.answers.lab07.mistakes_act import ACTIVATION_MISTAKES
from ddp_lab.answers.lab07.mistakes_comm import COMM_MISTAKES
from ddp_lab.answers.lab07.mistakes_tp import TP_MISTAKES

# --- exercise 1: memory_per_rank -------------------------------------------------------------

_MEMORY = """
import math


def memory_per_rank(numels, bytes_per_number, world_size, stage):
    n = sum(numels)
{chunk}
    result = []
    for r in range(world_size):
{mine}
        p = mine if stage {params} else n
        g = mine if stage {grads} else n
        o = {moments} * (mine if stage >= 1 else n)
        result.append({{"params": p * bytes_per_number, "grads": g * bytes_per_number,
                       "optimizer": o * bytes_per_number}})
    return result
"""
_CEIL = "    per_rank = math.ceil(n / world_size)"
_MINE = "        mine = max(0, min(per_rank, n - r * per_rank))"

# --- exercise 2: ShardedAdamW -----------------------------------------------------------------

_ZERO_INIT = """%%writefile zero.py
import torch
import torch.distributed as dist


class ShardedAdamW:
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 max_norm=None, group=None):
        self.params = list(params)
        self.group = group
        self.max_norm = max_norm
        self.n = dist.get_world_size(group)
        self.r = dist.get_rank(group)
        total = sum(p.numel() for p in self.params)
        self.size = size = {size}
        self.lo = min(self.r * size, total)
        self.hi = min(self.lo + size, total)
        # my chunk, one piece per parameter: AdamW keeps a step count per parameter
        self.parts = []
        start = 0
        for i, p in enumerate(self.params):
            a, b = max(self.lo, start), min(self.hi, start + p.numel())
            if a < b:
                piece = torch.nn.Parameter(p.detach().flatten()[a - start:b - start].clone())
                self.parts.append((i, a - self.lo, b - self.lo, piece))
            start += p.numel()
        self.opt = None
        if self.parts:
            self.opt = torch.optim.AdamW([t for *_, t in self.parts], lr=lr, betas=betas,
                                         eps=eps, weight_decay=weight_decay)
"""
_ZERO_GRADS = """
    @torch.no_grad()
    def step(self):
        g = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten()
                       for p in self.params])
        dist.all_reduce(g, group=self.group)
        g /= self.n
"""
_ZERO_CLIP_FULL = """        if self.max_norm is not None:
            coef = self.max_norm / (g.norm() + 1e-6)
            if coef < 1:
                g *= coef
"""
_ZERO_UPDATE = """        mine = g[self.lo:self.hi]
        for i, a, b, t in self.parts:
            t.grad = None if self.params[i].grad is None else mine[a:b].clone()
        if self.opt is not None:
            self.opt.step()
        new = torch.zeros(self.hi - self.lo, dtype=g.dtype)
        for _, a, b, t in self.parts:
            t.grad = None
            new[a:b] = t
"""
_ZERO_GATHER = """        piece = torch.zeros(self.size, dtype=g.dtype)
        piece[:len(new)] = new
        pieces = [torch.zeros_like(piece) for _ in range(self.n)]
        dist.all_gather(pieces, piece, group=self.group)
        flat = torch.cat(pieces)
        i = 0
        for p in self.params:
            p.copy_(flat[i:i + p.numel()].view_as(p))
            i += p.numel()
"""

# --- exercise 3: gpipe_step --------------------------------------------------------------------

_PIPE_FORWARD = """%%writefile pipeline.py
import torch
import torch.distributed as dist


def gpipe_step(stage, n_stages, n_micro, inputs, targets, act_shape, loss_fn):
    rank = dist.get_rank()
    dtype = next(stage.parameters()).dtype
    xs, outs = [], []
    for i in range(n_micro):
        if rank == 0:
            x = inputs[i]
        else:
            x = torch.zeros(act_shape, dtype=dtype)
            dist.recv(x, rank - 1)
            x.requires_grad = True
        y = stage(x)
        if rank < n_stages - 1:
            dist.send(y.detach(), rank + 1)
        xs.append(x)
        outs.append(y)
"""
_PIPE_BACKWARD = """    losses = []
    for i in range(n_micro):
{zero}        if rank == n_stages - 1:
            loss = loss_fn(outs[i], targets[i]){divide}
            losses.append(loss.item())
            loss.backward()
        else:
            g = torch.zeros(act_shape, dtype=dtype)
            dist.recv(g, rank + 1)
            outs[i].backward(g)
        if rank > 0:
            dist.send(xs[i].grad, rank - 1)
    if rank == n_stages - 1:
        return torch.tensor(sum(losses) / n_micro), torch.cat([y.detach() for y in outs])
"""

# --- exercise 4: tensor parallelism ----------------------------------------------------------

_TP = """%%writefile tp.py
import torch
import torch.distributed as dist
from torch import nn


def my_part(n, group):
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    return torch.tensor_split(torch.arange(n), world)[rank]


class AllReduceGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class AllReduceOut(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
{row_backward}


class ColumnParallelLinear(nn.Module):
    def __init__(self, linear, group=None):
        super().__init__()
        self.group = group
        rows = my_part(linear.out_features, group)
        self.weight = nn.Parameter(linear.weight.detach()[rows].clone())
        self.bias = None
        if linear.bias is not None:
            self.bias = nn.Parameter(linear.bias.detach()[rows].clone())

    def forward(self, x):
{column_forward}


class RowParallelLinear(nn.Module):
    def __init__(self, linear, group=None):
        super().__init__()
        self.group = group
        cols = my_part(linear.in_features, group)
        self.weight = nn.Parameter(linear.weight.detach()[:, cols].clone())
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())

    def forward(self, x):
{row_forward}
"""
_COLUMN_OK = """        x = AllReduceGrad.apply(x, self.group)
        return nn.functional.linear(x, self.weight, self.bias)"""
_ROW_OK = """        y = AllReduceOut.apply(x @ self.weight.t(), self.group)
        return y if self.bias is None else y + self.bias"""
_ROW_GRAD_OK = "        return g, None"

_ALL = [
    # --- exercise 1 --------------------------------------------------------------------------
    Mistake(
        "ex1_memory",
        "zero2_full_grads",  # stage 2 shards the gradients too
        _MEMORY.format(chunk=_CEIL, mine=_MINE, params=">= 3", grads="== 3", moments=2),
        "stage 2 shards the gradients",
    ),
    Mistake(
        "ex1_memory",
        "floor_chunks",  # n // world_size numbers per rank: the tail is nobody's
        _MEMORY.format(
            chunk="    per_rank = n // world_size",
            mine="        mine = per_rank",
            params=">= 3",
            grads=">= 2",
            moments=2,
        ),
        "on no rank",
    ),
    Mistake(
        "ex1_memory",
        "one_moment",  # Adam keeps two moments per parameter
        _MEMORY.format(chunk=_CEIL, mine=_MINE, params=">= 3", grads=">= 2", moments=1),
        "two tensors per parameter",
    ),
    Mistake(
        "ex1_memory",
        "stages_backwards",  # stage 1 shards the parameters first
        _MEMORY.format(chunk=_CEIL, mine=_MINE, params=">= 1", grads=">= 2", moments=2).replace(
            "(mine if stage >= 1 else n)", "(mine if stage >= 3 else n)"
        ),
        "stage 1 shards only the optimizer state",
    ),
    Mistake(
        "ex1_memory",
        "negative_tail",  # a rank past the end of the vector
        _MEMORY.format(
            chunk=_CEIL,
            mine="        mine = min(per_rank, n - r * per_rank)",
            params=">= 3",
            grads=">= 2",
            moments=2,
        ),
        "owns nothing",
    ),
    # --- exercise 2 --------------------------------------------------------------------------
    Mistake(
        "ex2_zero",
        "all_reduce_params",  # averages stale copies instead of gathering the shards
        _ZERO_INIT.format(size="(total + self.n - 1) // self.n")
        + _ZERO_GRADS
        + _ZERO_CLIP_FULL
        + _ZERO_UPDATE
        + """        flat = torch.cat([p.flatten() for p in self.params])
        flat[self.lo:self.hi] = new
        dist.all_reduce(flat, group=self.group)
        flat /= self.n
        i = 0
        for p in self.params:
            p.copy_(flat[i:i + p.numel()].view_as(p))
            i += p.numel()
""",
        "an all-reduce averaged",
    ),
    Mistake(
        "ex2_zero",
        "zero_grad_for_frozen",  # a parameter without a gradient gets zeros: AdamW moves it
        """%%writefile zero.py
import torch
import torch.distributed as dist


class ShardedAdamW:
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 max_norm=None, group=None):
        self.params = list(params)
        self.group = group
        self.max_norm = max_norm
        self.n = dist.get_world_size(group)
        rank = dist.get_rank(group)
        total = sum(p.numel() for p in self.params)
        self.c = -(-total // self.n)
        self.lo = min(rank * self.c, total)
        self.hi = min(self.lo + self.c, total)
        with torch.no_grad():
            flat = torch.cat([p.reshape(-1) for p in self.params])
            self.mine = torch.nn.Parameter(flat[self.lo:self.hi].clone())
        self.opt = torch.optim.AdamW([self.mine], lr=lr, betas=betas, eps=eps,
                                     weight_decay=weight_decay)

    @torch.no_grad()
    def step(self):
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        padded = torch.zeros(self.n * self.c, dtype=self.mine.dtype)
        flat = torch.cat([g.reshape(-1) for g in grads])
        padded[:flat.numel()] = flat
        out = torch.empty(self.c, dtype=flat.dtype)
        dist.reduce_scatter_single(out, padded, group=self.group)
        grad = out[:self.hi - self.lo] / self.n
        if self.max_norm is not None:
            sq = grad.double().square().sum()
            dist.all_reduce(sq, group=self.group)
            coef = self.max_norm / (sq.sqrt().item() + 1e-6)
            if coef < 1:
                grad = grad * coef
        self.mine.grad = grad
        self.opt.step()
        self.mine.grad = None
        piece = torch.zeros(self.c, dtype=flat.dtype)
        piece[:self.hi - self.lo] = self.mine
        full = torch.empty(self.n * self.c, dtype=flat.dtype)
        dist.all_gather_single(full, piece, group=self.group)
        i = 0
        for p in self.params:
            p.copy_(full[i:i + p.numel()].view_as(p))
            i += p.numel()
""",
        "was given a zero gradient",
    ),
    Mistake(
        "ex2_zero",
        "steps_everything",  # right weights, but every rank keeps the whole state
        """%%writefile zero.py
import torch
import torch.distributed as dist


class ShardedAdamW:
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 max_norm=None, group=None):
        self.params = list(params)
        self.group = group
        self.max_norm = max_norm
        self.opt = torch.optim.AdamW(self.params, lr=lr, betas=betas, eps=eps,
                                     weight_decay=weight_decay)

    def step(self):
        for p in self.params:
            if p.grad is not None:
                dist.all_reduce(p.grad, group=self.group)
                p.grad /= dist.get_world_size(self.group)
        if self.max_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.params, self.max_norm)
        self.opt.step()
""",
        "ZeRO keeps about three chunks",
    ),
    Mistake(
        "ex2_zero",
        "local_norm",  # clips each chunk by its own norm
        _ZERO_INIT.format(size="(total + self.n - 1) // self.n")
        + _ZERO_GRADS
        + """        if self.max_norm is not None:
            mine = g[self.lo:self.hi]
            coef = self.max_norm / (mine.norm() + 1e-6)
            if coef < 1:
                mine *= coef
"""
        + _ZERO_UPDATE
        + _ZERO_GATHER,
        "the norm of its own chunk",
    ),
    Mistake(
        "ex2_zero",
        "drops_tail",  # total // n numbers per rank: the last ones are nobody's
        _ZERO_INIT.format(size="total // self.n")
        + _ZERO_GRADS
        + _ZERO_CLIP_FULL
        + _ZERO_UPDATE
        + """        pieces = [torch.zeros(len(new), dtype=g.dtype) for _ in range(self.n)]
        dist.all_gather(pieces, new, group=self.group)
        flat = torch.cat(pieces)
        i = 0
        for p in self.params:
            k = min(p.numel(), len(flat) - i)
            if k > 0:
                p.view(-1)[:k] = flat[i:i + k]
            i += p.numel()
""",
        "never changed",
    ),
    Mistake(
        "ex2_zero",
        "sums_gradients",  # the sum of the ranks' gradients, not their mean
        (_ZERO_INIT.format(size="(total + self.n - 1) // self.n") + _ZERO_GRADS).replace(
            "        g /= self.n\n", ""
        )
        + _ZERO_CLIP_FULL
        + _ZERO_UPDATE
        + _ZERO_GATHER,
        "summed the ranks' gradients",
    ),
    Mistake(
        "ex2_zero",
        "no_clipping",
        _ZERO_INIT.format(size="(total + self.n - 1) // self.n")
        + _ZERO_GRADS
        + _ZERO_UPDATE
        + _ZERO_GATHER,
        "were not clipped",
    ),
    # --- exercise 3 --------------------------------------------------------------------------
    Mistake(
        "ex3_pipeline",
        "no_gradient_sent_back",  # only the last stage ever runs backward
        _PIPE_FORWARD
        + """    if rank == n_stages - 1:
        loss = sum(loss_fn(y, t) for y, t in zip(outs, targets)) / n_micro
        loss.backward()
        return loss.detach(), torch.cat([y.detach() for y in outs])
""",
        "got no gradient",
    ),
    Mistake(
        "ex3_pipeline",
        "loss_not_divided",  # each micro-batch's mean loss, summed over micro-batches
        _PIPE_FORWARD + _PIPE_BACKWARD.format(zero="", divide=""),
        "times too large",
    ),
    Mistake(
        "ex3_pipeline",
        "zero_grad_per_micro_batch",  # keeps only one micro-batch's gradient
        _PIPE_FORWARD
        + _PIPE_BACKWARD.format(zero="        stage.zero_grad()\n", divide=" / n_micro"),
        "only one micro-batch",
    ),
    # --- exercise 4 --------------------------------------------------------------------------
    Mistake(
        "ex4_tensor_parallel",
        "row_bias_every_rank",  # each rank adds the bias before the all-reduce
        _TP.format(
            row_backward=_ROW_GRAD_OK,
            column_forward=_COLUMN_OK,
            row_forward="        return AllReduceOut.apply(nn.functional.linear(x, self.weight, "
            "self.bias), self.group)",
        ),
        "added the bias on every rank",
    ),
    *TP_MISTAKES,  # mistakes_tp.py: assumes a bias (the second: in the grader's round)
    Mistake(
        "ex4_tensor_parallel",
        "column_without_backward_all_reduce",
        _TP.format(
            row_backward=_ROW_GRAD_OK,
            column_forward="        return nn.functional.linear(x, self.weight, self.bias)",
            row_forward=_ROW_OK,
        ),
        "only this rank's part",
    ),
    Mistake(
        "ex4_tensor_parallel",
        "row_backward_all_reduce",  # the backward of an all-reduce is the identity
        _TP.format(
            row_backward="        g = g.clone()\n        dist.all_reduce(g, group=ctx.group)\n"
            "        return g, None",
            column_forward=_COLUMN_OK,
            row_forward=_ROW_OK,
        ),
        "the backward of the forward all-reduce is the identity",
    ),
    Mistake(
        "ex4_tensor_parallel",
        "row_without_all_reduce",  # each rank returns its partial sum
        _TP.format(
            row_backward=_ROW_GRAD_OK,
            column_forward=_COLUMN_OK,
            row_forward="        return nn.functional.linear(x, self.weight, self.bias)",
        ),
        "partial sum",
    ),
]

_ALL += ACTIVATION_MISTAKES + COMM_MISTAKES  # exercise 5; 2-4
#: What the grader runs (``tests/test_mistakes.py``, the sample class the first of each): all
#: of exercises 1 and 5 (in one process, cheap), two of each distributed one.
_ROUNDS = {"ex1_memory": 99, "ex5_activations": 99}
MISTAKES = [
    m
    for m in _ALL
    if [x.cell for x in _ALL[: _ALL.index(m) + 1]].count(m.cell) <= _ROUNDS.get(m.cell, 2)
]
#: The others, judged in ``tests/test_lab07.py`` (each must fail its exercise with its reason).
MORE_MISTAKES = [m for m in _ALL if m not in MISTAKES]
