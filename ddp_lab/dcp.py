"""Distributed checkpoints: ``torch.distributed.checkpoint`` (DCP) in the trainer's format.

``--ckpt-format dcp`` writes a checkpoint as a folder ``ckpt-<step>.dcp/``:

- the model and the optimizer through ``dcp.save``: every rank writes its share
  (``__<rank>_0.distcp``) and rank 0 the ``.metadata`` index. The state comes from
  ``torch.distributed.checkpoint.state_dict.get_state_dict``, keyed by parameter names
  rather than the optimizer's positions, so a checkpoint of sharded parameters (FSDP2's
  DTensors) loads onto another number of ranks: DCP reads each rank's slices from
  whichever files hold them. Under DDP every rank holds the same tensors and DCP's planner
  gives each one to a single rank to write, so the ranks share the writing;
- the rest of the run's state (step, epoch, optimizer-free counters, RNG states, data
  order, the scaler, the schedule, evaluations) in ``trainer.pt``, written by rank 0 in the
  course's checksummed format (:mod:`ddp_lab.ckptfile`), with the SHA-256 of
  every DCP file: a truncated or damaged file of the folder is caught before loading.

Atomic as the single file is: all ranks write into ``.ckpt-<step>.dcp.tmp/``, and rank 0
renames the whole folder once every rank is done. Reading restores the model and optimizer
in place (``set_state_dict``) on any number of processes.
"""

from __future__ import annotations

import hashlib
import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ddp_lab.ckptfile import CorruptCheckpoint, decode, encode, write_atomic
from ddp_lab.dist import DistEnv, unwrap

#: The file of a DCP checkpoint folder that the trainer writes itself.
TRAINER_FILE = "trainer.pt"


def file_digests(folder: str) -> dict[str, str]:
    """SHA-256 of every file in ``folder`` but :data:`TRAINER_FILE`, by name.

    Example:
        >>> import tempfile; d = tempfile.mkdtemp()
        >>> _ = open(os.path.join(d, "a"), "wb").write(b"x")
        >>> file_digests(d)["a"][:8]
        '2d711642'
    """
    digests = {}
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if name != TRAINER_FILE and os.path.isfile(path):
            with open(path, "rb") as f:
                digests[name] = hashlib.sha256(f.read()).hexdigest()
    return digests


def save(
    path: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    rest: dict,
    env: DistEnv,
) -> int:
    """Write the folder ``path`` (a collective: every rank calls it).

    Args:
        path: ``.../ckpt-<step>.dcp``.
        model: the (DDP-wrapped or plain) model.
        optimizer: its optimizer.
        rest: everything else of the state (no model, no optimizer), saved by rank 0.
        env: this process's :class:`~ddp_lab.dist.DistEnv`.

    Returns:
        The folder's bytes (on rank 0; 0 elsewhere).
    """
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp")
    if env.is_rank0:
        shutil.rmtree(tmp, ignore_errors=True)  # what a crashed save left
        os.makedirs(tmp)
    if env.distributed:
        dist.barrier()
    model_state, optim_state = get_state_dict(unwrap(model), optimizer)
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=tmp)
    size = 0
    if env.is_rank0:
        state = {**rest, "files": file_digests(tmp)}
        write_atomic(encode(state), os.path.join(tmp, TRAINER_FILE))
        shutil.rmtree(path, ignore_errors=True)  # an older run's folder of this step
        os.replace(tmp, path)
        size = sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))
    if env.distributed:
        dist.barrier()
    return size


def verify(path: str) -> dict:
    """The folder's :data:`TRAINER_FILE` state, after checking its checksum and every DCP
    file's SHA-256.

    Raises:
        CorruptCheckpoint: a file missing, truncated or damaged.
    """
    try:
        with open(os.path.join(path, TRAINER_FILE), "rb") as f:
            state = decode(f.read())
    except FileNotFoundError:
        raise CorruptCheckpoint(f"no {TRAINER_FILE} in the folder") from None
    found = file_digests(path)
    for name, digest in state["files"].items():
        if found.get(name) != digest:
            why = "missing" if name not in found else "checksum mismatch"
            raise CorruptCheckpoint(f"{name} in the folder: {why}")
    return state


def load(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Restore the model and the optimizer from the folder ``path`` in place (a collective),
    and return the whole state as the single-file format holds it (``"model"`` and
    ``"optimizer"`` as their ``state_dict()`` after the load)."""
    rest = verify(path)
    inner = unwrap(model)
    model_state, optim_state = get_state_dict(inner, optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(
        inner, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
    )
    return {**rest, "model": inner.state_dict(), "optimizer": optimizer.state_dict()}
