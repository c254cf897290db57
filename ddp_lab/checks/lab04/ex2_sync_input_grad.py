"""Exercise 2: ``sync_input_grad(dy, x_hat, invstd, weight, count)`` in ``sync_grad.py``.

Every rank of a torchrun job receives its slice's ``dy`` and ``x_hat``, the global
``invstd`` and count, and BatchNorm's ``weight``, and must return BatchNorm's input gradient
for its slice: a formula the student derives, whose per-channel sums run over the global
batch. The judge's oracle is autograd through ``F.batch_norm`` on the concatenated global
batch (float64), split by rank; the gradient must come back in ``dy``'s dtype, as the
docstring promises (autograd expects it so from a ``backward``).

Case set, in one job of 3 ranks (:func:`~ddp_lab.checks.lab04.common.per_run`):

- 3 ranks, float64 images ``(N, C, H, W)``, 3 or 4 channels, one rank without samples;
- 3 ranks, float32 ``(N, 1)``, unequal slices;
- 2 ranks (a group of ranks 0 and 1), float64 ``(N, C, L)``, one rank holding one sample;
- 2 ranks, float32 images with 2 to 4 channels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ddp_lab.checks.contract import Exercise
from ddp_lab.checks.failure import CheckFailed, assert_close
from ddp_lab.checks.lab04.common import (
    DTYPES,
    EPS,
    GRAD_FILE,
    RUNTIME,
    global_count,
    global_stats,
    load_file,
    per_run,
    rank_batches,
    run_text,
    runs_of,
    shift_hint,
    sizes,
    worlds_text,
)
from ddp_lab.checks.values import plain, randint, uniform

#: ``(atol, rtol)`` by dtype; ``atol`` in units of the largest expected gradient.
TOL = {"float32": (2e-5, 1e-4), "float64": (1e-10, 1e-8)}


def make_run(
    gen: torch.Generator,
    ranks: int,
    dtype: str,
    tail: tuple[int, ...],
    channels: int,
    empty: bool = False,
    single: bool = False,
) -> dict:
    """One call on every rank: the slices of one batch, their ``dy``, ``x_hat`` (from the
    global statistics), the global ``invstd`` and count, a random ``weight``."""
    batch_sizes = sizes(gen, ranks, 1, 6, empty=empty, single=single)
    xs = rank_batches(gen, batch_sizes, channels, tail, dtype)
    mean, _, invstd = global_stats(xs)
    view = (1, channels, *([1] * len(tail)))
    cast = DTYPES[dtype]
    return {
        "ranks": ranks,
        "sizes": batch_sizes,
        "channels": channels,
        "tail": list(tail),
        "dtype": dtype,
        "xs": xs,
        "dys": [
            (uniform(gen, 0.5, 2) * torch.randn(x.shape, generator=gen, dtype=torch.float64)).to(
                cast
            )
            for x in xs
        ],
        "x_hats": [((x.double() - mean.reshape(view)) * invstd.reshape(view)).to(cast) for x in xs],
        "invstd": invstd.to(cast),
        "weight": (0.5 + torch.rand(channels, generator=gen, dtype=torch.float64)).to(cast),
        "count": global_count(xs),
    }


def make_inputs(gen: torch.Generator) -> dict:
    """One job of 3 ranks: two runs over all 3, two over ranks 0 and 1 (see the module)."""
    image = (randint(gen, 2, 3), randint(gen, 2, 3))
    return {
        "cases": [
            {
                "world_size": 3,
                "runs": [
                    make_run(gen, 3, "float64", image, randint(gen, 3, 4), empty=True),
                    make_run(gen, 3, "float32", (), 1),
                    make_run(
                        gen, 2, "float64", (randint(gen, 2, 4),), randint(gen, 2, 4), single=True
                    ),
                    make_run(gen, 2, "float32", image, randint(gen, 2, 4)),
                ],
            }
        ]
    }


def visible_inputs(gen: torch.Generator) -> dict:
    """One job of 2 ranks: float64 ``(N, C, L)`` and float32 ``(N, 1)``, unequal slices."""
    return {
        "cases": [
            {
                "world_size": 2,
                "runs": [
                    make_run(gen, 2, "float64", (3,), 3),
                    make_run(gen, 2, "float32", (), 1),
                ],
            }
        ]
    }


def run_rank(ns: dict, inputs: dict, case: dict, rank: int, world: int) -> list:
    """The student's ``sync_input_grad`` on this rank's slice, once per run it takes part in."""
    fn = load_file(GRAD_FILE)["sync_input_grad"]

    def one(run: dict, r: int):
        return plain(
            fn(
                run["dys"][r].clone(),
                run["x_hats"][r].clone(),
                run["invstd"].clone(),
                run["weight"].clone(),
                run["count"],
            )
        )

    return per_run(case, rank, world, one)


def autograd_input_grads(
    xs: list[torch.Tensor], dys: list[torch.Tensor], weight: torch.Tensor
) -> list[torch.Tensor]:
    """BatchNorm's input gradient over the concatenated batch, by autograd (float64), split
    by rank."""
    x = torch.cat(xs).double().requires_grad_(True)
    y = F.batch_norm(x, None, None, weight.double(), None, training=True, eps=EPS)
    (y * torch.cat(dys).double()).sum().backward()
    return list(x.grad.split([len(t) for t in xs]))


def check_run(run: dict, got: list) -> None:
    """Every rank's gradient against autograd on the concatenated global batch."""
    expected = autograd_input_grads(run["xs"], run["dys"], run["weight"])
    scale = max(float(e.abs().max()) if e.numel() else 0.0 for e in expected)
    atol, rtol = TOL[run["dtype"]]
    for rank, dx in enumerate(got):
        what = f"sync_input_grad on rank {rank} ({run_text(run)})"
        try:
            assert_close(dx, expected[rank], f"{what}: the input gradient", atol * scale, rtol)
        except CheckFailed as err:
            raise CheckFailed(f"{err}{shift_hint(run['dys'], got)}") from None
        want = run["dys"][rank].dtype
        if dx.dtype != want:
            raise CheckFailed(
                f"{what}: the values are right, but dx is {dx.dtype}; the docstring promises "
                f"it in dy's dtype ({want}), which autograd expects back from backward"
            )


def judge(inputs: dict, outputs: dict) -> str:
    """Every rank's gradient against autograd on the concatenated global batch."""
    for run, got in runs_of(inputs, outputs):
        check_run(run, got)
    return (
        "sync_input_grad equals BatchNorm's input gradient over the global batch on "
        f"{worlds_text(inputs)} ranks (unequal and empty slices, float32 and float64)"
    )


EXERCISE = Exercise(
    "test_ex2_sync_input_grad",
    ("ex2_sync_input_grad",),
    "BatchNorm's input gradient over a batch split across ranks",
    make_inputs,
    judge,
    run_rank=run_rank,
    forbid_modules=RUNTIME,
    timeout=60,
    visible_inputs=visible_inputs,
    files=(GRAD_FILE,),
)
