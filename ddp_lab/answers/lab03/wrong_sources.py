"""The cells of lab 3's typical mistakes, built from one student's own (right) answers.

Each builder writes a whole solution cell the way a student might, with one thing wrong
(chosen by its arguments; the defaults give a right answer, which the tests use to prove
that the builders themselves are sound). They are written apart from the reference
solutions, so that the sample class's ``mistake`` student does not look like a copy.
"""

from __future__ import annotations

# --- exercise 1 -----------------------------------------------------------------------------


def sampler(
    seed: str = "self.seed + self.epoch",
    generator: str | None = "iter",
    length: str = "math.ceil(self.n / self.world_size)",
    pad: str = "repeat",
    len_: str = "",
    shuffle: str = "self.shuffle",
    deal: str = "turns",
) -> str:
    """``MySampler`` with the given pieces (see the module docstring)."""
    per_rank = f"self.n // self.world_size if self.drop_last else {length}"
    init_extra = ""
    if generator == "iter":
        order = (
            "g = torch.Generator()\n"
            f"            g.manual_seed({seed})\n"
            "            order = torch.randperm(self.n, generator=g).tolist()"
        )
    elif generator == "init":
        init_extra = "\n        self.g = torch.Generator().manual_seed(seed)"
        order = "order = torch.randperm(self.n, generator=self.g).tolist()"
    else:
        order = "order = torch.randperm(self.n).tolist()"
    fill = {
        "repeat": (
            "while len(order) < need:\n            order = order + order[: need - len(order)]"
        ),
        "once": "order = order + order[: need - len(order)]",
    }[pad]
    hand_out = {
        "turns": "return iter(order[self.rank :: self.world_size])",
        "blocks": (
            "start = self.rank * per_rank\n        return iter(order[start : start + per_rank])"
        ),
    }[deal]
    return f"""import math

import torch
from torch.utils.data import Sampler


class MySampler(Sampler):
    def __init__(self, n, rank, world_size, shuffle=True, seed=0, drop_last=False):
        self.n, self.rank, self.world_size = n, rank, world_size
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0{init_extra}

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return {len_ or per_rank}

    def __iter__(self):
        if {shuffle}:
            {order}
        else:
            order = list(range(self.n))
        per_rank = {per_rank}
        need = per_rank * self.world_size
        {fill}
        order = order[:need]
        {hand_out}
"""


# --- exercise 2 -----------------------------------------------------------------------------


def ddp_train(
    sampler: bool = True,
    device_from: str = "LOCAL_RANK",
    set_epoch: bool = True,
    set_device: bool = True,
    ddp: bool = True,
) -> str:
    """A short ``ddp_train.py`` (setup, teardown, train) with the given pieces."""
    make_current = "        torch.cuda.set_device(gpu)\n" if set_device else ""
    loader = (
        "    sampler = DistributedSampler(dataset, shuffle=True, seed=seed, drop_last=True)\n"
        "    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True)\n"
        if sampler
        else "    loader = DataLoader(dataset, batch_size=batch_size, drop_last=True)\n"
    )
    new_epoch = "        sampler.set_epoch(epoch)\n" if sampler and set_epoch else ""
    wrap = "DDP(model)" if ddp else "model"
    return f"""%%writefile ddp_train.py
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler


def setup():
    gpu = int(os.environ["{device_from}"])
    if torch.cuda.is_available():
{make_current}        dist.init_process_group("nccl")
        device = torch.device(f"cuda:{{gpu}}")
    else:
        dist.init_process_group("gloo")
        device = torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), device


def teardown():
    dist.destroy_process_group()


def train(model, dataset, batch_size, lr, epochs, seed=0, out=None, log=print):
    ddp_model = {wrap}
{loader}    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=lr)
    for epoch in range(epochs):
{new_epoch}        for x, y in loader:
            loss = torch.nn.functional.cross_entropy(ddp_model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        if dist.get_rank() == 0:
            log(f"epoch {{epoch}}: loss {{loss.item():.4f}}")
    if dist.get_rank() == 0 and out is not None:
        torch.save(model.state_dict(), out)
"""


# --- exercise 3 -----------------------------------------------------------------------------

EVAL_SAMPLER = """%%writefile evaluate.py
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
"""

