"""Synchronised BatchNorm that also runs on the CPU (gloo): BatchNorm over the gathered batch.

With data parallelism each rank sees only its own slice of the batch, so a plain BatchNorm
normalises with *per-rank* statistics: noisy when the slices are small, and different on
every rank. Synchronised BatchNorm normalises with the statistics of the *global* batch.

How this module does it (the simple way, chosen on purpose):

1. every rank's rows are gathered onto every rank by a small differentiable all-gather
   (:class:`GatherRows`: forward ``all_gather`` of the rows, padded to the largest rank's
   count; backward ``all_reduce`` of the gradient of the whole gathered batch, then this
   rank's rows);
2. ``F.batch_norm`` runs on the gathered global batch, running statistics included;
3. each rank keeps its own rows of the output.

That *is* BatchNorm over the global batch, by construction: the output, the running
statistics (with the unbiased variance) and, through autograd, every gradient. Ranks may
hold different numbers of rows, also none. The weight and bias gradients are this rank's
share only (its own rows' contribution), as with ``nn.SyncBatchNorm``:
``DistributedDataParallel`` adds them up over the ranks itself.

**The cost.** Every rank receives the whole batch's activations in forward and reduces a
gradient of that size in backward: traffic and memory grow with the activations, where an
implementation that exchanges per-channel statistics sends ``2C + 1`` numbers per rank
forward and all-reduces ``2C`` backward (``nn.SyncBatchNorm`` on GPUs all-gathers every
rank's mean, inverse std and count, then all-reduces two gradient sums; lab 4 has students
derive the statistics from all-reduces of a size independent of the world size, and the
layer as an autograd Function). Here simplicity wins: this module only backs the trainer's
``--sync-bn`` on the CPU, with small models and a few processes.
:func:`convert_sync_batchnorm_auto` picks ``nn.SyncBatchNorm`` wherever it runs.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import FunctionCtx, once_differentiable
from torch.nn.modules.batchnorm import _BatchNorm

#: Device types on which ``torch.nn.SyncBatchNorm`` works; everywhere else we use ours.
NATIVE_SYNCBN_DEVICES = ("cuda", "hpu", "xpu")

#: Dimensions described in :func:`_shapes` (``(N, C, D, H, W)`` at most, plus the rank).
_MAX_DIMS = 6


def _shapes(x: Tensor, group: Any | None) -> list[int]:
    """Every rank's row count (one small ``all_gather``); raises when the ranks' inputs do
    not share ``(C, *spatial)``, identically on every rank (so no rank waits for another).
    """
    world = dist.get_world_size(group)
    values = [x.dim(), *x.shape] + [-1] * (_MAX_DIMS - x.dim())
    meta = torch.tensor(values, dtype=torch.int64, device=x.device)
    metas = [torch.empty_like(meta) for _ in range(world)]
    dist.all_gather(metas, meta, group=group)
    rows = [int(m[1]) for m in metas]
    trails = {tuple(m[2:].tolist()) + (int(m[0]),) for m in metas}
    if len(trails) > 1:
        seen = ", ".join(str([int(v) for v in m[1 : 1 + int(m[0])]]) for m in metas)
        raise ValueError(
            "SyncBatchNorm: the ranks' inputs must share every dimension but the batch "
            f"dimension; got shapes {seen}"
        )
    return rows


class GatherRows(torch.autograd.Function):
    """Every rank's rows, concatenated in rank order, as a differentiable operation.

    ``GatherRows.apply(x, rows, group)`` with ``rows`` every rank's row count returns a
    tensor of ``sum(rows)`` rows, the same on every rank. Forward pads ``x`` to
    ``max(rows)`` rows and ``all_gather``\\ s it; backward ``all_reduce``\\ s the gradient
    of the gathered tensor (every rank's outputs depend on every rank's rows) and returns
    this rank's rows of it. Every rank of ``group`` must call both.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: FunctionCtx, x: Tensor, rows: list[int], group: Any | None
    ) -> Tensor:
        rank, top = dist.get_rank(group), max(rows)
        padded = x.new_zeros((top, *x.shape[1:]))
        padded[: x.size(0)] = x
        pieces = [torch.empty_like(padded) for _ in rows]
        dist.all_gather(pieces, padded.contiguous(), group=group)
        ctx.rows, ctx.rank, ctx.group = rows, rank, group
        return torch.cat([p[:n] for p, n in zip(pieces, rows, strict=True)])

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None]:
        grad = grad.clone(memory_format=torch.contiguous_format)  # reduced in place
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        start = sum(ctx.rows[: ctx.rank])
        return grad[start : start + ctx.rows[ctx.rank]].clone(), None, None


