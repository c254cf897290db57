"""Exercise 3: ``sync_input_grad(dy, x_hat, invstd, weight, count)`` in ``sync_grad.py``.

Every rank of a torchrun job receives its slice's ``dy`` and ``x_hat``, the global
``invstd`` and count, and must return BatchNorm's input gradient for its slice. The judge's
oracle is autograd through ``F.batch_norm`` on the concatenated global batch, split by rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ddp_lab.checks.contract import Exercise
from ddp_lab.checks.failure import CheckFailed, assert_close
from ddp_lab.checks.lab04.common import (
    EPS,
    GRAD_FILE,
    RUNTIME,
    global_stats,
    load_file,
    rank_batches,
    shift_hint,
    sizes,
    sizes_text,
    values_per_channel,
    worlds_text,
)
from ddp_lab.checks.values import plain, randint


def _case(gen: torch.Generator, world: int, tail: tuple[int, ...]) -> dict:
    c = randint(gen, 2, 4)
    batch_sizes = sizes(gen, world, 1, 6)
    xs = rank_batches(gen, batch_sizes, c, tail)
    mean, _, invstd = global_stats(xs)
    view = (1, c, *([1] * len(tail)))
    return {
        "world_size": world,
        "sizes": batch_sizes,
        "xs": xs,
        "dys": [torch.randn(x.shape, generator=gen, dtype=torch.float64) for x in xs],
        "x_hats": [(x - mean.reshape(view)) * invstd.reshape(view) for x in xs],
        "invstd": invstd,
        "weight": 0.5 + torch.rand(c, generator=gen, dtype=torch.float64),
        "count": float(sum(values_per_channel(x) for x in xs)),
    }


def make_inputs(gen: torch.Generator) -> dict:
    """One job of 3 ranks with different batch sizes, images of a random size."""
    return {"cases": [_case(gen, 3, (randint(gen, 1, 3), randint(gen, 1, 3)))]}


def visible_inputs(gen: torch.Generator) -> dict:
    """2 ranks of different batch sizes, ``(N, C, L)`` inputs."""
    return {"cases": [_case(gen, 2, (randint(gen, 1, 3),))]}


def run_rank(ns: dict, inputs: dict, case: dict, rank: int, world: int):
    """The student's ``sync_input_grad`` on this rank's slice."""
    fn = load_file(GRAD_FILE)["sync_input_grad"]
    out = fn(
        case["dys"][rank].clone(),
        case["x_hats"][rank].clone(),
        case["invstd"].clone(),
        case["weight"].clone(),
        case["count"],
    )
    return plain(out)


def autograd_input_grads(
    xs: list[torch.Tensor], dys: list[torch.Tensor], weight: torch.Tensor
) -> list[torch.Tensor]:
    """BatchNorm's input gradient over the concatenated batch, by autograd, split by rank."""
    x = torch.cat(xs).double().requires_grad_(True)
    y = F.batch_norm(x, None, None, weight.double(), None, training=True, eps=EPS)
    (y * torch.cat(dys).double()).sum().backward()
    return list(x.grad.split([len(t) for t in xs]))


def judge(inputs: dict, outputs: dict) -> str:
    """Every rank's gradient against autograd on the concatenated global batch."""
    for case, got in zip(inputs["cases"], outputs["cases"], strict=True):
        expected = autograd_input_grads(case["xs"], case["dys"], case["weight"])
        for rank, dx in enumerate(got):
            what = f"sync_input_grad on rank {rank} ({sizes_text(case)})"
            try:
                assert_close(
                    dx, expected[rank], f"{what}: the input gradient", atol=1e-9, rtol=1e-7
                )
            except CheckFailed as err:
                raise CheckFailed(f"{err}{shift_hint(case['dys'], got)}") from None
    return (
        "sync_input_grad equals BatchNorm's input gradient over the global batch "
        f"({worlds_text(inputs)} ranks)"
    )


EXERCISE = Exercise(
    "test_ex3_sync_input_grad",
    ("ex3_sync_input_grad",),
    "BatchNorm's input gradient from all-reduced gradient sums",
    make_inputs,
    judge,
    run_rank=run_rank,
    forbid_modules=RUNTIME,
    timeout=60,
    visible_inputs=visible_inputs,
    files=(GRAD_FILE,),
)
