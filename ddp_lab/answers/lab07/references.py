"""Lab 7's reference answers (instructor only): what the solution notebook does, as code.

- :func:`memory_per_rank`: bytes of parameters, gradients and AdamW state on every rank,
  DDP (stage 0) and ZeRO stages 1, 2, 3 (exercise 1);
- :class:`ShardedAdamW`: AdamW with its state sharded over the ranks, reduce-scatter of the
  gradients, clipping by the global norm of the shards, all-gather of the parameters
  (exercise 2, ``zero.py``);
- :func:`gpipe_step`: one GPipe step of a model split into stages over ranks, with
  micro-batches and send/recv (exercise 3, ``pipeline.py``);
- :class:`ColumnParallelLinear`, :class:`RowParallelLinear`: ``nn.Linear`` split over the
  ranks by output or by input features (exercise 4, ``tp.py``);
- :func:`activation_bytes`: what autograd keeps for the backward of one block of the
  course's GPT (exercise 5);
``FILES`` holds the notebook's three ``%%writefile`` files as sources, for the tests and
the grader.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
from torch import nn


def memory_per_rank(numels, bytes_per_number, world_size, stage):
    """Bytes of parameters, gradients and AdamW moments on each rank (exercise 1)."""
    total = sum(numels)
    chunk = -(-total // world_size)  # ceil
    out = []
    for rank in range(world_size):
        shard = max(0, min(total, (rank + 1) * chunk) - rank * chunk)
        params = shard if stage >= 3 else total
        grads = shard if stage >= 2 else total
        moments = 2 * (shard if stage >= 1 else total)
        out.append(
            {
                "params": params * bytes_per_number,
                "grads": grads * bytes_per_number,
                "optimizer": moments * bytes_per_number,
            }
        )
    return out


def activation_bytes(batch, seq, width, heads, bytes_per_number):
    """Bytes autograd keeps for the backward of one ``ddp_lab.gpt.Block`` (exercise 5).

    ``16 B T C`` numbers of the block's tensors: its input (LayerNorm 1's), LayerNorm 1's
    output (q, k and v's), contiguous copies of q, k and v that the batched matmuls save
    (their heads are transposed views), the heads' joined output (the projection's input),
    the residual sum (LayerNorm 2's input), LayerNorm 2's output, the MLP's 4C-wide input of
    GELU and GELU's output; ``B H T^2`` attention weights (softmax's output, which the second
    matmul saves too); ``4 B T`` of the two LayerNorms' means and 1/std; and the ``T x T``
    causal mask of bools that ``masked_fill`` keeps, one byte each.
    """
    b, t, c, h, e = batch, seq, width, heads, bytes_per_number
    return e * (16 * b * t * c + b * h * t * t + 4 * b * t) + t * t


class ShardedAdamW:
    """AdamW whose state is sharded over the ranks of ``group`` (exercise 2).

    This rank's chunk of the flat vector is kept as one piece per parameter it overlaps, so
    that a parameter without a gradient is skipped exactly as ``torch.optim.AdamW`` skips
    it (no update, no weight decay, its step count unchanged)."""

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=1e-2,
        max_norm=None,
        group=None,
    ):
        self.params = list(params)
        self.group = group
        self.max_norm = max_norm
        self.world = dist.get_world_size(group)
        rank = dist.get_rank(group)
        self.numel = sum(p.numel() for p in self.params)
        self.chunk = -(-self.numel // self.world)
        self.start = min(rank * self.chunk, self.numel)
        self.end = min(self.start + self.chunk, self.numel)
        self.pieces = []  # (parameter index, start, end within the chunk, the piece)
        offset = 0
        with torch.no_grad():
            for i, p in enumerate(self.params):
                lo, hi = max(self.start, offset), min(self.end, offset + p.numel())
                if lo < hi:
                    piece = nn.Parameter(p.reshape(-1)[lo - offset : hi - offset].clone())
                    self.pieces.append((i, lo - self.start, hi - self.start, piece))
                offset += p.numel()
        self.inner = None
        if self.pieces:
            self.inner = torch.optim.AdamW(
                [piece for *_, piece in self.pieces],
                lr=lr,
                betas=betas,
                eps=eps,
                weight_decay=weight_decay,
            )

    def _padded(self, flat):
        out = flat.new_zeros(self.chunk * self.world)
        out[: flat.numel()] = flat
        return out

    @torch.no_grad()
    def step(self):
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = self._padded(torch.cat([g.reshape(-1) for g in grads]))
        mine = flat.new_empty(self.chunk)
        dist.reduce_scatter_single(mine, flat, group=self.group)
        grad = mine[: self.end - self.start] / self.world
        if self.max_norm is not None:
            total = grad.double().square().sum()
            dist.all_reduce(total, group=self.group)
            coef = self.max_norm / (float(total.sqrt()) + 1e-6)
            if coef < 1:
                grad = grad * coef
        for i, lo, hi, piece in self.pieces:  # None stays None: AdamW skips the piece
            piece.grad = None if self.params[i].grad is None else grad[lo:hi].clone()
        if self.inner is not None:
            self.inner.step()
        chunk = flat.new_zeros(self.chunk)
        for _, lo, hi, piece in self.pieces:
            piece.grad = None
            chunk[lo:hi] = piece
        full = chunk.new_empty(self.chunk * self.world)
        dist.all_gather_single(full, chunk, group=self.group)
        offset = 0
        for p in self.params:
            p.copy_(full[offset : offset + p.numel()].view_as(p))
            offset += p.numel()

    def zero_grad(self):
        for p in self.params:
            p.grad = None


def gpipe_step(stage, n_stages, n_micro, inputs, targets, act_shape, loss_fn):
    """One GPipe step of the stage on this rank: every forward, then every backward."""
    rank = dist.get_rank()
    first, last = rank == 0, rank == n_stages - 1
    dtype = next(stage.parameters()).dtype
    received, outputs = [], []
    for i in range(n_micro):
        if first:
            x = inputs[i]
        else:
            x = torch.empty(act_shape, dtype=dtype)
            dist.recv(x, src=rank - 1)
            x.requires_grad_(True)
        y = stage(x)
        if not last:
            dist.send(y.detach(), dst=rank + 1)
        received.append(x)
        outputs.append(y)
    total = None
    for i in reversed(range(n_micro)):
        if last:
            loss = loss_fn(outputs[i], targets[i]) / n_micro
            loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        else:
            grad = torch.empty(act_shape, dtype=dtype)
            dist.recv(grad, src=rank + 1)
            outputs[i].backward(grad)
        if not first:
            dist.send(received[i].grad, dst=rank - 1)
    if last:
        return total, torch.cat([y.detach() for y in outputs])
    return None


def _rows(n, group):
    """This rank's indices of ``n`` features (``torch.tensor_split`` over the group)."""
    return torch.tensor_split(torch.arange(n), dist.get_world_size(group))[dist.get_rank(group)]


