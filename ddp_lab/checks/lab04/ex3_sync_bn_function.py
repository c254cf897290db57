"""Exercise 3: ``SyncBNFunction`` in ``sync_bn.py``, the whole autograd Function.

Every rank of a torchrun job runs :data:`STEPS` training steps on its slices (batch sizes
differ between ranks, a rank may hold none) and records its outputs, input, weight and bias
gradients, and the running statistics after every step. The student's file builds on their
``sync_stats.py`` and ``sync_grad.py`` (exercises 1 and 2): the visible check uses the
student's own, the grader correct ones.

The judge's oracle is ``F.batch_norm`` (with running statistics) on the concatenated global
batch, step by step (float64), and autograd through it: the input gradient of the whole
global loss, and for the weight and bias each rank's *own* share (the gradient of its own
rows' loss), which is what the Function must return, since DDP adds parameter gradients up
itself.

Case set, in one job of 3 ranks (:func:`~ddp_lab.checks.lab04.common.per_run`), 3 steps
each, momentum 0.1 to 0.3:

- 3 ranks, float32 images, 2 to 4 channels, one rank without samples;
- 3 ranks, float64 ``(N, 1)``, unequal slices;
- 2 ranks (a group of ranks 0 and 1), float64 images, 2 to 4 channels;
- 2 ranks, float32 ``(N, C, L)``, one rank holding a single sample.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ddp_lab.checks.contract import Exercise
from ddp_lab.checks.failure import CheckFailed, assert_close, is_close
from ddp_lab.checks.lab04.common import (
    DTYPES,
    EPS,
    FUNCTION_FILE,
    RUNTIME,
    load_file,
    per_run,
    rank_batches,
    run_text,
    runs_of,
    shift_hint,
    sizes,
    worlds_text,
)
from ddp_lab.checks.values import kind, plain, randint, uniform

#: Training steps per run (the running statistics are updated that many times).
STEPS = 3
#: ``(atol, rtol)`` by dtype.
TOL = {"float32": (1e-4, 1e-4), "float64": (1e-9, 1e-8)}


def make_run(
    gen: torch.Generator,
    ranks: int,
    dtype: str,
    tail: tuple[int, ...],
    channels: int,
    empty: bool = False,
    single: bool = False,
) -> dict:
    """:data:`STEPS` steps on every rank: slices of the same sizes every step, new data."""
    batch_sizes = sizes(gen, ranks, 1, 5, empty=empty, single=single)
    cast = DTYPES[dtype]

    def rand(*shape):
        return torch.rand(*shape, generator=gen, dtype=torch.float64)

    return {
        "ranks": ranks,
        "sizes": batch_sizes,
        "channels": channels,
        "tail": list(tail),
        "dtype": dtype,
        "xs": [rank_batches(gen, batch_sizes, channels, tail, dtype) for _ in range(STEPS)],
        "dys": [
            [
                torch.randn(n, channels, *tail, generator=gen, dtype=torch.float64).to(cast)
                for n in batch_sizes
            ]
            for _ in range(STEPS)
        ],
        "weight": (0.5 + rand(channels)).to(cast),
        "bias": torch.randn(channels, generator=gen, dtype=torch.float64).to(cast),
        "running_mean": (0.2 * torch.randn(channels, generator=gen, dtype=torch.float64)).to(cast),
        "running_var": (1 + rand(channels)).to(cast),
        "momentum": round(uniform(gen, 0.1, 0.3), 3),
    }


def make_inputs(gen: torch.Generator) -> dict:
    """One job of 3 ranks: two runs over all 3, two over ranks 0 and 1 (see the module)."""
    image = (randint(gen, 1, 3), randint(gen, 2, 3))
    return {
        "cases": [
            {
                "world_size": 3,
                "runs": [
                    make_run(gen, 3, "float32", image, randint(gen, 2, 4), empty=True),
                    make_run(gen, 3, "float64", (), 1),
                    make_run(gen, 2, "float64", image, randint(gen, 2, 4)),
                    make_run(
                        gen, 2, "float32", (randint(gen, 2, 3),), randint(gen, 2, 4), single=True
                    ),
                ],
            }
        ]
    }


def visible_inputs(gen: torch.Generator) -> dict:
    """One job of 2 ranks: float64 images and float32 ``(N, 1)``, unequal slices."""
    return {
        "cases": [
            {
                "world_size": 2,
                "runs": [
                    make_run(gen, 2, "float64", (2, 2), 3),
                    make_run(gen, 2, "float32", (), 1),
                ],
            }
        ]
    }


def one_run(fn, run: dict, rank: int) -> dict:
    """:data:`STEPS` steps of the student's Function on this rank's slices."""
    weight = run["weight"].clone().requires_grad_(True)
    bias = run["bias"].clone().requires_grad_(True)
    running_mean, running_var = run["running_mean"].clone(), run["running_var"].clone()
    out: dict = {k: [] for k in ("y", "grad_x", "grad_weight", "grad_bias", "rm", "rv")}
    for xs, dys in zip(run["xs"], run["dys"], strict=True):
        x = xs[rank].clone().requires_grad_(True)
        y = fn.apply(x, weight, bias, running_mean, running_var, run["momentum"], EPS)
        out["y"].append(plain(y))
        if isinstance(y, torch.Tensor) and y.requires_grad and y.shape == dys[rank].shape:
            (y * dys[rank]).sum().backward()
        out["grad_x"].append(plain(x.grad))
        out["grad_weight"].append(plain(weight.grad))
        out["grad_bias"].append(plain(bias.grad))
        out["rm"].append(plain(running_mean))
        out["rv"].append(plain(running_var))
        weight.grad = bias.grad = None
    return out


def run_rank(ns: dict, inputs: dict, case: dict, rank: int, world: int) -> list:
    """:data:`STEPS` steps of the student's Function, once per run this rank takes part in."""
    fn = load_file(FUNCTION_FILE)["SyncBNFunction"]
    return per_run(case, rank, world, lambda run, r: one_run(fn, run, r))


