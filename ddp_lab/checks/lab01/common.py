"""What lab 1's exercises share: the lab's name, tolerances per dtype, and the small models
the checks hand to the student's code.

None of this is an answer to an exercise: the models are inputs, and the oracles that read
them (autograd on the whole batch) are torch's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import skip_init

from ddp_lab.checks.failure import is_close
from ddp_lab.checks.values import randint

T = TypeVar("T")

LAB = "lab01_data_parallel"

#: dtype name -> torch dtype (inputs are saved with ``torch.save`` and loaded with
#: ``weights_only=True``: they name their dtype with a string).
DTYPES = {"float32": torch.float32, "float64": torch.float64}

#: ``(atol, rtol)`` of the comparisons with a float64 oracle. Wrong answers are off by 1e-3
#: or more; right ones by float32 rounding (float32 cases) or less.
TOLERANCE = {"float32": (2e-5, 1e-4), "float64": (1e-6, 1e-5)}


def make_mlp(dims: list[int], dtype: str = "float64", init: bool = True) -> nn.Sequential:
    """``Flatten -> Linear -> Tanh -> ... -> Linear`` with layer widths ``dims`` (``init``
    False: the weights are left uninitialised, for a model whose state is loaded next).

    Example:
        >>> [tuple(p.shape) for p in make_mlp([3, 4, 2]).parameters()]
        [(4, 3), (4,), (2, 4), (2,)]
    """
    layers: list[nn.Module] = [nn.Flatten()]
    for i, (d_in, d_out) in enumerate(zip(dims[:-1], dims[1:], strict=True)):
        if i:
            layers.append(nn.Tanh())
        if init:
            layers.append(nn.Linear(d_in, d_out, dtype=DTYPES[dtype]))
        else:
            layers.append(skip_init(nn.Linear, d_in, d_out, dtype=DTYPES[dtype]))
    return nn.Sequential(*layers)


def random_state(gen: torch.Generator, dims: list[int], dtype: str) -> dict[str, torch.Tensor]:
    """Random weights of :func:`make_mlp` (drawn in float64, stored in ``dtype``)."""
    out = {}
    for name, p in make_mlp(dims, init=False).state_dict().items():
        fan_in = p.shape[-1] if p.dim() > 1 else 4
        w = torch.randn(p.shape, generator=gen, dtype=torch.float64) / math.sqrt(fan_in)
        out[name] = w.to(DTYPES[dtype])
    return out


def model_of(case: dict, dtype: str | None = None) -> nn.Sequential:
    """The case's model with its drawn weights (in the case's dtype, or in ``dtype``)."""
    dtype = dtype or case["dtype"]
    model = make_mlp(case["dims"], dtype, init=False)
    model.load_state_dict({k: v.to(DTYPES[dtype]) for k, v in case["state"].items()})
    return model


def param_names(case: dict) -> list[str]:
    """The names of the case's parameters, in the order of ``model.parameters()``."""
    return list(case["state"])  # the state holds the parameters only, in that order


def draw_dims(gen: torch.Generator) -> list[int]:
    """Layer widths ``[inputs, hidden, classes]`` of a small MLP."""
    return [randint(gen, 3, 6), randint(gen, 4, 8), randint(gen, 2, 4)]


def full_batch(case: dict, x: torch.Tensor, y: torch.Tensor) -> tuple[float, list[torch.Tensor]]:
    """The oracle: autograd on the whole batch in float64, ``(mean loss, gradients)``.

    Example:
        >>> case = {"dims": [3, 2], "dtype": "float64",
        ...         "state": random_state(torch.Generator(), [3, 2], "float64")}
        >>> loss, grads = full_batch(case, torch.randn(4, 3), torch.tensor([0, 1, 1, 0]))
        >>> len(grads)
        2
    """
    model = model_of(case, "float64")
    loss = F.cross_entropy(model(x.double()), y)
    return float(loss.detach()), list(torch.autograd.grad(loss, list(model.parameters())))


_MEMO: dict[tuple[int, str], tuple[dict, object]] = {}


def memo(case: dict, key: str, compute: Callable[[], T]) -> T:
    """``compute()`` once per case object and ``key``: a test judges one draw many times
    (its right answers and every mistake). The entry holds the case, so its id is not
    reused while the entry lives; results are read, never modified."""
    hit = _MEMO.get((id(case), key))
    if hit is not None and hit[0] is case:
        return hit[1]  # type: ignore[return-value]
    if len(_MEMO) >= 256:
        _MEMO.clear()
    value = compute()
    _MEMO[(id(case), key)] = (case, value)
    return value


def close(got, expected: torch.Tensor, dtype: str) -> bool:
    """``got`` is a finite tensor of ``expected``'s shape within the dtype's tolerance."""
    atol, rtol = TOLERANCE[dtype]
    return is_close(got, expected, atol, rtol)
