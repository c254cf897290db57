"""Worker functions for the trainer tests that run in gloo processes (``spawn_gloo``)."""

from __future__ import annotations

import contextlib
import gc
import json
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_lab.dist import CommMeter, ddp_bucket_count
from ddp_lab.models import build_model


def count_allreduces(rank: int, world_size: int, tmp_dir: str, accum: int, steps: int) -> None:
    """DDP with two buckets, with and without a CommMeter: all-reduce calls per optimizer
    step, the bucket count, and whether the weights agree bit for bit (rank 0 writes
    ``allreduces.json``)."""
    weights, calls = {}, []
    for metered in (False, True):
        torch.manual_seed(0)
        # find_unused_parameters keeps DDP's initial buckets (a 0.3 MB cap: two buckets of
        # the MLP); without it this torch rebuilds them into one after the first step.
        model = DDP(build_model("mlp"), bucket_cap_mb=0.3, find_unused_parameters=True)
        meter = CommMeter(world_size).attach(model) if metered else None
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        g = torch.Generator().manual_seed(rank)
        for _ in range(steps):
            for micro in range(accum):
                x = torch.randn(8, 3, 32, 32, generator=g)
                y = torch.randint(0, 10, (8,), generator=g)
                last = micro == accum - 1
                with contextlib.nullcontext() if last else model.no_sync():
                    loss = torch.nn.functional.cross_entropy(model(x), y) / accum
                    loss.backward()
            opt.step()
            opt.zero_grad()
            if meter is not None:
                calls.append(meter.take()[0])
        weights[metered] = {k: v.clone() for k, v in model.module.state_dict().items()}
        buckets = ddp_bucket_count(model)
        del model, opt
        gc.collect()
    if rank == 0:
        same = all(torch.equal(weights[False][k], weights[True][k]) for k in weights[False])
        result = {"calls": calls, "buckets": buckets, "bit_identical": same}
        with open(os.path.join(tmp_dir, "allreduces.json"), "w") as f:
            json.dump(result, f)
    dist.barrier()