def sync_batch_norm(
    x: Tensor,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    momentum: float,
    eps: float,
    group: Any | None = None,
) -> Tensor:
    """Training-mode BatchNorm of ``x`` over the global batch of ``group``; this rank's rows.

    Args:
        x: this rank's input ``(N, C, *)``; ``N`` may differ between ranks, and be 0.
        running_mean, running_var: ``(C,)`` buffers updated in place (or None), the same
            way on every rank.
        weight, bias: ``(C,)`` affine parameters, or None.
        momentum, eps: as in ``F.batch_norm``.
        group: the process group (None: the whole world).

    Returns:
        This rank's rows of ``F.batch_norm`` applied to the concatenation of every rank's
        ``x``, in rank order.

    Raises:
        ValueError: the global batch holds at most one value per channel, or the ranks'
            inputs differ beyond the batch dimension.
    """
    rows = _shapes(x, group)
    per_channel = sum(rows) * math.prod(x.shape[2:])
    if per_channel <= 1:
        raise ValueError(
            "Expected more than 1 value per channel when training, got "
            f"{per_channel} over all ranks (input shape on this rank: {list(x.shape)})"
        )
    everyone = GatherRows.apply(x, rows, group)
    y = F.batch_norm(everyone, running_mean, running_var, weight, bias, True, momentum, eps)
    start = sum(rows[: dist.get_rank(group)])
    return y[start : start + x.size(0)]


class SyncBatchNorm(_BatchNorm):
    """BatchNorm whose training statistics come from the global batch of a process group.

    A drop-in for ``torch.nn.SyncBatchNorm`` that also runs on CPU tensors (gloo). It takes
    inputs of shape ``(N, C)``, ``(N, C, L)``, ``(N, C, H, W)`` or ``(N, C, D, H, W)``. In
    eval mode, or when there is nothing to synchronise (no initialised process group, or a
    group of one rank), it is exactly ``F.batch_norm``, i.e. a plain BatchNorm; otherwise it
    is :func:`sync_batch_norm` (see the module docstring for how, and what it costs).

    Args:
        num_features: number of channels ``C``.
        eps: added to the variance for numerical stability.
        momentum: weight of the new batch in the running stats; ``None`` for a cumulative
            average over all batches seen (uses ``num_batches_tracked``).
        affine: learn a per-channel scale and shift.
        track_running_stats: keep running mean and variance for eval mode.
        process_group: the ranks to synchronise over; ``None`` for the whole world.
        device, dtype: where and in which dtype to create parameters and buffers.
        bias: learn the shift (with ``affine``).

    Example:
        >>> bn = SyncBatchNorm(3)   # no process group: a plain BatchNorm
        >>> x = torch.randn(8, 3, 4, 4)
        >>> torch.equal(bn(x), nn.BatchNorm2d(3)(x))
        True
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: Any | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        bias: bool = True,
    ) -> None:
        super().__init__(
            num_features,
            eps,
            momentum,
            affine,
            track_running_stats,
            device=device,
            dtype=dtype,
            bias=bias,
        )
        self.process_group = process_group

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")
        if input.size(1) == 0:
            raise ValueError("SyncBatchNorm number of input channels should be non-zero")

    def _world_size(self) -> int:
        if not (dist.is_available() and dist.is_initialized()):
            return 1
        return dist.get_world_size(self.process_group)

    def forward(self, input: Tensor) -> Tensor:
        """Normalise ``input`` with global batch statistics (training) or running stats."""
        self._check_input_dim(input)
        # The same bookkeeping as nn.BatchNorm2d, so that running stats match it exactly.
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average
                factor = 1.0 / float(self.num_batches_tracked.item())
        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        track = not self.training or self.track_running_stats
        running_mean = self.running_mean if track else None
        running_var = self.running_var if track else None

        if not (bn_training and self.training and self._world_size() > 1):
            return F.batch_norm(
                input,
                running_mean,
                running_var,
                self.weight,
                self.bias,
                bn_training,
                factor,
                self.eps,
            )
        return sync_batch_norm(
            input,
            running_mean,
            running_var,
            self.weight,
            self.bias,
            factor,
            self.eps,
            self.process_group,
        )

    @classmethod
    def convert_sync_batchnorm(
        cls, module: nn.Module, process_group: Any | None = None
    ) -> nn.Module:
        """Alias of :func:`convert_sync_batchnorm`, like ``nn.SyncBatchNorm``'s classmethod."""
        return convert_sync_batchnorm(module, process_group)