EVAL_MEAN = """%%writefile evaluate.py
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
    accuracy = correct / total if total else 0.0
    stats = torch.tensor([correct, total, accuracy], dtype=torch.float64)
    dist.all_reduce(stats)
    return {"correct": int(stats[0]), "total": int(stats[1]),
            "accuracy": stats[2].item() / world_size}
"""

EVAL_LOCAL = """%%writefile evaluate.py
import torch
import torch.distributed as dist


def evaluate(model, dataset, batch_size=64):
    idx = list(range(dist.get_rank(), len(dataset), dist.get_world_size()))
    right = 0
    with torch.no_grad():
        for start in range(0, len(idx), batch_size):
            x, y = zip(*[dataset[i] for i in idx[start : start + batch_size]])
            right += int((model(torch.stack(x)).argmax(1) == torch.stack(y)).sum())
    return {"correct": right, "total": len(idx), "accuracy": right / max(1, len(idx))}
"""

#: Right shards and sums, but tensors where the docstring promises int, int and float.
EVAL_TENSORS = """%%writefile evaluate.py
import torch
import torch.distributed as dist


def evaluate(model, dataset, batch_size=64):
    idx = list(range(dist.get_rank(), len(dataset), dist.get_world_size()))
    counts = torch.zeros(2, dtype=torch.long)
    with torch.no_grad():
        for start in range(0, len(idx), batch_size):
            x, y = zip(*[dataset[i] for i in idx[start : start + batch_size]])
            counts[0] += (model(torch.stack(x)).argmax(1) == torch.stack(y)).sum()
            counts[1] += len(y)
    dist.all_reduce(counts)
    return {"correct": counts[0], "total": counts[1], "accuracy": counts[0] / counts[1]}
"""

# --- exercise 4 -----------------------------------------------------------------------------

_HOOKS = {
    "async": (
        "        handle = dist.all_reduce(p.grad, async_op=True)\n"
        "        self.handles.append((handle, p))\n"
    ),
    "wait": (
        "        handle = dist.all_reduce(p.grad, async_op=True)\n"
        "        handle.wait()\n"
        "        p.grad.div_(dist.get_world_size())\n"
    ),
    "blocking": "        dist.all_reduce(p.grad)\n        p.grad.div_(dist.get_world_size())\n",
}
_FINISH = {
    "right": (
        "        n = dist.get_world_size()\n"
        "        for handle, p in self.handles:\n"
        "            handle.wait()\n"
        "            p.grad.div_(n)\n"
        "        self.handles = []\n"
    ),
    "divide_first": (
        "        n = dist.get_world_size()\n"
        "        for handle, p in self.handles:\n"
        "            p.grad.div_(n)\n"
        "            handle.wait()\n"
        "        self.handles = []\n"
    ),
    "no_wait": (
        "        n = dist.get_world_size()\n"
        "        for handle, p in self.handles:\n"
        "            p.grad.div_(n)\n"
        "        self.handles = []\n"
    ),
    "none": "        pass\n",
    "all_here": (
        "        n = dist.get_world_size()\n"
        "        grads = [p.grad for p in self.module.parameters() if p.grad is not None]\n"
        "        handles = [dist.all_reduce(g, async_op=True) for g in grads]\n"
        "        for handle, g in zip(handles, grads):\n"
        "            handle.wait()\n"
        "            g.div_(n)\n"
    ),
}


def my_ddp(hook: str = "async", finish: str = "", broadcast: bool = True) -> str:
    """``MyDDP`` with a hook that starts the all-reduce asynchronously (``"async"``), waits
    for it at once (``"wait"``), blocks (``"blocking"``), or no hook (``"none"``: everything
    in ``finish``); ``finish`` waits then divides (``"right"``), divides first, never
    waits."""
    finish = finish or {"async": "right", "none": "all_here"}.get(hook, "none")
    send = (
        "        for t in list(module.parameters()) + list(module.buffers()):\n"
        "            dist.broadcast(t.data, src=0)\n"
        if broadcast
        else ""
    )
    register = (
        ""
        if hook == "none"
        else "        for p in module.parameters():\n"
        "            if p.requires_grad:\n"
        "                p.register_post_accumulate_grad_hook(self.hook)\n"
    )
    method = "" if hook == "none" else f"    def hook(self, p):\n{_HOOKS[hook]}\n"
    return f"""%%writefile my_ddp.py
import torch
import torch.distributed as dist
from torch import nn


class MyDDP(nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module = module
        self.handles = []
{send}{register}
{method}    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish(self):
{_FINISH[finish]}"""