def batchnorm_oracle(run: dict) -> dict:
    """``F.batch_norm`` on the concatenated global batch, step by step (float64), and
    autograd.

    Returns per step the output and the input gradient split by rank, every rank's *own*
    weight and bias gradients (of its own rows' loss), their totals (of the global loss),
    and the running statistics after the step.
    """
    running_mean = run["running_mean"].double().clone()
    running_var = run["running_var"].double().clone()
    rows = run["sizes"]
    ref: dict = {k: [] for k in ("y", "grad_x", "grad_weight", "grad_bias", "total", "rm", "rv")}
    for xs, dys in zip(run["xs"], run["dys"], strict=True):
        x = torch.cat(xs).double().requires_grad_(True)
        weight = run["weight"].double().requires_grad_(True)
        bias = run["bias"].double().requires_grad_(True)
        y = F.batch_norm(x, running_mean, running_var, weight, bias, True, run["momentum"], EPS)
        own = [(part * dy.double()).sum() for part, dy in zip(y.split(rows), dys, strict=True)]
        shares = [torch.autograd.grad(loss, (weight, bias), retain_graph=True) for loss in own]
        sum(own).backward()
        ref["y"].append(list(y.detach().split(rows)))
        ref["grad_x"].append(list(x.grad.split(rows)))
        ref["grad_weight"].append([w for w, _ in shares])
        ref["grad_bias"].append([b for _, b in shares])
        ref["total"].append({"grad_weight": weight.grad, "grad_bias": bias.grad})
        ref["rm"].append(running_mean.clone())
        ref["rv"].append(running_var.clone())
    return ref


def _param_grad(out: dict, ref: dict, name: str, step: int, rank: int, at: str, tol) -> None:
    g, e = out[name][step], ref[name][step][rank]
    what = name.removeprefix("grad_")
    if g is None:
        raise CheckFailed(f"{at}: {what} got no gradient (backward returns None for it?)")
    total = ref["total"][step][name]
    if not torch.equal(total, e) and is_close(g, total, *tol) and not is_close(g, e, *tol):
        raise CheckFailed(
            f"{at}: {name} is the sum over ALL ranks; return this rank's own sum "
            "(DistributedDataParallel all-reduces parameter gradients itself, so reducing "
            "them here counts them twice)"
        )
    assert_close(g, e, f"{at}: {name} (this rank's own share)", *tol)


def _step(run: dict, ref: dict, got: list, rank: int, step: int) -> None:
    out = got[rank]
    tol = TOL[run["dtype"]]
    at = f"rank {rank} ({run_text(run)}), step {step + 1}"
    assert_close(out["y"][step], ref["y"][step][rank], f"{at}: the output", *tol)
    if out["grad_x"][step] is None:
        raise CheckFailed(
            f"{at}: x got no gradient; backward must return the input gradient first "
            "(and forward's output must depend on x through autograd's Function, not "
            "through a detached copy)"
        )
    try:
        assert_close(
            out["grad_x"][step], ref["grad_x"][step][rank], f"{at}: the input gradient", *tol
        )
    except CheckFailed as err:
        grads = [o["grad_x"][step] if isinstance(o, dict) else None for o in got]
        raise CheckFailed(f"{err}{shift_hint(run['dys'][step], grads)}") from None
    for name in ("grad_weight", "grad_bias"):
        _param_grad(out, ref, name, step, rank, at, tol)
    assert_close(out["rm"][step], ref["rm"][step], f"{at}: running_mean (updated in place)", *tol)
    assert_close(
        out["rv"][step],
        ref["rv"][step],
        f"{at}: running_var (updated in place with momentum {run['momentum']}; it tracks the "
        "global batch's variance times n / (n - 1))",
        *tol,
    )


def check_run(run: dict, got: list) -> None:
    """Every rank's steps against ``F.batch_norm`` on the concatenated global batch."""
    ref = batchnorm_oracle(run)
    for rank, out in enumerate(got):
        if not isinstance(out, dict):
            raise CheckFailed(f"rank {rank} ({run_text(run)}): unexpected result {kind(out)}")
        for step in range(STEPS):
            _step(run, ref, got, rank, step)


def judge(inputs: dict, outputs: dict) -> str:
    """Every rank's steps against ``F.batch_norm`` on the concatenated global batch."""
    for run, got in runs_of(inputs, outputs):
        check_run(run, got)
    return (
        f"SyncBNFunction equals BatchNorm over the global batch on {worlds_text(inputs)} ranks "
        f"for {STEPS} steps (outputs, input/weight/bias gradients, running statistics; unequal "
        "and empty slices, float32 and float64)"
    )


EXERCISE = Exercise(
    "test_ex3_sync_bn_function",
    ("ex3_sync_bn_function",),
    "synchronised BatchNorm as an autograd Function equals BatchNorm on the global batch",
    make_inputs,
    judge,
    run_rank=run_rank,
    forbid_modules=RUNTIME,
    timeout=90,
    visible_inputs=visible_inputs,
    files=(FUNCTION_FILE,),
)
