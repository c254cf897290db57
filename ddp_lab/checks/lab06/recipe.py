"""The recipe of exercise 2 (``train_plain`` in the notebook), as the checker sets it up and
as its judge runs it without interruption: every rank in one process.

- :func:`make_optimizer`, :func:`dataset`: what the checker hands the student's ``train``
  (SGD with momentum or Adam, a ``LambdaLR`` schedule that keeps decreasing; the noisy data
  set);
- :class:`Simulation`: the recipe on ``world`` ranks in one process: each rank's generators
  (seeded ``seed + rank``), ``DistributedSampler`` shard, ``iter(loader)`` draw, batches,
  dropout masks and gradients, the gradients combined in
  :func:`~ddp_lab.checks.lab06.common.ordered_mean_hook`'s order, so that its weights equal
  a real DDP run's bit for bit. Its :meth:`Simulation.restart` hook lets the grader's
  diagnoses resume it at a checkpoint the way a flawed ``train`` would.
"""

from __future__ import annotations

import functools
import random
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

from ddp_lab.checks.lab06.common import NoisyDataset, net, params

#: Epochs of every run.
EPOCHS = 3


def _lr_factor(kind: str, rate: float, step: int) -> float:
    if kind == "sgd":
        return 1.0 / (1.0 + rate * step)
    return max(0.1, 1.0 - rate * step)


def make_optimizer(parameters, spec: dict, wrap=None):
    """The case's optimizer and its ``LambdaLR`` schedule (strictly decreasing at first).

    ``wrap(optimizer)`` runs before the schedule is made (the checker wraps ``step`` there,
    so that the schedule's own wrapper goes around it, as it expects)."""
    o = spec["optimizer"]
    if o["name"] == "sgd":
        opt = torch.optim.SGD(parameters, lr=o["lr"], momentum=o["momentum"])
    else:
        opt = torch.optim.Adam(parameters, lr=o["lr"])
    if wrap is not None:
        wrap(opt)
    factor = functools.partial(_lr_factor, o["name"], spec["decay"])
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def dataset(spec: dict) -> NoisyDataset:
    return NoisyDataset(spec["x"], spec["y"], spec["noise"], spec["flip"])


@contextmanager
def as_rank(rngs: list, r: int):
    """Run the block with rank ``r``'s generators (torch's and Python's), then keep them."""
    torch.set_rng_state(rngs[r][0])
    random.setstate(rngs[r][1])
    try:
        yield
    finally:
        rngs[r] = [torch.get_rng_state(), random.getstate()]


def seeded(spec: dict, world: int) -> list:
    """Every rank's generators as the recipe seeds them (``seed + rank``)."""
    out = []
    for r in range(world):
        torch.manual_seed(spec["seed"] + r)
        random.seed(spec["seed"] + r)
        out.append([torch.get_rng_state(), random.getstate()])
    return out


class Simulation:
    """The recipe on ``world`` ranks, in one process: each rank's generators, data order and
    gradients, the gradients combined as :func:`ordered_mean_hook` does.

    ``restart(position)`` (used by the grader's diagnoses) lets a subclass replace the run's
    objects and generators at a checkpoint, as a resumed run would.
    """

    def __init__(self, spec: dict, world: int):
        self.spec, self.world = spec, world
        self.model = net(spec["init"], spec["dropout"])
        self.optimizer, self.scheduler = make_optimizer(self.model.parameters(), spec)
        data = dataset(spec)
        self.samplers = [
            DistributedSampler(data, num_replicas=world, rank=r, shuffle=True, seed=spec["seed"])
            for r in range(world)
        ]
        self.loaders = [
            DataLoader(data, batch_size=spec["batch_size"], sampler=s) for s in self.samplers
        ]
        self.rngs = seeded(spec, world)

    def batches(self, epoch: int) -> list:
        """Every rank's iterator over the epoch (each creation draws from its generator)."""
        out = []
        for r in range(self.world):
            with as_rank(self.rngs, r):
                self.samplers[r].set_epoch(epoch)
                out.append(iter(self.loaders[r]))
        return out

    def step(self, its: list) -> None:
        grads = []
        for r in range(self.world):
            with as_rank(self.rngs, r):
                x, y = next(its[r])
                self.optimizer.zero_grad()
                F.cross_entropy(self.model(x), y).backward()
            grads.append([p.grad.clone() for p in self.model.parameters()])
        for i, p in enumerate(self.model.parameters()):
            total = grads[0][i].clone()
            for g in grads[1:]:
                total += g[i]
            p.grad = total.div_(self.world)
        self.optimizer.step()
        self.scheduler.step()

    def restart(self, epoch: int, done: int) -> list | None:
        """Hook of a resumed run, called right after the checkpoint at ``done`` batches of
        ``epoch`` (``done`` may be the whole epoch): return that epoch's iterators to go on
        with, or None to go on unchanged (the uninterrupted run)."""
        return None

    def run(self, restarts=()) -> dict:
        """The whole run; ``restarts``: global steps after which :meth:`restart` is called.

        Returns:
            The final weights.
        """
        saved = torch.get_rng_state(), random.getstate()
        spe = self.spec["steps_per_epoch"]
        try:
            step = 0
            for epoch in range(EPOCHS):
                its = self.batches(epoch)
                for k in range(spe):
                    self.step(its)
                    step += 1
                    if step in restarts:
                        its = self.restart(epoch, k + 1) or its
        finally:
            torch.set_rng_state(saved[0])
            random.setstate(saved[1])
        return params(self.model)


def checkpoint_steps(spec: dict, stops: list[int]) -> list[int]:
    """The checkpoints the runs of one scenario resume from (0: none, a fresh start)."""
    return [s - s % spec["every"] for s in stops]


def oracle(spec: dict) -> dict:
    """The uninterrupted run's final weights (the recipe on every rank, in one process)."""
    return Simulation(spec, spec["world_size"]).run()
