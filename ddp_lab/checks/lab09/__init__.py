"""Checks of lab 9 (PyTorch's distributed stack: FSDP2, DTensor, device meshes): four
exercises, 15 points (and two written answers, 4 points, graded by hand).

1. ``fsdp_bytes(shapes, bytes_per_number, world_size)`` (3): bytes of parameters,
   gradients and AdamW moments that each rank holds under ``fully_shard``; judged against
   FSDP2's own chunks of real tensors, measured;
2. ``shard_model(model, mesh, adamw)`` (4, file ``fsdp.py``, every rank): FSDP2 on the
   course's GPT, one unit per block, and its AdamW; judged by its units, its collectives
   (ZeRO-3's), the bytes each rank holds, and its weights after a few steps against one
   process on the whole batch (what DDP trains);
3. ``parallelize_block(block, mesh)`` (4, file ``tp_plan.py``, every rank): a GPT block
   split with DTensor; judged against the unsplit block, by its shards (1/n of every linear
   weight a rank) and by its all-reduces (2 each way, Megatron's count);
4. ``parallelize_2d(model, tp, plan_block)`` (4, file ``mesh2d.py``, every rank): the GPT
   on a data x tensor device mesh; judged by its groups (Megatron's: tensor groups of
   neighbouring ranks), its shards, and its weights after 2 steps against one process.

One file per exercise holds its contract (case set, run, judge). The functions below are the
notebook's visible checks: each runs its exercise on small fixed inputs through
:func:`ddp_lab.checks.runner.visible` and prints ``OK: ...`` or raises
:class:`~ddp_lab.checks.failure.CheckFailed`; the grader runs the same contract on inputs
drawn at grading time.

Example:
    >>> from ddp_lab.checks import lab09 as checks
    >>> checks.fsdp_bytes(fsdp_bytes)  # doctest: +SKIP
    OK: fsdp_bytes matches FSDP2's shards measured on every rank ...
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ddp_lab.checks import runner
from ddp_lab.checks.lab09 import ex1_fsdp_bytes, ex2_fsdp, ex3_dtensor_block, ex4_mesh
from ddp_lab.checks.lab09.common import FSDP_FILE, LAB, MESH_FILE, PLAN_FILE

__all__ = ["EXERCISES", "GRADING", "LAB", "dtensor_block", "fsdp", "fsdp_bytes", "mesh"]

#: The exercises, in the order of the notebook's test cells.
EXERCISES = [
    ex1_fsdp_bytes.EXERCISE,
    ex2_fsdp.EXERCISE,
    ex3_dtensor_block.EXERCISE,
    ex4_mesh.EXERCISE,
]

#: True while ``nbgrader autograde`` runs the notebook: the notebook then skips its
#: demonstrations (the grader judges the exercises outside the kernel).
GRADING = runner.grading()


def fsdp_bytes(fn: Callable) -> None:
    """Visible check of exercise 1: a GPT's parameters over 2 and 3 ranks, a single row and a
    bias over 3, against FSDP2's chunks measured."""
    runner.visible(LAB, "test_ex1_fsdp_bytes", functions={"fsdp_bytes": fn})


def fsdp(path: str = FSDP_FILE) -> None:
    """Visible check of exercise 2: the file's ``shard_model`` on a GPT over 3 ranks and over
    2 (two torchrun jobs), against one process on the whole batch."""
    runner.visible(LAB, "test_ex2_fsdp", folder=Path(path).parent)


def dtensor_block(path: str = PLAN_FILE) -> None:
    """Visible check of exercise 3: the file's ``parallelize_block`` on a block over 3 ranks
    and over 2 (two torchrun jobs), against the unsplit block, its shards and its
    all-reduces."""
    runner.visible(LAB, "test_ex3_dtensor_block", folder=Path(path).parent)


def mesh(path: str = MESH_FILE) -> None:
    """Visible check of exercise 4: the file's ``parallelize_2d`` on 4 ranks as 2 x 2 and on
    3 ranks (two torchrun jobs), against Megatron's groups and one process on the whole
    batch."""
    runner.visible(LAB, "test_ex4_mesh", folder=Path(path).parent)