class _CopyToParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ColumnParallelLinear(nn.Module):
    """This rank's output features of ``linear`` (exercise 4)."""

    def __init__(self, linear, group=None):
        super().__init__()
        self.group = group
        idx = _rows(linear.out_features, group)
        self.weight = nn.Parameter(linear.weight.detach()[idx].clone())
        self.bias = None
        if linear.bias is not None:
            self.bias = nn.Parameter(linear.bias.detach()[idx].clone())

    def forward(self, x):
        x = _CopyToParallel.apply(x, self.group)
        return nn.functional.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``linear`` on this rank's input features; the full output on every rank (exercise 4)."""

    def __init__(self, linear, group=None):
        super().__init__()
        self.group = group
        idx = _rows(linear.in_features, group)
        self.weight = nn.Parameter(linear.weight.detach()[:, idx].clone())
        self.bias = None
        if linear.bias is not None:
            self.bias = nn.Parameter(linear.bias.detach().clone())

    def forward(self, x):
        y = _ReduceFromParallel.apply(nn.functional.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias


def _file(*objects, header: str) -> str:
    return header + "\n\n\n" + "\n\n\n".join(inspect.getsource(o) for o in objects)


_HEAD = "import torch\nimport torch.distributed as dist\nfrom torch import nn"

#: The notebook's three files (``%%writefile`` cells), as the reference writes them.
FILES = {
    "zero.py": _file(ShardedAdamW, header=_HEAD),
    "pipeline.py": _file(gpipe_step, header=_HEAD),
    "tp.py": _file(
        _rows,
        _CopyToParallel,
        _ReduceFromParallel,
        ColumnParallelLinear,
        RowParallelLinear,
        header=_HEAD,
    ),
}
