"""Lab 3's reference answers: what the solutions do, for the grader's exact checks and the
tests. Not in the student kit.

- ex1: :func:`shuffled_shards`, DistributedSampler's rule by hand;
- ex2: :func:`ddp_setup`, :func:`ddp_train`, :func:`ddp_teardown`, the DDP script's parts;
- ex3: :func:`evaluate` with :class:`ShardSampler`, exact distributed evaluation by a split
  without padding (the runtime's ``ddp_lab.data.evaluate`` is built differently);
- ex4: :class:`MyDDP`, a broadcast at construction and an averaging all-reduce per gradient;
- ex5: :func:`expected_scaled_lr` and :func:`expected_warmup_lr`, the exact formulas.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

# --- ex1 ------------------------------------------------------------------------------------


def shuffled_shards(n, world_size, epoch, seed) -> list[list[int]]:
    """What ``DistributedSampler(shuffle=True, seed=seed, drop_last=True)`` gives each rank.

    A permutation of ``range(n)`` from a generator seeded with ``seed + epoch``, cut to a
    multiple of ``world_size``, dealt out round-robin.

    Example:
        >>> [len(s) for s in shuffled_shards(7, 3, epoch=0, seed=0)]
        [2, 2, 2]
    """
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
    order = order[: n - n % world_size].tolist()
    return [order[r::world_size] for r in range(world_size)]


# --- ex2 ------------------------------------------------------------------------------------


def ddp_setup() -> tuple[int, int, torch.device]:
    """Join torchrun's process group: NCCL and ``cuda:LOCAL_RANK`` with GPUs, gloo and the
    CPU otherwise; ``(rank, world_size, device)``."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl")
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), device


def ddp_teardown() -> None:
    """Leave the process group."""
    dist.destroy_process_group()


def ddp_train(model, dataset, batch_size, lr, epochs, seed=0, out=None, log=print) -> None:
    """``single.py``'s training with DDP: DistributedSampler + set_epoch, full batches, rank 0
    alone logging (once per epoch) and saving the plain model."""
    rank = dist.get_rank()
    device = next(model.parameters()).device
    ddp_model = DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None
    )
    sampler = DistributedSampler(dataset, shuffle=True, seed=seed, drop_last=True)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=lr)
    loss = torch.zeros(())
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = nn.functional.cross_entropy(ddp_model(x.to(device)), y.to(device))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        if rank == 0:
            log(f"epoch {epoch}: loss {loss.item():.4f}")
    if rank == 0 and out is not None:
        torch.save(model.state_dict(), out)


# --- ex3 ------------------------------------------------------------------------------------


class ShardSampler(Sampler[int]):
    """Indices ``rank, rank + world_size, ...``: disjoint shards, no padding, no duplicates.

    Example:
        >>> list(ShardSampler(7, rank=1, world_size=3))
        [1, 4]
    """

    def __init__(self, size: int, rank: int, world_size: int):
        self.size, self.rank, self.world_size = size, rank, world_size

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.size, self.world_size))

    def __len__(self) -> int:
        return len(range(self.rank, self.size, self.world_size))


@torch.no_grad()
def evaluate(model: nn.Module, dataset: Dataset, batch_size: int = 64) -> dict:
    """Exact distributed evaluation: each rank scores its :class:`ShardSampler` shard, the
    counts are summed over the ranks; the same ``{"correct", "total", "accuracy"}`` on every
    rank."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = next(model.parameters()).device
    loader = DataLoader(
        dataset, batch_size=batch_size, sampler=ShardSampler(len(dataset), rank, world_size)
    )
    was_training = model.training
    model.eval()
    correct = total = 0
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        correct += (model(x).argmax(1) == y).sum().item()
        total += y.numel()
    model.train(was_training)
    counts = torch.tensor([correct, total], dtype=torch.int64, device=device)
    dist.all_reduce(counts)
    correct, total = int(counts[0]), int(counts[1])
    return {"correct": correct, "total": total, "accuracy": correct / total}


# --- ex4 ------------------------------------------------------------------------------------


class MyDDP(nn.Module):
    """A minimal DistributedDataParallel: rank 0's parameters and buffers broadcast at
    construction, each gradient all-reduced and divided by the world size by a hook."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        world_size = dist.get_world_size()
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor, src=0)

        def average(param: torch.Tensor) -> None:
            dist.all_reduce(param.grad)
            param.grad /= world_size

        for param in module.parameters():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(average)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


# --- ex5 ------------------------------------------------------------------------------------


def expected_scaled_lr(base_lr, base_batch, batch_size, world_size, accum_steps=1) -> float:
    """The linear scaling rule: the learning rate grows with the global batch.

    Example:
        >>> expected_scaled_lr(0.1, 256, 32, 16)
        0.2
    """
    return base_lr * batch_size * world_size * accum_steps / base_batch


def expected_warmup_lr(step, base_lr, peak_lr, warmup_steps) -> float:
    """Gradual warm-up: linear from ``base_lr`` (step 0) to ``peak_lr`` (step ``warmup_steps``).

    Example:
        >>> expected_warmup_lr(5, 0.1, 0.5, 10)
        0.3
    """
    if step >= warmup_steps:
        return peak_lr
    return base_lr + (peak_lr - base_lr) * step / warmup_steps
