"""Lab 9's reference answers (instructor only): what the solution notebook does, as code.

- :func:`fsdp_bytes`: bytes of parameters, gradients and AdamW moments on every rank under
  ``fully_shard`` (exercise 1);
- ``FSDP_SOURCE``: ``shard_model`` of ``fsdp.py``, FSDP2 on the GPT, one unit per block,
  then the root, and AdamW built after (exercise 2);
- ``PLAN_SOURCE``: ``parallelize_block`` of ``tp_plan.py``, a GPT block split with DTensor
  (exercise 3).

``FILES`` holds the notebook's two ``%%writefile`` files as sources, for the tests and the
grader.
"""

from __future__ import annotations

import math


def fsdp_bytes(shapes, bytes_per_number, world_size):
    """Every rank's bytes under FSDP2: its rows of each parameter (exercise 1)."""
    out = []
    for rank in range(world_size):
        mine = 0
        for shape in shapes:
            per_rank = math.ceil(shape[0] / world_size)
            rows = max(0, min(per_rank, shape[0] - rank * per_rank))
            mine += rows * math.prod(shape[1:]) * bytes_per_number
        out.append({"params": mine, "grads": mine, "optimizer": 2 * mine})
    return out


#: Exercise 2's file (``fsdp.py``).
FSDP_SOURCE = """import torch
from torch.distributed.fsdp import fully_shard


def shard_model(model, mesh, adamw):
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), **adamw)
    return model, optimizer
"""

#: Exercise 3's file (``tp_plan.py``): Megatron's split of a GPT block with DTensor, the
#: attention's input made a DTensor once so that q, k and v share one backward all-reduce.
PLAN_SOURCE = """from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    parallelize_module,
)


def parallelize_block(block, mesh):
    once = PrepareModuleInput(
        input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),), use_local_output=False
    )
    plan = {
        "attn": once,
        "attn.q": ColwiseParallel(),
        "attn.k": ColwiseParallel(),
        "attn.v": ColwiseParallel(),
        "attn.proj": RowwiseParallel(),
        "mlp.fc": ColwiseParallel(),
        "mlp.proj": RowwiseParallel(),
    }
    return parallelize_module(block, mesh, plan)
"""


#: The notebook's two files (``%%writefile`` cells), as the reference writes them.
FILES = {"fsdp.py": FSDP_SOURCE, "tp_plan.py": PLAN_SOURCE}

#: Exercise 4's file (``mesh2d.py``).
MESH_SOURCE = """import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def parallelize_2d(model, tp, plan_block):
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
    for block in model.blocks:
        plan_block(block, mesh["tp"])
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return mesh, model
"""

FILES["mesh2d.py"] = MESH_SOURCE
