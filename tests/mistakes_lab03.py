"""Typical mistakes of lab 3 (see tests/mistakes.py)."""

from __future__ import annotations

import json
from pathlib import Path

LAB = "lab03_ddp"

MISTAKES = {
    # no epoch in the seed: every epoch repeats the first one's shards (set_epoch forgotten)
    "ex1_shard_indices": """
import torch


def shard_indices(n, rank, world_size, epoch, seed=0):
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    order = order[: n - n % world_size]
    return order[rank::world_size].tolist()
""",
    # no DistributedSampler: every rank reads the same batches
    "ex2_ddp_train": """%%writefile ddp_train.py
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

from ddp_lab.data import SyntheticCIFAR
from ddp_lab.models import build_model


def setup():
    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), torch.device("cpu")


def teardown():
    dist.destroy_process_group()


def train(model, dataset, batch_size, lr, epochs, seed=0, out=None, log=print):
    ddp_model = DDP(model)
    loader = DataLoader(dataset, batch_size=batch_size, drop_last=True)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=lr)
    for epoch in range(epochs):
        for x, y in loader:
            loss = torch.nn.functional.cross_entropy(ddp_model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        if dist.get_rank() == 0:
            log(f"epoch {epoch}: loss {loss.item():.4f}")
    if dist.get_rank() == 0 and out is not None:
        torch.save(model.state_dict(), out)
""",
    # DistributedSampler for evaluation: padded shards count some samples twice
    "ex3_evaluate": """%%writefile evaluate.py
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler


def evaluate(model, dataset, batch_size=64):
    loader = DataLoader(dataset, batch_size=batch_size,
                        sampler=DistributedSampler(dataset, shuffle=False))
    correct = total = 0
    with torch.no_grad():
        for x, y in loader:
            correct += (model(x).argmax(1) == y).sum().item()
            total += y.numel()
    counts = torch.tensor([correct, total])
    dist.all_reduce(counts)
    return {"correct": int(counts[0]), "total": int(counts[1]),
            "accuracy": int(counts[0]) / int(counts[1])}
""",
    # no broadcast at construction: replicas that start apart stay apart
    "ex4_my_ddp": """%%writefile my_ddp.py
import torch.distributed as dist
from torch import nn


class MyDDP(nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module = module
        world_size = dist.get_world_size()

        def average_gradient(param):
            dist.all_reduce(param.grad)
            param.grad /= world_size

        for param in module.parameters():
            param.register_post_accumulate_grad_hook(average_gradient)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)
""",
    # the square-root rule instead of the linear one
    "ex5_scaled_lr": """
import math


def scaled_lr(base_lr, base_batch, batch_size, world_size, accum_steps=1):
    return base_lr * math.sqrt(batch_size * world_size * accum_steps / base_batch)


def warmup_lr(step, base_lr, peak_lr, warmup_steps):
    if step >= warmup_steps:
        return peak_lr
    return base_lr + (peak_lr - base_lr) * step / warmup_steps
""",
}


def _solution_files() -> dict[str, str]:
    """The files the solution notebook's %%writefile cells write: what a cheat would copy."""
    path = Path(__file__).resolve().parent.parent / "solutions" / LAB / f"{LAB}.ipynb"
    files: dict[str, str] = {}
    if not path.is_file():
        return files
    for cell in json.loads(path.read_text())["cells"]:
        src = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        first, _, body = src.partition("\n")
        if first.startswith("%%writefile ") and cell["metadata"].get("nbgrader", {}).get(
            "solution"
        ):
            files[first.split()[1]] = body
    return files


# A friend's solution files next to the notebook: the grader rebuilds every file from the
# submitted notebook's cells, so they change nothing.
FORGED_FILES = _solution_files()
