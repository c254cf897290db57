"""Real profiled DDP jobs, for exercise 1: profiler traces of a tiny DDP loop.

Every job trains a small MLP with ``DistributedDataParallel`` on a group of ``world_size``
gloo ranks: 2 steps unrecorded (DDP rebuilds its buckets after the first), then ``active``
steps recorded by the profiler that ``torch.profiler`` drives, Kineto's
(``torch.autograd.profiler.profile(use_kineto=True)``: CPU activity only, no shapes, no
memory, so the traces stay small), each step marked ``ProfilerStep#<k>`` exactly as
``torch.profiler.profile.step()`` marks it (a ``record_function`` range,
``torch/profiler/profiler.py``). ``torch.profiler.profile`` itself is not used because its
start imports ``torch._inductor`` (``prepare_trace``), 2.5 s per rank. The loop marks its
phases as the trainer does (``ddp_lab: data / forward / backward / optimizer``) and, per
bucket, where the comm hook launches the all-reduce (``ddp_lab: all_reduce bucket <i>``).

Two settings are drawn per job:

- ``bucket_cap_mb``: DDP's bucket size. A cap above the model's size gives one bucket,
  launched when the backward pass is over (nothing left to hide it under); a small cap
  gives several, the first launched while the backward pass still runs;
- ``slow``: a slower link. The comm hook all-reduces each bucket padded with ``slow``
  times its size in zeros, so the backend's all-reduce (``gloo:all_reduce``, on gloo's
  own worker thread) moves ``1 + slow`` times the bytes and lasts that much longer, while
  the training thread does the same work (it copies the bucket into the padded buffer and
  launches). ``slow = 0`` is the plain link.

Each rank keeps the complete events (``"ph": "X"``) of its trace, as
``ddp_lab.figures.profile.load_events`` reads them, with their ``name``, ``ph``, ``ts``,
``dur``, ``tid``, ``pid`` and ``cat`` (``args`` dropped). All of a grading run's jobs run in
one ``torchrun`` launch of 3 ranks, each job on a process group of its own (ranks 0 and 1,
or 0 to 2); a rank outside a job's group waits at the next group's creation.
"""

from __future__ import annotations

import sys
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.profiler import record_function
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_lab.checks.lab08 import jobs

#: Layers of the MLP (in, hidden..., out): about 0.5 M parameters, 2 MB of gradients.
WIDTHS = (128, 384, 384, 384, 384, 10)
BATCH = 256
#: The profiler's schedule: 2 steps skipped (DDP rebuilds its buckets after the first),
#: 1 warm-up step, then ``active`` recorded steps.
WAIT = 2
PREFIX = "ddp_lab: "


def model_mb() -> float:
    """The MLP's gradients in MiB (float32)."""
    numel = sum(a * b + b for a, b in zip(WIDTHS[:-1], WIDTHS[1:], strict=True))
    return numel * 4 / 2**20


class _Link:
    """The comm hook's state: the group, a padded buffer per bucket, and ``slow``."""

    def __init__(self, group, slow: float):
        self.group, self.slow = group, slow
        self.size = dist.get_world_size(group)
        self.padded: dict[int, torch.Tensor] = {}


def _hook(link: _Link, bucket):
    """All-reduce the bucket over a link ``1 + slow`` times slower (see the module)."""
    i, grads = bucket.index(), bucket.buffer()
    n = grads.numel()
    with record_function(f"{PREFIX}all_reduce bucket {i}"):
        pad = link.padded.get(i)
        if pad is None or pad.numel() < n:
            pad = link.padded[i] = grads.new_zeros(n + int(link.slow * n))
        pad[:n].copy_(grads)
        fut = dist.all_reduce(pad, group=link.group, async_op=True).get_future()

    def done(f):
        return f.value()[0][:n].div_(link.size)

    return fut.then(done)


def _step(model, opt, gen, step: int | None) -> None:
    """One training step, marked as torch.profiler marks it (``ProfilerStep#<step>``)."""
    mark = record_function(f"ProfilerStep#{step}") if step is not None else nullcontext()
    with mark:
        with record_function(PREFIX + "data"):
            x = torch.randn(BATCH, WIDTHS[0], generator=gen)
            y = torch.randint(0, WIDTHS[-1], (BATCH,), generator=gen)
        with record_function(PREFIX + "forward"):
            loss = nn.functional.cross_entropy(model(x), y)
        with record_function(PREFIX + "backward"):
            loss.backward()
        with record_function(PREFIX + "optimizer"):
            opt.step()
            opt.zero_grad()


def _train(spec: dict, group, rank: int, out: Path) -> list[dict]:
    """The job's loop on this rank; its trace's complete events."""
    torch.manual_seed(spec["seed"])
    layers: list[nn.Module] = []
    for a, b in zip(WIDTHS[:-1], WIDTHS[1:], strict=True):
        layers += [nn.Linear(a, b), nn.ReLU()]
    model = DDP(nn.Sequential(*layers[:-1]), process_group=group, bucket_cap_mb=spec["cap"])
    model.register_comm_hook(_Link(group, spec["slow"]), _hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(spec["seed"] + rank)
    for _ in range(WAIT):  # DDP rebuilds its buckets after the first step
        _step(model, opt, gen, None)
    path = out / f"job-rank{rank}.json"
    with torch.autograd.profiler.profile(use_kineto=True, use_cpu=True) as prof:
        for step in range(WAIT, WAIT + spec["active"]):
            _step(model, opt, gen, step)
    prof.export_chrome_trace(str(path))
    return jobs.complete_events(path)


def run_jobs(specs: list[dict]) -> list[list[list[dict]]]:
    """Run the jobs (one torchrun launch of as many ranks as the largest job has: 3 when
    grading): per job, every rank's events.

    Each spec: ``world_size`` (2 or 3), ``cap`` (``bucket_cap_mb``), ``slow``, ``active``
    (recorded steps) and ``seed``.
    """
    return jobs.launch("ddp_lab.checks.lab08.trace_jobs", specs)


if __name__ == "__main__":
    jobs.worker(sys.argv[1], sys.argv[2], _train)
