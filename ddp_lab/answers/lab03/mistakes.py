"""Typical wrong answers of lab 3, and what the grader must say about each.

Each source replaces the whole solution cell. The first mistake of each exercise is the one
the sample class's ``mistake`` student submits. ``FORGED_FILES`` are the result files the
sample class's cheat leaves next to the notebook (a friend's solution files: the grader
rebuilds every file from the submitted notebook's cells, so they change nothing).
"""

from __future__ import annotations

import json
from pathlib import Path

from ddp_lab.answers import Mistake

LAB = "lab03_ddp"


def _edit(source: str, old: str, new: str) -> str:
    """``source`` with ``old`` replaced (which must be there: a mistake that changes nothing
    would pass)."""
    if old not in source:
        raise ValueError(f"{old!r} is not in the source to edit")
    return source.replace(old, new)


# --- exercise 2: a short, correct ddp_train.py that the mistakes edit -------------------------

DDP_TRAIN = """%%writefile ddp_train.py
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler


def setup():
    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), torch.device("cpu")


def teardown():
    dist.destroy_process_group()


def train(model, dataset, batch_size, lr, epochs, seed=0, out=None, log=print):
    ddp_model = DDP(model)
    sampler = DistributedSampler(dataset, shuffle=True, seed=seed, drop_last=True)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=lr)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = torch.nn.functional.cross_entropy(ddp_model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        if dist.get_rank() == 0:
            log(f"epoch {epoch}: loss {loss.item():.4f}")
    if dist.get_rank() == 0 and out is not None:
        torch.save(model.state_dict(), out)
"""

# --- exercise 4: a correct MyDDP that the mistakes edit ---------------------------------------

MY_DDP = """%%writefile my_ddp.py
import torch
import torch.distributed as dist
from torch import nn


class MyDDP(nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module = module
        world_size = dist.get_world_size()
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor, src=0)

        def average_gradient(param):
            dist.all_reduce(param.grad)
            param.grad /= world_size

        for param in module.parameters():
            param.register_post_accumulate_grad_hook(average_gradient)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)
"""

# --- exercise 5: the scaling rule and the warm-up, to combine with a wrong other half ------


def _lr_source(scaled: str, warmup: str | None = None) -> str:
    warmup = warmup or (
        "    if step >= warmup_steps:\n"
        "        return peak_lr\n"
        "    return base_lr + (peak_lr - base_lr) * step / warmup_steps\n"
    )
    return (
        "import math\n\n\n"
        "def scaled_lr(base_lr, base_batch, batch_size, world_size, accum_steps=1):\n"
        f"    return {scaled}\n\n\n"
        "def warmup_lr(step, base_lr, peak_lr, warmup_steps):\n" + warmup
    )


LINEAR = "base_lr * batch_size * world_size * accum_steps / base_batch"


def _shards(body: str) -> str:
    return "import torch\n\n\ndef shard_indices(n, rank, world_size, epoch, seed=0):\n" + body


