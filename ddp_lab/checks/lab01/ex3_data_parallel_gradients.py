"""Exercise 3, ``data_parallel_gradients(model, shards, loss_fn)``: replicas on unequal
shards, combined so that they equal the full-batch gradient, the model left untouched.

The oracle is autograd on the full batch: the gradient of the mean cross-entropy over all
the shards' samples together (:func:`full_batch_gradients`). The shard sizes are never all
equal, so a plain average of the shard gradients is wrong on every draw. Then the model
the student was given must hold no gradient and the same parameters as before.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ddp_lab.checks.contract import Exercise
from ddp_lab.checks.failure import CheckFailed, all_close, assert_close, require
from ddp_lab.checks.lab01.common import ATOL, RTOL
from ddp_lab.checks.values import kind, plain, randint


def make_mlp(dims: list[int]) -> nn.Sequential:
    """A float64 MLP ``Linear -> Tanh -> ... -> Linear`` with layer widths ``dims``.

    Example:
        >>> [tuple(p.shape) for p in make_mlp([3, 4, 2]).parameters()]
        [(4, 3), (4,), (2, 4), (2,)]
    """
    layers: list[nn.Module] = []
    for i, (d_in, d_out) in enumerate(zip(dims[:-1], dims[1:], strict=True)):
        if i:
            layers.append(nn.Tanh())
        layers.append(nn.Linear(d_in, d_out))
    return nn.Sequential(*layers).double()


def model_of(inputs: dict) -> nn.Sequential:
    """The exercise's model, with the drawn weights."""
    model = make_mlp(inputs["dims"])
    model.load_state_dict(inputs["state"])
    return model


def full_batch_gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """Autograd's gradients of the mean cross-entropy of ``model`` on the whole ``(x, y)``;
    ``model`` itself is left unchanged.

    Example:
        >>> m = make_mlp([3, 2])
        >>> x, y = torch.randn(4, 3, dtype=torch.float64), torch.tensor([0, 1, 0, 1])
        >>> len(full_batch_gradients(m, x, y)), m[0].weight.grad is None
        (2, True)
    """
    return list(torch.autograd.grad(F.cross_entropy(model(x), y), list(model.parameters())))


def _case(gen: torch.Generator, dims: list[int], sizes: list[int]) -> dict:
    model = make_mlp(dims)
    state = {
        k: 0.7 * torch.randn(v.shape, generator=gen, dtype=torch.float64)
        for k, v in model.state_dict().items()
    }
    return {
        "dims": dims,
        "state": state,
        "xs": [torch.randn(s, dims[0], generator=gen, dtype=torch.float64) for s in sizes],
        "ys": [torch.randint(0, dims[-1], (s,), generator=gen) for s in sizes],
    }


def make_inputs(gen: torch.Generator) -> dict:
    """An MLP of random widths, 2 to 5 shards of 1 to 22 samples, never all the same size."""
    dims = [randint(gen, 3, 8), randint(gen, 4, 10), randint(gen, 2, 5)]
    n = randint(gen, 2, 5)
    while True:  # never all equal: the plain average of the shard gradients would be right
        sizes = [randint(gen, 1, 12) for _ in range(n)]
        sizes[randint(gen, 0, n - 1)] += randint(gen, 4, 10)
        if len(set(sizes)) > 1:
            return _case(gen, dims, sizes)


def visible_inputs(gen: torch.Generator) -> dict:
    """An MLP 4-5-3, shards of 5, 2 and 1 samples."""
    return _case(gen, [4, 5, 3], [5, 2, 1])


def run(ns: dict, inputs: dict, workdir: Path | None) -> dict:
    """Call the student's function; record what it left in the model."""
    model = model_of(inputs)
    shards = [(x.clone(), y.clone()) for x, y in zip(inputs["xs"], inputs["ys"], strict=True)]
    got = ns["data_parallel_gradients"](model, shards, F.cross_entropy)
    if not isinstance(got, (list, tuple)) and hasattr(got, "__iter__"):
        got = list(got)
    return {
        "grads": plain(got),
        "grad_left": [p.grad is not None and bool(p.grad.ne(0).any()) for p in model.parameters()],
        "state_after": {k: v.detach().clone() for k, v in model.state_dict().items()},
    }


def describe(inputs: dict) -> str:
    """How the feedback names a case: ``data_parallel_gradients on shards of sizes [5, 2]``."""
    return f"data_parallel_gradients on shards of sizes {[int(x.shape[0]) for x in inputs['xs']]}"


def judge(inputs: dict, outputs: dict) -> str:
    """Compare with autograd on the full batch; then check the model was left untouched."""
    model = model_of(inputs)
    names = [name for name, _ in model.named_parameters()]
    expected = full_batch_gradients(model, torch.cat(inputs["xs"]), torch.cat(inputs["ys"]))
    what = describe(inputs)
    got = outputs["grads"]
    if not isinstance(got, list):
        raise CheckFailed(
            f"{what}: expected a list of {len(expected)} gradient tensors (one per parameter, "
            f"in the order of model.parameters()), got {kind(got)}"
        )
    require(
        len(got) == len(expected),
        f"{what}: expected one gradient per parameter ({len(expected)}: {', '.join(names)}), "
        f"got {len(got)}",
    )
    if not all_close(got, expected, ATOL, RTOL):
        for i, (g, e) in enumerate(zip(got, expected, strict=True)):
            assert_close(
                g,
                e,
                f"{what}: the gradient of {names[i]} (expected the full-batch gradient of the "
                "mean loss)",
                atol=ATOL,
                rtol=RTOL,
            )
    left = [names[i] for i, flag in enumerate(outputs["grad_left"]) if flag]
    require(
        not left,
        f"{what}: the values are right, but the model you were given now holds gradients "
        f"(the .grad of {', '.join(left)}). Compute each shard's gradient on a replica "
        "(copy.deepcopy(model)) and leave the model as it was",
    )
    after = outputs["state_after"]
    require(
        isinstance(after, dict)
        and set(after) == set(inputs["state"])
        and all(torch.equal(after[k], v) for k, v in inputs["state"].items()),
        f"{what}: the model's parameters changed during your call; replicas may compute, the "
        "model you were given must stay as it was",
    )
    sizes = [int(x.shape[0]) for x in inputs["xs"]]
    return f"equals the full-batch gradient for shards of sizes {sizes}; model untouched"


EXERCISE = Exercise(
    "test_ex3_data_parallel_gradients",
    ("ex3_data_parallel_gradients",),
    "replicas on unequal shards equal the full batch",
    make_inputs,
    judge,
    run=run,
    visible_inputs=visible_inputs,
)
