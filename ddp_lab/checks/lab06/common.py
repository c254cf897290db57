"""What lab 6's exercises share: the lab's name, its files, and the small pieces the checks
train with (a model with dropout, a data set that augments with the global random number
generators, a deterministic DDP communication hook).

None of this is an answer to an exercise: these are the inputs the checks (and the
notebook's demonstrations) hand to the student's code, and helpers that only read results.
"""

from __future__ import annotations

import math
import random

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset

LAB = "lab06_fault_tolerance"

#: Files the notebook's distributed solution cells write (``%%writefile``).
RESUME_FILE, FIXED_FILE = "resume.py", "fixed_train.py"
#: The notebook's given (buggy) script of exercise 4.
HANG_FILE = "hang_train.py"


class Net(nn.Module):
    """Linear - tanh - dropout - linear: the dropout draws from the global torch generator,
    so a resumed run needs each rank's generator state back."""

    def __init__(self, d: int, h: int, c: int, p: float = 0.25):
        super().__init__()
        self.hidden = nn.Linear(d, h)
        self.drop = nn.Dropout(p)
        self.out = nn.Linear(h, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.drop(torch.tanh(self.hidden(x))))


def random_state(dims, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random float32 weights of a :class:`Net` of ``dims = (d, h, c)``."""
    d, h, c = (int(v) for v in dims)
    return {
        "hidden.weight": torch.randn(h, d, generator=gen) / math.sqrt(d),
        "hidden.bias": 0.1 * torch.randn(h, generator=gen),
        "out.weight": torch.randn(c, h, generator=gen) / math.sqrt(h),
        "out.bias": 0.1 * torch.randn(c, generator=gen),
    }


def net(state: dict, p: float) -> Net:
    """A :class:`Net` holding ``state`` (its dims come from the tensors), in training mode."""
    h, d = state["hidden.weight"].shape
    c = state["out.weight"].shape[0]
    model = Net(d, h, c, p)
    model.load_state_dict(state)
    return model.train()


def params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Detached copies of a model's parameters, by name (the ``module.`` of DDP dropped)."""
    return {
        name.removeprefix("module."): p.detach().clone() for name, p in model.named_parameters()
    }


class NoisyDataset(Dataset):
    """Samples ``(x[i] + noise * N(0, 1), y[i])``, ``x[i]`` negated with probability ``flip``.

    The noise comes from the global torch generator and the flip from Python's ``random``
    (as many augmentations do): what a rank reads depends on its generators' states.
    """

    def __init__(self, x: torch.Tensor, y: torch.Tensor, noise: float, flip: float):
        self.x, self.y, self.noise, self.flip = x, y, noise, flip

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        sample = self.x[i] + self.noise * torch.randn(self.x.shape[1])
        if random.random() < self.flip:
            sample = -sample
        return sample, int(self.y[i])


def ordered_mean_hook(world: int):
    """A DDP communication hook that averages gradients in a fixed order: all-gather every
    rank's bucket, add them up rank 0 first, divide by ``world``.

    DDP's own all-reduce may add the ranks in an order that depends on where a gradient
    sits in its bucket, and DDP re-arranges its buckets after the first step: a run resumed
    into a fresh DDP model can add in another order and differ in the last bit (the trainer
    settles its buckets before it resumes for this reason). With this hook the sum of every
    entry is ``((g0 + g1) + g2) / world`` whatever the bucket layout, so a resumed run can be
    bit-identical.
    """

    def hook(state, bucket):  # no annotations: DDP checks them
        buffer = bucket.buffer()
        parts = [torch.empty_like(buffer) for _ in range(world)]
        fut = dist.all_gather(parts, buffer, async_op=True).get_future()

        def combine(_):
            out = parts[0].clone()
            for p in parts[1:]:
                out += p
            return out.div_(world)

        return fut.then(combine)

    return hook
