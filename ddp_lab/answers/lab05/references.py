"""Lab 5's reference answers (instructor only): what the solution notebook does, as functions.

- :func:`fp16_report`: casts the gradients (the kit's judge derives thresholds instead);
- :class:`LossScaler`: the dynamic loss scaler that equals ``torch.amp.GradScaler``;
- :func:`train_accumulated`: accumulation over ``k`` micro-batches with ``no_sync``;
- :func:`train_steps`: accumulation with ``no_sync``, float16 with a scaler, ``unscale_``
  before clipping, one DDP step per ``accumulate`` micro-batches;
- :func:`global_grad_norm`: the norm of gradients sharded over ranks.

``FILES`` holds the three ``%%writefile`` files of the notebook (exercises 3, 4 and 5) as
sources, for the tests.
"""

from __future__ import annotations

import contextlib
import inspect
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F


def _zero_share(values: torch.Tensor, nonzero: int, dtype: torch.dtype) -> float:
    return int((values.to(dtype) == 0).sum()) / nonzero


def fp16_report(grads: list[torch.Tensor]) -> dict[str, float]:
    """float16 underflow at scale 1, the largest power-of-two loss scale that overflows
    nothing, the underflow left at that scale, and bfloat16's underflow (by casting).

    The values are scaled in float64: a float32 gradient can need a scale up to about
    2**165 (its largest magnitude as small as 2**-149), while in float32 ``2.0**128`` is
    already inf. Casting a float64 value that float32 holds exactly to float16 or bfloat16
    rounds as casting the float32 value does, so the shares are those of the float32
    gradients.
    """
    flat = torch.cat([g.detach().reshape(-1).double() for g in grads])
    nz = flat[flat != 0]
    top = nz.abs().max()
    k = math.floor(math.log2(torch.finfo(torch.float16).max / float(top)))
    while not torch.isinf((top * 2.0 ** (k + 1)).half()):  # the largest finite one
        k += 1
    while torch.isinf((top * 2.0**k).half()):
        k -= 1
    scale = 2.0**k
    return {
        "underflow": _zero_share(nz, nz.numel(), torch.float16),
        "max_scale": scale,
        "underflow_at_max_scale": _zero_share(nz * scale, nz.numel(), torch.float16),
        "bf16_underflow": _zero_share(nz, nz.numel(), torch.bfloat16),
    }


class LossScaler:
    """A dynamic loss scaler with ``torch.amp.GradScaler``'s behaviour (one device)."""

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ):
        self._scale = float(init_scale)
        self._growth_factor = growth_factor
        self._backoff_factor = backoff_factor
        self._growth_interval = growth_interval
        self._good_steps = 0
        self._found_inf = False
        self._unscaled = False

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self._scale

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        inv = 1.0 / self._scale
        found = False
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                p.grad.mul_(inv)
                found = found or not bool(torch.isfinite(p.grad).all())
        self._found_inf = found
        self._unscaled = True

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if not self._unscaled:
            self.unscale_(optimizer)
        if not self._found_inf:
            optimizer.step()

    def update(self) -> None:
        if self._found_inf:
            self._scale *= self._backoff_factor
            self._good_steps = 0
        else:
            self._good_steps += 1
            if self._good_steps == self._growth_interval:
                self._scale *= self._growth_factor
                self._good_steps = 0
        self._found_inf = False
        self._unscaled = False

    def get_scale(self) -> float:
        return self._scale


def train_accumulated(ddp_model, optimizer, micro_batches, k, loss_fn) -> int:
    """One optimizer step per group of ``k`` micro-batches (the last group may be shorter),
    DDP's all-reduce on the last micro-batch of each group only; returns the step count."""
    steps = 0
    for start in range(0, len(micro_batches), k):
        group = micro_batches[start : start + k]
        for i, (x, y) in enumerate(group):
            sync = i == len(group) - 1
            with contextlib.nullcontext() if sync else ddp_model.no_sync():
                (loss_fn(ddp_model(x), y) / len(group)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        steps += 1
    return steps


def train_steps(ddp_model, optimizer, scaler, micro_batches, accumulate, max_norm):
    """One optimizer step per ``accumulate`` micro-batches under DDP: float16 autocast, the
    scaled loss divided by ``accumulate``, ``no_sync`` on all but the last micro-batch,
    ``unscale_`` -> clip -> ``scaler.step`` -> ``update``; the norms before clipping."""
    norms = []
    for start in range(0, len(micro_batches), accumulate):
        group = micro_batches[start : start + accumulate]
        for i, (x, y) in enumerate(group):
            last = i == len(group) - 1
            with contextlib.nullcontext() if last else ddp_model.no_sync():
                with torch.autocast(x.device.type, dtype=torch.float16):
                    loss = F.cross_entropy(ddp_model(x), y) / accumulate
                scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        norms.append(float(torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), max_norm)))
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    return norms


def global_grad_norm(local_grads, norm_type=2.0, group=None) -> torch.Tensor:
    """The norm of the group's gradients together (float64), the same on its every rank."""
    values = [g.detach().reshape(-1).double() for g in local_grads]
    local = torch.cat(values) if values else torch.zeros(0, dtype=torch.float64)
    if norm_type == math.inf:
        total = local.abs().max() if local.numel() else torch.zeros((), dtype=torch.float64)
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
        return total
    total = local.square().sum()
    dist.all_reduce(total, group=group)
    return total.sqrt()


def _file(*functions, header: str) -> str:
    return header + "\n\n\n" + "\n\n\n".join(inspect.getsource(f) for f in functions)


#: The notebook's three files (``%%writefile`` cells), as the reference writes them.
FILES = {
    "accum.py": _file(train_accumulated, header="import contextlib"),
    "ddp_step.py": _file(
        train_steps,
        header="import contextlib\n\nimport torch\nimport torch.nn.functional as F",
    ),
    "grad_norm.py": _file(
        global_grad_norm, header="import math\n\nimport torch\nimport torch.distributed as dist"
    ),
}
