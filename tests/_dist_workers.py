"""Worker functions for multi-process tests (importable, so spawn can find them)."""

from __future__ import annotations

import os

import torch


def evaluate_worker(rank: int, world_size: int, tmp_dir: str, size: int, model_name: str):
    from ddp_lab.data import SyntheticCIFAR, evaluate
    from ddp_lab.dist import DistEnv
    from ddp_lab.models import build_model

    torch.manual_seed(0)
    model = build_model(model_name)
    env = DistEnv(rank=rank, world_size=world_size, backend="gloo")
    result = evaluate(model, SyntheticCIFAR(size, "test"), env, batch_size=16)
    torch.save(result, os.path.join(tmp_dir, f"eval-{rank}.pt"))
