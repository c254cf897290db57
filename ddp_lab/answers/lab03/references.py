"""Lab 3's reference answers: what the solutions do, for the grader's exact checks and the
tests. Not in the student kit.

- ex1: :class:`MySampler`, DistributedSampler's rule by hand (and :func:`shuffled_shards`);
- ex2: :func:`ddp_setup`, :func:`ddp_train`, :func:`ddp_teardown`, the DDP script's parts;
- ex3: :func:`evaluate` with :class:`ShardSampler`, exact distributed evaluation by a split
  without padding (the runtime's ``ddp_lab.data.evaluate`` is built differently);
- ex4: :class:`MyDDP`, a broadcast at construction and an asynchronous all-reduce per
  gradient, started by a hook, waited for and divided in ``finish()``;
- ex5: :class:`BucketedDDP`, the same with buckets (:func:`bucket_params`);
- ex6: :func:`expected_warmup_steps`, the shortest warm-up that keeps every step's rise
  within ``base_lr`` (and :func:`expected_lr_at`, the trainer's scaled, warmed-up rate).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

# --- ex1 ------------------------------------------------------------------------------------


class MySampler(Sampler[int]):
    """``DistributedSampler(range(n), world_size, rank, shuffle, seed, drop_last)`` by hand.

    Example:
        >>> s = MySampler(7, rank=1, world_size=3, seed=0, drop_last=True)
        >>> len(s), len(list(s))
        (2, 2)
    """

    def __init__(self, n, rank, world_size, shuffle=True, seed=0, drop_last=False):
        self.n, self.rank, self.world_size = n, rank, world_size
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0
        if drop_last:
            self.per_rank = n // world_size
        else:
            self.per_rank = math.ceil(n / world_size)

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.n, generator=g).tolist()
        else:
            order = list(range(self.n))
        total = self.per_rank * self.world_size
        while len(order) < total:  # pad with the start of the order, again if needed
            order += order[: total - len(order)]
        return iter(order[:total][self.rank :: self.world_size])

    def __len__(self):
        return self.per_rank


def shuffled_shards(n, world_size, epoch, seed) -> list[list[int]]:
    """What ``DistributedSampler(shuffle=True, seed=seed, drop_last=True)`` gives each rank.

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
    construction; a hook per trainable parameter starts an asynchronous all-reduce of its
    gradient as soon as it is ready; ``finish()`` waits for them and divides."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        self.pending: list = []
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor, src=0)
        for param in module.parameters():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(self._start)

    def _start(self, param: torch.Tensor) -> None:
        self.pending.append((dist.all_reduce(param.grad, async_op=True), param))

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish(self) -> None:
        """Wait for every all-reduce of this backward pass; then average."""
        for work, param in self.pending:
            work.wait()
            param.grad /= self.world_size
        self.pending.clear()


# --- ex5 ------------------------------------------------------------------------------------


def bucket_params(params: list, cap_bytes: float) -> list[list]:
    """Buckets of ``params`` (trainable, registration order) walked in reverse, each closed
    as soon as it holds at least ``cap_bytes``.

    Example:
        >>> ps = [torch.zeros(100), torch.zeros(10), torch.zeros(50)]
        >>> [[p.numel() for p in b] for b in bucket_params(ps, 300)]
        [[50, 10, 100]]
    """
    buckets, bucket, size = [], [], 0
    for param in reversed(list(params)):
        bucket.append(param)
        size += param.numel() * param.element_size()
        if size >= cap_bytes:
            buckets.append(bucket)
            bucket, size = [], 0
    if bucket:
        buckets.append(bucket)
    return buckets


class BucketedDDP(nn.Module):
    """:class:`MyDDP` with buckets: one asynchronous all-reduce per bucket of about
    ``bucket_cap_mb`` MiB, started when the bucket's last gradient is ready."""

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25.0):
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor, src=0)
        trainable = [p for p in module.parameters() if p.requires_grad]
        self.buckets = bucket_params(trainable, bucket_cap_mb * 2**20)
        self.bucket_of = {}
        for i, bucket in enumerate(self.buckets):
            for param in bucket:
                self.bucket_of[param] = i
                param.register_post_accumulate_grad_hook(self._ready)
        self.missing = [len(b) for b in self.buckets]
        self.pending: list = []

    def _ready(self, param: torch.Tensor) -> None:
        i = self.bucket_of[param]
        self.missing[i] -= 1
        if self.missing[i] == 0:
            flat = torch.cat([p.grad.reshape(-1) for p in self.buckets[i]])
            self.pending.append((dist.all_reduce(flat, async_op=True), flat, i))

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish(self) -> None:
        """Wait for every bucket's all-reduce; copy the averages back into the gradients."""
        for work, flat, i in self.pending:
            work.wait()
            flat /= self.world_size
            offset = 0
            for param in self.buckets[i]:
                n = param.numel()
                param.grad.copy_(flat[offset : offset + n].view_as(param))
                offset += n
            self.missing[i] = len(self.buckets[i])
        self.pending.clear()


# --- ex6 ------------------------------------------------------------------------------------


def expected_lr_at(
    step, base_lr, base_batch, batch_size, world_size, accum_steps=1, warmup_steps=0
) -> float:
    """The linear scaling rule, warmed up like the trainer's ``--warmup-steps``: optimizer
    step ``step`` (1, 2, ...) uses ``min(1, step / warmup_steps)`` of the scaled rate.

    Example:
        >>> expected_lr_at(5, 0.1, 256, 32, 16, warmup_steps=10)
        0.1
    """
    peak = base_lr * batch_size * world_size * accum_steps / base_batch
    if step >= warmup_steps:
        return peak
    return peak * step / warmup_steps


def expected_warmup_steps(base_batch, batch_size, world_size, accum_steps=1, warmup_samples=0):
    """The shortest warm-up of the trainer's linear ramp whose steps never raise the rate by
    more than ``base_lr`` (the rate of a global batch ``k`` times ``base_batch`` rises by
    ``k / N`` of ``base_lr`` per step, so ``N >= k`` once ``k > 1``) and that sees at least
    ``warmup_samples`` samples.

    Example:
        >>> expected_warmup_steps(64, 32, 8), expected_warmup_steps(64, 32, 8, 1, 3000)
        (4, 12)
    """
    glob = batch_size * world_size * accum_steps
    steady = -(-glob // base_batch) if glob > base_batch else 0
    return max(steady, -(-warmup_samples // glob))