def convert_sync_batchnorm(module: nn.Module, process_group: Any | None = None) -> nn.Module:
    """Replace every BatchNorm layer of a model, recursively, by a :class:`SyncBatchNorm`.

    Like ``nn.SyncBatchNorm.convert_sync_batchnorm``: each new layer keeps the old layer's
    settings and *shares* its weight and bias (the same ``Parameter`` objects, hence the same
    values, dtype, device and ``requires_grad``, and an optimizer built before the conversion
    still updates them), its running stats and ``num_batches_tracked``, and its training
    flag. Other layers are left as they are. Convert *before* wrapping in DDP.

    Args:
        module: a model, or a single BatchNorm layer.
        process_group: the ranks to synchronise over; ``None`` for the whole world.

    Returns:
        ``module`` itself with its BatchNorm children replaced, or a new
        :class:`SyncBatchNorm` when ``module`` is itself a BatchNorm layer.

    Example:
        >>> net = convert_sync_batchnorm(nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8)))
        >>> type(net[1]).__name__
        'SyncBatchNorm'
    """
    out = module
    if isinstance(module, _BatchNorm):
        out = SyncBatchNorm(
            module.num_features,
            module.eps,
            module.momentum,
            module.affine,
            module.track_running_stats,
            process_group,
            bias=module.bias is not None,
        )
        if module.affine:
            out.weight = module.weight
            out.bias = module.bias
        out.running_mean = module.running_mean
        out.running_var = module.running_var
        out.num_batches_tracked = module.num_batches_tracked
        out.train(module.training)
        if hasattr(module, "qconfig"):
            out.qconfig = module.qconfig
    for name, child in module.named_children():
        out.add_module(name, convert_sync_batchnorm(child, process_group))
    return out


def convert_sync_batchnorm_auto(
    module: nn.Module, device: torch.device | str, process_group: Any | None = None
) -> nn.Module:
    """Synchronise a model's BatchNorm layers with the implementation that fits the device.

    On CUDA (and the other devices ``nn.SyncBatchNorm`` supports) this is
    ``nn.SyncBatchNorm.convert_sync_batchnorm``, with its fused kernels; on the CPU (and
    anywhere else) it is this module's :func:`convert_sync_batchnorm`.

    Args:
        module: the model, not yet wrapped in DDP.
        device: the device the model trains on.
        process_group: the ranks to synchronise over; ``None`` for the whole world.

    Returns:
        The converted model (see :func:`convert_sync_batchnorm`).

    Example:
        >>> net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
        >>> type(convert_sync_batchnorm_auto(net, "cpu")[1]).__module__
        'ddp_lab.syncbn'
    """
    if torch.device(device).type in NATIVE_SYNCBN_DEVICES:
        return nn.SyncBatchNorm.convert_sync_batchnorm(module, process_group)
    return convert_sync_batchnorm(module, process_group)
