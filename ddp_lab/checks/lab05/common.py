"""What lab 5's exercises share: the lab's name, its files, small models and their weights.

None of this is an answer to an exercise: the models are the inputs the checks train, and
:func:`state` / :func:`ddp_lab.checks.values.max_diff` only read them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

LAB = "lab05_amp_accumulation"

#: Files the notebook's distributed solution cells write (``%%writefile``).
ACCUM_FILE, DDP_STEP_FILE, NORM_FILE = "accum.py", "ddp_step.py", "grad_norm.py"


class Net(nn.Module):
    """Linear - tanh - linear; with ``unused``, also a parameter the forward never uses (its
    ``.grad`` stays ``None``, like a frozen or skipped layer's)."""

    def __init__(self, d: int, h: int, c: int, unused: bool = True):
        super().__init__()
        self.hidden = nn.Linear(d, h)
        self.out = nn.Linear(h, c)
        if unused:
            self.unused = nn.Parameter(torch.zeros(c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(x)))


def random_state(
    dims: Sequence[int], gen: torch.Generator, dtype=torch.float32, unused: bool = True
) -> dict:
    """Random weights of a :class:`Net` of ``dims = (d, h, c)`` (with its unused parameter,
    or without it: DDP refuses parameters that receive no gradient)."""
    d, h, c = (int(v) for v in dims)
    out = {
        "hidden.weight": (torch.randn(h, d, generator=gen, dtype=torch.float64) / math.sqrt(d)).to(
            dtype
        ),
        "hidden.bias": (0.1 * torch.randn(h, generator=gen, dtype=torch.float64)).to(dtype),
        "out.weight": (torch.randn(c, h, generator=gen, dtype=torch.float64) / math.sqrt(h)).to(
            dtype
        ),
        "out.bias": (0.1 * torch.randn(c, generator=gen, dtype=torch.float64)).to(dtype),
    }
    if unused:
        out["unused"] = torch.zeros(c, dtype=dtype)
    return out


def net(state: dict) -> Net:
    """A :class:`Net` holding ``state`` (its dims and dtype come from the tensors).

    Example:
        >>> s = random_state((3, 4, 2), torch.Generator().manual_seed(0), torch.float64)
        >>> net(s).out.weight.dtype
        torch.float64
    """
    h, d = state["hidden.weight"].shape
    c = state["out.weight"].shape[0]
    model = Net(d, h, c, unused="unused" in state).to(state["out.weight"].dtype)
    model.load_state_dict(state)
    return model


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Detached copies of a model's parameters, by name (the ``module.`` of DDP dropped)."""
    return {
        name.removeprefix("module."): p.detach().clone() for name, p in model.named_parameters()
    }
