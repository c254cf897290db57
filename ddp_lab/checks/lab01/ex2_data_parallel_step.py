"""Exercise 2, ``data_parallel_step(model, shards, loss_fn, lr)``: one SGD step computed by one
replica per shard, equal to the step on the whole batch.

The oracle is autograd on the whole batch (all the shards' samples together, float64): its
mean loss, its gradient, and the SGD step ``p - lr * grad`` from the same weights. The
student's step must return that loss (a Python float, as the docstring promises), leave
that gradient in the model's ``.grad`` (as DDP does) and move the model's weights by that
step. The checker also counts the samples of every forward pass the model (or a copy of it)
runs: no forward may see more samples than the largest shard (one replica per shard, not
one pass over the concatenated batch).

The model arrives holding the previous step's gradient in ``.grad`` (a step must use this
step's gradient only). The fixed case set, random values inside: one shard (its weight is
1), two unequal shards, three unequal shards (float32), four to six shards with one of a
single sample, and shards where some replicas get no data (empty shards: a mean loss over
no sample is 0/0) after unequal ones (float32). Shard sizes are never all equal, so a plain
average of the shard gradients is wrong in every run.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

from ddp_lab.checks.contract import Exercise
from ddp_lab.checks.failure import CheckFailed, assert_close, require
from ddp_lab.checks.lab01.common import (
    DTYPES,
    TOLERANCE,
    close,
    draw_dims,
    full_batch,
    memo,
    model_of,
    param_names,
    random_state,
)
from ddp_lab.checks.values import kind, number, plain, randint, uniform


def _unequal(gen: torch.Generator, n: int, low: int, high: int) -> list[int]:
    while True:
        sizes = [randint(gen, low, high) for _ in range(n)]
        if len(set(sizes)) > 1:
            return sizes


def _case(gen: torch.Generator, sizes: list[int], dtype: str, what: str) -> dict:
    dims = draw_dims(gen)
    state = random_state(gen, dims, dtype)
    return {
        "what": what,
        "dims": dims,
        "dtype": dtype,
        "state": state,
        "stale": {k: torch.randn(v.shape, generator=gen).to(v.dtype) for k, v in state.items()},
        "lr": uniform(gen, 0.1, 0.5),
        "xs": [torch.randn(s, dims[0], generator=gen).to(DTYPES[dtype]) for s in sizes],
        "ys": [torch.randint(0, dims[-1], (s,), generator=gen) for s in sizes],
    }


def make_inputs(gen: torch.Generator) -> dict:
    """Five cases: one shard, two, three (float32), four to six with a single-sample one,
    and empty shards after unequal ones (float32)."""
    many = _unequal(gen, randint(gen, 4, 6), 2, 9)
    many[randint(gen, 0, len(many) - 1)] = 1
    some = _unequal(gen, randint(gen, 2, 3), 1, 7)
    empty = some + [0] * randint(gen, 1, 2)
    return {
        "cases": [
            _case(gen, [randint(gen, 3, 8)], "float64", "one shard"),
            _case(gen, _unequal(gen, 2, 1, 9), "float64", "two unequal shards"),
            _case(gen, _unequal(gen, 3, 1, 9), "float32", "three unequal shards"),
            _case(gen, many, "float64", "many shards, one of a single sample"),
            _case(gen, empty, "float32", "replicas without data (empty shards)"),
        ]
    }


def visible_inputs(gen: torch.Generator) -> dict:
    """Shards of 5, 2 and 1 samples (float64), and of 3, 1, 0 (float32)."""
    return {
        "cases": [
            _case(gen, [5, 2, 1], "float64", "three unequal shards"),
            _case(gen, [3, 1, 0], "float32", "a replica without data"),
        ]
    }


def run(ns: dict, inputs: dict, workdir: Path | None) -> dict:
    """Call the student's step on each case's model (holding stale gradients); record the
    loss, what the model holds afterwards, and the batch size of every forward pass."""
    fn = ns["data_parallel_step"]
    out = []
    for case in inputs["cases"]:
        model = model_of(case)
        for name, p in model.named_parameters():
            p.grad = case["stale"][name].clone()
        seen: list[int] = []

        def count(module, args, seen=seen):
            first = args[0] if args else None
            seen.append(int(first.shape[0]) if isinstance(first, torch.Tensor) else -1)

        model.register_forward_pre_hook(count)  # copy.deepcopy(model) copies the hook too
        shards = [(x.clone(), y.clone()) for x, y in zip(case["xs"], case["ys"], strict=True)]
        loss = fn(model, shards, F.cross_entropy, case["lr"])
        out.append(
            {
                "loss": plain(loss),
                "grads": [plain(p.grad) for p in model.parameters()],
                "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
                "forwards": seen,
            }
        )
    return {"cases": out}


def sizes_of(case: dict) -> list[int]:
    """The case's shard sizes."""
    return [int(x.shape[0]) for x in case["xs"]]


