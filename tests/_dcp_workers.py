"""Worker of ``test_dcp.py``: an FSDP2-sharded transformer saved with
``torch.distributed.checkpoint`` on one number of ranks and loaded on another.

``save``: the course's GPT, ``fully_shard`` per block and at the root on a 1-D CPU mesh,
AdamW, two steps on each rank's own batch; then ``dcp.save`` of the sharded model and
optimizer state (every rank writes its shards) and, from rank 0, the full (gathered) state
as one ``torch.save`` file beside the folder, the reference. ``load``: a fresh model
sharded the same way on another number of ranks, ``dcp.load`` + ``set_state_dict``; rank 0
writes the full state it then holds, and each rank the sizes of its own shards.
"""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.state_dict import (  # noqa: E402
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

from ddp_lab.gpt import GPT, GPTConfig  # noqa: E402

CFG = GPTConfig(seq_len=8, width=16, heads=2, layers=2)
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def sharded_gpt(world_size: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    model = GPT(CFG)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def reshard_worker(rank: int, world_size: int, tmp_dir: str, mode: str, folder: str) -> None:
    try:
        _reshard(rank, world_size, tmp_dir, mode, folder)
    finally:
        # FSDP's state freed after the group is gone can abort a rank ("terminate called
        # without an active exception"): free it while the group is up
        gc.collect()
        dist.barrier()


def _reshard(rank: int, world_size: int, tmp_dir: str, mode: str, folder: str) -> None:
    model, optimizer = sharded_gpt(world_size)
    if mode == "save":
        g = torch.Generator().manual_seed(rank)
        for _ in range(2):
            tokens = torch.randint(0, 256, (3, CFG.seq_len + 1), generator=g)
            logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        msd, osd = get_state_dict(model, optimizer)
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=folder)
        full = get_state_dict(model, optimizer, options=FULL)
        if rank == 0:
            torch.save(full, f"{folder}.full.pt")
        return
    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optimizer": osd}
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
    )
    full = get_state_dict(model, optimizer, options=FULL)
    shards = {n: tuple(p.to_local().shape) for n, p in model.named_parameters()}
    torch.save(shards, os.path.join(tmp_dir, f"shards{rank}.pt"))
    if rank == 0:
        torch.save(full, os.path.join(tmp_dir, "loaded.full.pt"))
