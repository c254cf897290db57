"""The optimizer side of a training step, in the order lab 5 teaches.

Mixed precision (:func:`autocast`; with fp16 a ``torch.amp.GradScaler``), then
:func:`optimizer_step`: unscale -> clip -> step (skipped on inf/NaN) -> update the scale,
and the linear warm-up of the learning rate (:func:`warmup_schedule`). Nothing here reads a
tensor on the host: the trainer's step stays free of syncs.
"""

from __future__ import annotations

import contextlib

import torch


def autocast(amp: str, device: torch.device):
    """The forward pass's autocast context for ``--amp`` (``"off"``, ``"bf16"``, ``"fp16"``).

    Example:
        >>> with autocast("bf16", torch.device("cpu")):
        ...     (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
        torch.bfloat16
    """
    if amp == "off":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if amp == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def _grad_norm(params: list[torch.nn.Parameter]) -> torch.Tensor:
    grads = [p.grad for p in params if p.grad is not None]
    return torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())


def optimizer_step(
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    params: list[torch.nn.Parameter],
    clip: float | None,
    need_norm: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """One optimizer step from accumulated (and, with fp16, scaled) gradients, in the order
    that keeps clipping right: unscale -> clip -> step (skipped on inf/NaN) -> update scale.

    Clipping before ``unscale_`` would compare the *scaled* norm with ``clip`` (the bug of
    the PyTorch examples' minGPT trainer). Nothing here reads a tensor on the host.

    Args:
        optimizer: the optimizer; its gradients are zeroed at the end.
        scaler: the GradScaler (disabled unless fp16: then unscale/step/update are plain).
        params: the parameters to clip and measure.
        clip: the maximum global gradient norm, or ``None``.
        need_norm: compute the gradient norm even without clipping.

    Returns:
        ``(grad_norm, skipped)``: the global norm before clipping (a 0-d device tensor, or
        ``None`` when neither clipping nor ``need_norm`` asked for it), and a 0-d device
        tensor that is 1 when the scaler skipped the step (``None`` without fp16).

    Example:
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> model(torch.ones(1, 2)).sum().backward()
        >>> scaler = torch.amp.GradScaler("cpu", enabled=False)
        >>> norm, skipped = optimizer_step(opt, scaler, list(model.parameters()), 1.0, False)
        >>> round(float(norm), 4), skipped
        (1.7321, None)
    """
    scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
    grad_norm = None
    if clip is not None:
        grad_norm = torch.nn.utils.clip_grad_norm_(params, clip)
    elif need_norm:  # the norm costs a pass over the gradients: only when asked
        grad_norm = _grad_norm(params)
    skipped = None
    if scaler.is_enabled():
        scale = scaler._scale.clone()  # the scale halves exactly when the step is skipped
        scaler.step(optimizer)
        scaler.update()
        skipped = (scaler._scale < scale).to(torch.int64)
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, skipped


def warmup_schedule(optimizer: torch.optim.Optimizer, warmup_steps: int):
    """Linear warm-up: optimizer step k uses ``min(1, k / warmup_steps)`` of the base rate.

    Call ``scheduler.step()`` after every optimizer step. With ``warmup_steps`` 0 the rate
    is the base rate from the first step (exactly: the factor is 1.0).

    Example:
        >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        >>> sched = warmup_schedule(opt, 4)
        >>> rates = []
        >>> for _ in range(5):
        ...     rates.append(opt.param_groups[0]["lr"])
        ...     opt.step()
        ...     sched.step()
        >>> rates
        [0.25, 0.5, 0.75, 1.0, 1.0]
    """
    if warmup_steps <= 0:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda done: 1.0)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda done: min(1.0, (done + 1) / warmup_steps)
    )
