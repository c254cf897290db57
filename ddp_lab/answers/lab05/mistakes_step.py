"""Typical wrong DDP steps (lab 5, exercise 4, ``ddp_step.py``), as students write them:
clipping before ``unscale_``, every micro-batch synchronised, the loss not divided by
``accumulate``, an overflowing step skipped by hand without ``scaler.update()``,
``optimizer.step()`` instead of ``scaler.step``, the norm summed over the ranks, the
gradients zeroed at every micro-batch. Collected into ``MISTAKES`` / ``MORE_MISTAKES`` by
:mod:`ddp_lab.answers.lab05.mistakes`.
"""

from __future__ import annotations

from ddp_lab.answers import Mistake

# the right step, with the pieces the mistakes change
_STEP = """%%writefile ddp_step.py
import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.utils import clip_grad_norm_


def train_steps(ddp_model, optimizer, scaler, micro_batches, accumulate, max_norm):
    norms = []
    for start in range(0, len(micro_batches), accumulate):
        group = micro_batches[start:start + accumulate]
        for i, (x, y) in enumerate(group):
            last = i == len(group) - 1{zero}
            with {context}:
                with torch.autocast(x.device.type, dtype=torch.float16):
                    loss = F.cross_entropy(ddp_model(x), y){divide}
                scaler.scale(loss).backward()
{middle}
        optimizer.zero_grad(set_to_none=True)
    return norms
"""
_SYNC = "contextlib.nullcontext() if last else ddp_model.no_sync()"
_RIGHT = """        scaler.unscale_(optimizer)
        norms.append(clip_grad_norm_(ddp_model.parameters(), max_norm))
        scaler.step(optimizer)
        scaler.update()"""


def _step(
    middle: str = _RIGHT, context: str = _SYNC, divide: str = " / accumulate", zero: str = ""
) -> str:
    return _STEP.format(middle=middle, context=context, divide=divide, zero=zero)


STEP_MISTAKES = [
    Mistake(
        "ex4_ddp_step",
        "clip_before_unscale",  # the minGPT order: the clip sees S times the gradient
        _step(
            """        norms.append(clip_grad_norm_(ddp_model.parameters(), max_norm))
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()"""
        ),
        "clipped the scaled gradients",
    ),
    Mistake(
        "ex4_ddp_step",
        "no_no_sync",  # right weights, one all-reduce per micro-batch
        _step(context="contextlib.nullcontext()"),
        "under ddp_model.no_sync()",
    ),
    Mistake(
        "ex4_ddp_step",
        "loss_not_divided",  # accumulate times the gradient: the norm, and the unclipped step
        _step(divide=""),
        "not divided by accumulate",
    ),
    Mistake(
        "ex4_ddp_step",
        "skips_without_update",  # skips the overflow by hand: the scale never comes down
        _step(
            """        grads = [p.grad for p in ddp_model.parameters() if p.grad is not None]
        if not all(bool(torch.isfinite(g).all()) for g in grads):
            norms.append(float("inf"))
            optimizer.zero_grad(set_to_none=True)
            continue
        scaler.unscale_(optimizer)
        norms.append(clip_grad_norm_(ddp_model.parameters(), max_norm))
        scaler.step(optimizer)
        scaler.update()"""
        ),
        "skipped steps included",
    ),
    Mistake(
        "ex4_ddp_step",
        "optimizer_step",  # unscaled and clipped right, but the overflow reaches the weights
        _step(
            """        scaler.unscale_(optimizer)
        norms.append(clip_grad_norm_(ddp_model.parameters(), max_norm))
        optimizer.step()
        scaler.update()"""
        ),
        "must be skipped on every rank",
    ),
    Mistake(
        "ex4_ddp_step",
        "norm_summed_over_ranks",  # exercise 5's all-reduce on gradients DDP already averaged
        _step(
            """        scaler.unscale_(optimizer)
        grads = [p.grad for p in ddp_model.parameters() if p.grad is not None]
        total = sum((g.double() ** 2).sum() for g in grads)
        dist.all_reduce(total)
        norm = total.sqrt()
        for g in grads:
            g.mul_(min(1.0, max_norm / (float(norm) + 1e-6)))
        norms.append(norm)
        scaler.step(optimizer)
        scaler.update()"""
        ),
        "already averaged",
    ),
    Mistake(
        "ex4_ddp_step",
        "zero_grad_every_micro_batch",  # only the last micro-batch's gradient is left
        _step(zero="\n            optimizer.zero_grad(set_to_none=True)"),
        "times the float32 step",
    ),
]