TORCH_DDP_INSIDE = """%%writefile my_ddp.py
from torch import nn
from torch.nn.parallel import DistributedDataParallel


class MyDDP(nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module = DistributedDataParallel(module)

    def forward(self, *a, **k):
        return self.module(*a, **k)

    def finish(self):
        pass
"""

# --- exercise 5 -----------------------------------------------------------------------------


def bucketed(
    order: str = "reverse",
    cap: str = "used",
    size: str = "p.element_size()",
    hook: str = "async",
    reset: bool = True,
    divide: bool = True,
) -> str:
    """``BucketedDDP`` with the given pieces (see the module docstring)."""
    flip = "        params = params[::-1]\n" if order == "reverse" else ""
    full = {"used": "filled >= limit", "ignored": "False", "per_gradient": "True"}[cap]
    wait = "            handle.wait()\n" if hook == "wait" else ""
    average = "            buf /= dist.get_world_size()\n" if divide else ""
    again = "        self.count = [0] * len(self.buckets)\n" if reset else ""
    return f"""%%writefile bucketed_ddp.py
import torch
import torch.distributed as dist
from torch import nn


class BucketedDDP(nn.Module):
    def __init__(self, module, bucket_cap_mb=25.0):
        super().__init__()
        self.module = module
        for t in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(t.data, src=0)
        params = [p for p in module.parameters() if p.requires_grad]
{flip}        limit = bucket_cap_mb * 1024 * 1024
        self.buckets = [[]]
        filled = 0
        for p in params:
            self.buckets[-1].append(p)
            filled += p.numel() * {size}
            if {full}:
                self.buckets.append([])
                filled = 0
        if not self.buckets[-1]:
            self.buckets.pop()
        self.todo = {{}}
        for i, bucket in enumerate(self.buckets):
            for p in bucket:
                self.todo[p] = i
                p.register_post_accumulate_grad_hook(self.grad_ready)
        self.count = [0] * len(self.buckets)
        self.sent = []

    def grad_ready(self, p):
        i = self.todo[p]
        self.count[i] += 1
        if self.count[i] == len(self.buckets[i]):
            buf = torch.cat([q.grad.view(-1) for q in self.buckets[i]])
            handle = dist.all_reduce(buf, async_op=True)
{wait}            self.sent.append((i, buf, handle))

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish(self):
        for i, buf, handle in self.sent:
            handle.wait()
{average}            pos = 0
            for q in self.buckets[i]:
                q.grad.copy_(buf[pos : pos + q.numel()].view_as(q))
                pos += q.numel()
        self.sent = []
{again}"""


# --- exercise 6 -----------------------------------------------------------------------------

#: The two requirements, each right or in a typical wrong form (``glob``: samples per step).
_STEADY = {
    "right": "-(-glob // base_batch) if glob > base_batch else 0",
    "floor": "glob // base_batch if glob > base_batch else 0",
    "round": "round(glob / base_batch) if glob > base_batch else 0",
    "plus_one": "glob // base_batch + 1 if glob > base_batch else 0",
    "ignored": "0",
}
_DATA = {
    "right": "-(-warmup_samples // glob)",
    "per_process": "-(-warmup_samples // (batch_size * accum_steps))",
    "ignored": "0",
}
_GLOBAL = {
    "right": "batch_size * world_size * accum_steps",
    "no_accum": "batch_size * world_size",
}


def warmup_steps_for(
    steady: str = "right",
    data: str = "right",
    glob: str = "right",
    at_least_one: bool = False,
    as_float: bool = False,
) -> str:
    """``warmup_steps_for`` with each part right or in one typical wrong form."""
    result = f"max({_STEADY[steady]}, {_DATA[data]})"
    if at_least_one:
        result = f"max(1, {result})"
    if as_float:
        result = f"float({result})"
    return (
        "def warmup_steps_for(base_batch, batch_size, world_size, accum_steps=1, "
        "warmup_samples=0):\n"
        f"    glob = {_GLOBAL[glob]}\n"
        f"    return {result}\n"
    )