def describe(case: dict) -> str:
    """``data_parallel_step on shards of [5, 2, 1] (float64)``."""
    return f"data_parallel_step on shards of {sizes_of(case)} ({case['dtype']})"


def oracle(case: dict) -> tuple[float, list[torch.Tensor], dict[str, torch.Tensor]]:
    """Autograd on the whole batch: ``(loss, gradients, weights after the SGD step)``."""
    return memo(case, "ex2", lambda: _oracle(case))


def _oracle(case: dict) -> tuple[float, list[torch.Tensor], dict[str, torch.Tensor]]:
    loss, grads = full_batch(case, torch.cat(case["xs"]), torch.cat(case["ys"]))
    names = param_names(case)
    after = {
        n: case["state"][n].double() - case["lr"] * g for n, g in zip(names, grads, strict=True)
    }
    return loss, grads, after


def _no_data(empty: list[int]) -> str:
    return (
        f"Shard(s) {empty} are empty (replicas with no data): the mean loss over no sample is "
        "0/0 = NaN, and NaN times a weight of 0 is still NaN. Leave a shard with no samples "
        "out: its weight is 0"
    )


def _check_case(case: dict, got: dict) -> None:
    what, sizes, dtype = describe(case), sizes_of(case), case["dtype"]
    names = param_names(case)
    loss, grads, after = oracle(case)
    empty = [k for k, s in enumerate(sizes) if s == 0]
    if empty and math.isnan(number(got.get("loss"))):
        raise CheckFailed(f"{what}: you returned the loss nan. {_no_data(empty)}")
    got_grads = got.get("grads")
    require(
        isinstance(got_grads, list) and len(got_grads) == len(names),
        f"{what}: expected a gradient in the .grad of each of the model's {len(names)} parameters",
    )
    for name, g in zip(names, got_grads, strict=True):
        if not isinstance(g, torch.Tensor):
            raise CheckFailed(
                f"{what}: the model's {name}.grad is {kind(g)}; leave the combined gradient "
                "in each parameter's .grad (as DDP does)"
            )
        if empty and not bool(torch.isfinite(g).all()):
            raise CheckFailed(f"{what}: the model's {name}.grad holds NaN. {_no_data(empty)}")
    if not all(close(g, e, dtype) for g, e in zip(got_grads, grads, strict=True)):
        for name, g, e in zip(names, got_grads, grads, strict=True):
            atol, rtol = TOLERANCE[dtype]
            assert_close(
                g,
                e,
                f"{what}: the model's {name}.grad (expected the gradient of the mean loss "
                "over all the shards' samples together)",
                atol=atol,
                rtol=rtol,
            )
    state = got.get("state")
    require(
        isinstance(state, dict) and set(state) == set(after),
        f"{what}: the model's parameters are missing after your step",
    )
    for name in names:
        if not close(state[name], after[name], dtype):
            atol, rtol = TOLERANCE[dtype]
            assert_close(
                state[name],
                after[name],
                f"{what}: {name} after your step (expected p - lr * grad, with the "
                f"combined gradient and lr = {case['lr']:.3g}, from the weights the model "
                "had before)",
                atol=atol,
                rtol=rtol,
            )
    value = number(got.get("loss"))
    atol, rtol = TOLERANCE[dtype]
    require(
        math.isfinite(value) and abs(value - loss) <= atol + rtol * abs(loss),
        f"{what}: you returned the loss {value:.6g}; the mean loss over all "
        f"{sum(sizes)} samples is {loss:.6g} (each replica's mean loss covers its own shard "
        "only: combine them like the gradients)",
    )
    require(
        isinstance(got.get("loss"), float),
        f"{what}: you returned the loss as {kind(got.get('loss'))}; the docstring promises a "
        "float (loss.item(), not a tensor that keeps the replicas' graphs alive)",
    )
    forwards = [s for s in got.get("forwards", []) if isinstance(s, int)]
    if len([s for s in sizes if s]) > 1 and forwards:
        require(
            max(forwards) <= max(sizes),
            f"{what}: one forward pass saw {max(forwards)} samples, more than the largest "
            f"shard ({max(sizes)}): run one replica per shard, each on its own shard only, "
            "not one pass over the concatenated batch",
        )


def judge(inputs: dict, outputs: dict) -> str:
    """Every case against autograd on the whole batch, in the case set's order."""
    cases, got = inputs["cases"], outputs.get("cases")
    require(isinstance(got, list) and len(got) == len(cases), "expected one result per case")
    for case, result in zip(cases, got, strict=True):
        require(isinstance(result, dict), f"{describe(case)}: no result")
        _check_case(case, result)
    shown = "; ".join(str(sizes_of(c)) for c in cases)
    return (
        f"one replica per shard gives the whole batch's loss, gradient and SGD step, for "
        f"shards of {shown} (float32 and float64)"
    )


EXERCISE = Exercise(
    "test_ex2_data_parallel_step",
    ("ex2_data_parallel_step",),
    "a data-parallel SGD step equals the whole batch's",
    make_inputs,
    judge,
    run=run,
    visible_inputs=visible_inputs,
)
