"""Exercise 4: ``SyncBNFunction`` in ``sync_bn.py``, the whole autograd Function.

Every rank of a torchrun job runs 2 training steps on its slice (batch sizes differ between
ranks) and records its outputs, input, weight and bias gradients and the running
statistics. The student's file builds on their ``sync_stats.py`` and ``sync_grad.py``
(exercises 2 and 3): the visible check uses the student's own, the grader correct ones.

The judge's oracle is ``F.batch_norm`` (with running statistics) on the concatenated global
batch, step by step, and autograd through it: the input gradient of the whole global loss,
and for the weight and bias each rank's *own* share (the gradient of its own rows' loss),
which is what the Function must return, since DDP adds parameter gradients up itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ddp_lab.checks.contract import Exercise
from ddp_lab.checks.failure import CheckFailed, assert_close, is_close
from ddp_lab.checks.lab04.common import (
    EPS,
    FUNCTION_FILE,
    RUNTIME,
    load_file,
    rank_batches,
    shift_hint,
    sizes,
    sizes_text,
    worlds_text,
)
from ddp_lab.checks.values import kind, plain, randint

#: Training steps per case (the running statistics are updated twice).
STEPS = 2
TOL = {"atol": 1e-6, "rtol": 1e-6}


def _case(gen: torch.Generator, world: int, tail: tuple[int, ...]) -> dict:
    c = randint(gen, 2, 4)
    batch_sizes = sizes(gen, world, 1, 5)
    return {
        "world_size": world,
        "sizes": batch_sizes,
        "xs": [rank_batches(gen, batch_sizes, c, tail) for _ in range(STEPS)],
        "dys": [
            [torch.randn(n, c, *tail, generator=gen, dtype=torch.float64) for n in batch_sizes]
            for _ in range(STEPS)
        ],
        "weight": 0.5 + torch.rand(c, generator=gen, dtype=torch.float64),
        "bias": torch.randn(c, generator=gen, dtype=torch.float64),
        "running_mean": 0.2 * torch.randn(c, generator=gen, dtype=torch.float64),
        "running_var": 1 + torch.rand(c, generator=gen, dtype=torch.float64),
        "momentum": [0.1, 0.2, 0.3][randint(gen, 0, 2)],
    }


def make_inputs(gen: torch.Generator) -> dict:
    """2 ranks with images of a random size, 3 ranks with ``(N, C)`` inputs."""
    return {
        "cases": [
            _case(gen, 2, (randint(gen, 1, 3), randint(gen, 1, 3))),
            _case(gen, 3, ()),
        ]
    }


def visible_inputs(gen: torch.Generator) -> dict:
    """The 2-rank case only (one torchrun job)."""
    return {"cases": make_inputs(gen)["cases"][:1]}


def run_rank(ns: dict, inputs: dict, case: dict, rank: int, world: int) -> dict:
    """:data:`STEPS` steps of the student's Function on this rank's slices."""
    fn = load_file(FUNCTION_FILE)["SyncBNFunction"]
    weight = case["weight"].clone().requires_grad_(True)
    bias = case["bias"].clone().requires_grad_(True)
    running_mean, running_var = case["running_mean"].clone(), case["running_var"].clone()
    out: dict = {"y": [], "grad_x": [], "grad_weight": [], "grad_bias": []}
    for xs, dys in zip(case["xs"], case["dys"], strict=True):
        x = xs[rank].clone().requires_grad_(True)
        y = fn.apply(x, weight, bias, running_mean, running_var, case["momentum"], EPS)
        out["y"].append(plain(y))
        if isinstance(y, torch.Tensor) and y.requires_grad and y.shape == dys[rank].shape:
            (y * dys[rank]).sum().backward()
        out["grad_x"].append(plain(x.grad))
        out["grad_weight"].append(plain(weight.grad))
        out["grad_bias"].append(plain(bias.grad))
        weight.grad = bias.grad = None
    out["running_mean"], out["running_var"] = plain(running_mean), plain(running_var)
    return out


def batchnorm_oracle(case: dict) -> dict:
    """``F.batch_norm`` on the concatenated global batch, step by step, and autograd.

    Returns per step the output and the input gradient split by rank, every rank's *own*
    weight and bias gradients (of its own rows' loss), their totals (of the global loss),
    and the running statistics after the last step.
    """
    running_mean, running_var = case["running_mean"].clone(), case["running_var"].clone()
    rows = case["sizes"]
    ref: dict = {"y": [], "grad_x": [], "grad_weight": [], "grad_bias": [], "total": []}
    for xs, dys in zip(case["xs"], case["dys"], strict=True):
        x = torch.cat(xs).requires_grad_(True)
        weight = case["weight"].clone().requires_grad_(True)
        bias = case["bias"].clone().requires_grad_(True)
        y = F.batch_norm(x, running_mean, running_var, weight, bias, True, case["momentum"], EPS)
        own = [(part * dy).sum() for part, dy in zip(y.split(rows), dys, strict=True)]
        shares = [torch.autograd.grad(loss, (weight, bias), retain_graph=True) for loss in own]
        sum(own).backward()
        ref["y"].append(list(y.detach().split(rows)))
        ref["grad_x"].append(list(x.grad.split(rows)))
        ref["grad_weight"].append([w for w, _ in shares])
        ref["grad_bias"].append([b for _, b in shares])
        ref["total"].append({"grad_weight": weight.grad, "grad_bias": bias.grad})
    ref["running_mean"], ref["running_var"] = running_mean, running_var
    return ref


def _param_grad(out: dict, ref: dict, name: str, step: int, rank: int, at: str) -> None:
    g, e = out[name][step], ref[name][step][rank]
    what = name.removeprefix("grad_")
    if g is None:
        raise CheckFailed(f"{at}: {what} got no gradient (backward returns None for it?)")
    if is_close(g, ref["total"][step][name], 1e-6) and not is_close(g, e, 1e-6):
        raise CheckFailed(
            f"{at}: {name} is the sum over ALL ranks; return this rank's own sum "
            "(DistributedDataParallel all-reduces parameter gradients itself, so reducing "
            "them here counts them twice)"
        )
    assert_close(g, e, f"{at}: {name} (this rank's own share)", **TOL)


def _rank(case: dict, ref: dict, got: list, rank: int) -> None:
    out = got[rank]
    where = f"rank {rank} ({sizes_text(case)})"
    if not isinstance(out, dict):
        raise CheckFailed(f"{where}: unexpected result {kind(out)}")
    for step in range(STEPS):
        at = f"{where}, step {step + 1}"
        assert_close(out["y"][step], ref["y"][step][rank], f"{at}: the output", **TOL)
        if out["grad_x"][step] is None:
            raise CheckFailed(
                f"{at}: x got no gradient; backward must return the input gradient first "
                "(and forward's output must depend on x through autograd's Function, not "
                "through a detached copy)"
            )
        try:
            assert_close(
                out["grad_x"][step], ref["grad_x"][step][rank], f"{at}: the input gradient", **TOL
            )
        except CheckFailed as err:
            grads = [o["grad_x"][step] if isinstance(o, dict) else None for o in got]
            raise CheckFailed(f"{err}{shift_hint(case['dys'][step], grads)}") from None
        for name in ("grad_weight", "grad_bias"):
            _param_grad(out, ref, name, step, rank, at)
    assert_close(
        out["running_mean"],
        ref["running_mean"],
        f"{where}: running_mean after {STEPS} steps",
        **TOL,
    )
    assert_close(
        out["running_var"],
        ref["running_var"],
        f"{where}: running_var after {STEPS} steps (it tracks the global batch's variance "
        f"times n / (n - 1), updated in place with momentum {case['momentum']})",
        **TOL,
    )


def judge(inputs: dict, outputs: dict) -> str:
    """Every rank's steps against ``F.batch_norm`` on the concatenated global batch."""
    for case, got in zip(inputs["cases"], outputs["cases"], strict=True):
        ref = batchnorm_oracle(case)
        for rank in range(len(got)):
            _rank(case, ref, got, rank)
    return (
        f"SyncBNFunction equals BatchNorm over the global batch on {worlds_text(inputs)} ranks "
        "(outputs, input/weight/bias gradients, running statistics)"
    )


EXERCISE = Exercise(
    "test_ex4_sync_bn_function",
    ("ex4_sync_bn_function",),
    "synchronised BatchNorm as an autograd Function equals BatchNorm on the global batch",
    make_inputs,
    judge,
    run_rank=run_rank,
    forbid_modules=RUNTIME,
    timeout=90,
    visible_inputs=visible_inputs,
    files=(FUNCTION_FILE,),
)