MISTAKES = [
    # --- exercise 1: shard_indices ---------------------------------------------------------
    Mistake(
        "ex1_shard_indices",
        "no_epoch_in_the_seed",  # every epoch repeats the first one's shards (no set_epoch)
        _shards(
            "    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))\n"
            "    order = order[: n - n % world_size]\n"
            "    return order[rank::world_size].tolist()\n"
        ),
        "epoch 1 reads exactly what epoch 0 read",
    ),
    Mistake(
        "ex1_shard_indices",
        "global_rng",
        _shards(
            "    order = torch.randperm(n)[: n - n % world_size]\n"
            "    return order[rank::world_size].tolist()\n"
        ),
        "both read sample",
    ),
    Mistake(
        "ex1_shard_indices",
        "no_shuffle",
        _shards("    return list(range(rank, n - n % world_size, world_size))\n"),
        "not shuffled",
    ),
    Mistake(
        "ex1_shard_indices",
        "padded",
        _shards(
            "    g = torch.Generator().manual_seed(seed + epoch)\n"
            "    order = torch.randperm(n, generator=g).tolist()\n"
            "    order += order[: -n % world_size]\n"
            "    return order[rank::world_size]\n"
        ),
        "padded?",
    ),
    Mistake(
        "ex1_shard_indices",
        "seed_ignored",
        _shards(
            "    g = torch.Generator().manual_seed(epoch)\n"
            "    k = n // world_size\n"
            "    return torch.randperm(n, generator=g)[rank * k : (rank + 1) * k].tolist()\n"
        ),
        "another seed gave the same shards",
    ),
    Mistake(
        "ex1_shard_indices",
        "contiguous_blocks",  # every property holds, but not DistributedSampler's rule
        _shards(
            "    g = torch.Generator().manual_seed(seed + epoch)\n"
            "    k = n // world_size\n"
            "    return torch.randperm(n, generator=g)[rank * k : (rank + 1) * k].tolist()\n"
        ),
        "deal it out round-robin",
    ),
    # --- exercise 2: ddp_train.py ------------------------------------------------------------
    Mistake(
        "ex2_ddp_train",
        "no_distributed_sampler",  # every rank reads the same batches
        _edit(_edit(DDP_TRAIN, "sampler=sampler, ", ""), "        sampler.set_epoch(epoch)\n", ""),
        "every rank read the same samples",
    ),
    Mistake(
        "ex2_ddp_train",
        "no_ddp_wrapper",  # each rank trains alone on its shard
        _edit(DDP_TRAIN, "ddp_model = DDP(model)", "ddp_model = model"),
        "trained alone",
    ),
    Mistake(
        "ex2_ddp_train",
        "no_set_epoch",
        _edit(DDP_TRAIN, "        sampler.set_epoch(epoch)\n", ""),
        "set_epoch",
    ),
    # --- exercise 3: evaluate.py -------------------------------------------------------------
    Mistake(
        "ex3_evaluate",
        "distributed_sampler",  # padded shards count some samples twice
        """%%writefile evaluate.py
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
        "DistributedSampler pads",
    ),
    Mistake(
        "ex3_evaluate",
        "mean_of_accuracies",  # shards of unequal size weighed the same
        """%%writefile evaluate.py
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader


def evaluate(model, dataset, batch_size=64):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    shard = list(range(rank, len(dataset), world_size))
    correct = total = 0
    with torch.no_grad():
        for x, y in DataLoader(dataset, batch_size=batch_size, sampler=shard):
            correct += (model(x).argmax(1) == y).sum().item()
            total += y.numel()
    stats = torch.tensor([correct, total, correct / total], dtype=torch.float64)
    dist.all_reduce(stats)
    accuracy = stats[2].item() / world_size
    return {"correct": int(stats[0]), "total": int(stats[1]), "accuracy": accuracy}
""",
        "mean of the ranks' accuracies",
    ),
    # --- exercise 4: my_ddp.py ---------------------------------------------------------------
    Mistake(
        "ex4_my_ddp",
        "no_broadcast",  # replicas that start apart stay apart
        _edit(
            MY_DDP,
            "        with torch.no_grad():\n"
            "            for tensor in [*module.parameters(), *module.buffers()]:\n"
            "                dist.broadcast(tensor, src=0)\n",
            "",
        ),
        "broadcast every parameter",
    ),
    Mistake(
        "ex4_my_ddp",
        "sum_not_mean",
        _edit(MY_DDP, "            param.grad /= world_size\n", ""),
        "SUM",
    ),
    Mistake(
        "ex4_my_ddp",
        "torch_ddp_inside",
        """%%writefile my_ddp.py
from torch import nn
from torch.nn.parallel import DistributedDataParallel


class MyDDP(nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module = DistributedDataParallel(module)

    def forward(self, *a, **k):
        return self.module(*a, **k)
""",
        "must not use torch's DistributedDataParallel",
    ),
    # --- exercise 5: scaled_lr and warmup_lr -------------------------------------------------
    Mistake(
        "ex5_scaled_lr",
        "square_root_rule",
        _lr_source("base_lr * math.sqrt(batch_size * world_size * accum_steps / base_batch)"),
        "square-root rule",
    ),
    Mistake("ex5_scaled_lr", "constant", _lr_source("base_lr"), "must grow"),
    Mistake(
        "ex5_scaled_lr",
        "no_world_size",
        _lr_source("base_lr * batch_size * accum_steps / base_batch"),
        "times world_size",
    ),
    Mistake(
        "ex5_scaled_lr",
        "no_accum_steps",
        _lr_source("base_lr * batch_size * world_size / base_batch"),
        "times accum_steps",
    ),
    Mistake(
        "ex5_scaled_lr",
        "upside_down",
        _lr_source("base_lr * base_batch / (batch_size * world_size * accum_steps)"),
        "upside down",
    ),
    Mistake(
        "ex5_scaled_lr",
        "warmup_no_ramp",
        _lr_source(LINEAR, "    return peak_lr\n"),
        "starts at base_lr",
    ),
    Mistake(
        "ex5_scaled_lr",
        "warmup_from_zero",
        _lr_source(LINEAR, "    return peak_lr * min(1, step / max(1, warmup_steps))\n"),
        "starts at base_lr",
    ),
    Mistake(
        "ex5_scaled_lr",
        "warmup_never_stops",
        _lr_source(
            LINEAR,
            "    if warmup_steps == 0:\n"
            "        return peak_lr\n"
            "    return base_lr + (peak_lr - base_lr) * step / warmup_steps\n",
        ),
        "stays at peak_lr",
    ),
]


def _solution_files() -> dict[str, str]:
    """The files the solution notebook's %%writefile cells write: what a cheat would copy."""
    path = Path(__file__).resolve().parents[3] / "solutions" / LAB / f"{LAB}.ipynb"
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
