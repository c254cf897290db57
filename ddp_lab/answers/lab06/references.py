"""Lab 6's reference answers (instructor only): what the solution notebook does, as functions.

- :func:`save_checkpoint` / :func:`load_checkpoint`: one file, the ``torch.save`` bytes
  followed by a trailer (magic, length, SHA-256), written through a temporary file of the
  same folder that is fsync'ed before the rename (a file format of its own: the trainer's
  ``ddp_lab.checkpoint`` puts a header line first);
- :func:`train`: the notebook's recipe with checkpoints every ``ckpt_every`` steps (rank 0
  writes, every rank's generator states gathered) and a resume that skips the batches the
  checkpointed epoch had read, then restores the generators;
- :func:`rollback_plan`: the rollback rule over a run's evaluations;
- :func:`fixed_train`: ``hang_train.py``'s ``train`` with every rank taking every step and
  every collective.

``FILES`` holds the two ``%%writefile`` files of the notebook (exercises 2 and 4) as
sources, for the tests.
"""

from __future__ import annotations

import hashlib
import inspect
import io
import math
import os
import random
import struct

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

TRAILER = b"LAB6-END"


def save_checkpoint(state, path):
    """Atomic, checksummed: ``<torch.save bytes><magic><length><sha256>``."""
    with io.BytesIO() as out:
        torch.save(state, out)
        body = out.getvalue()
    trailer = TRAILER + struct.pack("<Q", len(body)) + hashlib.sha256(body).digest()
    folder = os.path.dirname(path) or "."
    temp = os.path.join(folder, f".{os.path.basename(path)}.partial{os.getpid()}")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for chunk in (body, trailer):
            view = memoryview(chunk)
            while len(view):  # os.write may write fewer bytes than asked
                view = view[os.write(fd, view) :]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(temp)
        raise
    os.close(fd)
    os.replace(temp, path)
    dir_fd = os.open(folder, os.O_DIRECTORY)  # the rename itself, on disk too
    os.fsync(dir_fd)
    os.close(dir_fd)


def load_checkpoint(path, map_location=None):
    """The state, after checking the trailer, the length and the SHA-256 (else ValueError)."""
    with open(path, "rb") as f:
        data = f.read()
    size = len(TRAILER) + 8 + 32
    body, trailer = data[:-size], data[-size:]
    if len(data) < size or not trailer.startswith(TRAILER):
        raise ValueError(f"{path}: no checkpoint trailer (truncated or not a checkpoint)")
    length = struct.unpack("<Q", trailer[len(TRAILER) : len(TRAILER) + 8])[0]
    if length != len(body) or hashlib.sha256(body).digest() != trailer[-32:]:
        raise ValueError(f"{path}: checksum mismatch (damaged)")
    return torch.load(io.BytesIO(body), weights_only=True, map_location=map_location)


def train(
    ddp_model, optimizer, scheduler, dataset, *, epochs, batch_size, ckpt_every, ckpt_path, seed
):
    """The notebook's recipe, checkpointed every ``ckpt_every`` steps; resumes from
    ``ckpt_path`` bit-identically (see the notebook's docstring)."""
    rank = dist.get_rank()
    torch.manual_seed(seed + rank)
    random.seed(seed + rank)
    sampler = DistributedSampler(dataset, shuffle=True, seed=seed)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    first_epoch, skip, step, mine = 0, 0, 0, None
    if os.path.exists(ckpt_path):
        saved = torch.load(ckpt_path, map_location="cpu", weights_only=True)
        ddp_model.module.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        first_epoch, skip, step = saved["epoch"], saved["batches_done"], saved["step"]
        mine = saved["generators"][rank]
    for epoch in range(first_epoch, epochs):
        sampler.set_epoch(epoch)
        batches = iter(loader)  # draws a seed from the global generator
        done = 0
        if mine is not None:  # the checkpoint's epoch: where it was, then its generators
            for _ in range(skip):
                next(batches)
            done = skip
            torch.set_rng_state(mine["torch"])
            random.setstate(mine["python"])
            mine = None
        for x, y in batches:
            optimizer.zero_grad()
            F.cross_entropy(ddp_model(x), y).backward()
            optimizer.step()
            scheduler.step()
            step, done = step + 1, done + 1
            if step % ckpt_every == 0:
                everyone = [None] * dist.get_world_size()
                mine_now = {"torch": torch.get_rng_state(), "python": random.getstate()}
                dist.all_gather_object(everyone, mine_now)
                if rank == 0:
                    state = {
                        "model": ddp_model.module.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(),
                        "epoch": epoch,
                        "batches_done": done,
                        "step": step,
                        "generators": everyone,
                    }
                    torch.save(state, ckpt_path + ".tmp")
                    os.replace(ckpt_path + ".tmp", ckpt_path)
                dist.barrier()


def rollback_plan(history, drop):
    """Per evaluation: the checkpoint restored (or None), the best one after it, and the
    optimizer steps whose updates the rollback threw away."""
    plan = []
    best_step = best_acc = None
    restored_at = None
    for h in history:
        step, acc = h["step"], h["accuracy"]
        if best_acc is not None and best_acc - acc > drop:
            base = best_step if restored_at is None else max(best_step, restored_at)
            plan.append({"restore": best_step, "best": best_step, "discarded": step - base})
            restored_at = step
            continue
        if best_acc is None or acc > best_acc:
            best_step, best_acc = step, acc
        plan.append({"restore": None, "best": best_step, "discarded": 0})
    return plan


def fixed_train(x, y, epochs, batch_size, lr, log_every, seed=0):
    """``hang_train.py``'s train, fixed: every rank takes every step (empty batches join
    with zeros) and every collective (the logging maximum too); only rank 0 logs (returns
    and prints the records)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    w = torch.zeros(x.shape[1], dtype=torch.float64)
    logs = []
    steps = math.ceil(math.ceil(len(x) / world) / batch_size)  # the longest shard's
    for epoch in range(epochs):
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed + epoch))
        mine = order[rank::world]
        for step in range(steps):
            idx = mine[step * batch_size : (step + 1) * batch_size]  # may be empty
            err = x[idx] @ w - y[idx]
            packed = torch.cat(
                [
                    2 * x[idx].T @ err,
                    err.square().sum().view(1),
                    torch.tensor([float(len(idx))], dtype=torch.float64),
                ]
            )
            dist.all_reduce(packed)
            grad, loss_sum, count = packed[:-2], packed[-2], packed[-1]
            if (step + 1) % log_every == 0:  # every rank joins the maximum
                worst = err.square().max() if len(idx) else torch.zeros((), dtype=torch.float64)
                dist.all_reduce(worst, op=dist.ReduceOp.MAX)
                if rank == 0:
                    logs.append([epoch, step, (loss_sum / count).item(), worst.item()])
                    print(f"epoch {epoch} step {step}: loss {logs[-1][2]:.4f}")
            w -= lr * grad / count
    return w, logs


def _file(*functions, header: str, rename: dict | None = None) -> str:
    text = header + "\n\n\n" + "\n\n\n".join(inspect.getsource(f) for f in functions)
    for old, new in (rename or {}).items():
        text = text.replace(old, new)
    return text


#: The notebook's two files (``%%writefile`` cells), as the reference writes them.
FILES = {
    "resume.py": _file(
        train,
        header=(
            "import os\nimport random\n\nimport torch\nimport torch.distributed as dist\n"
            "import torch.nn.functional as F\nfrom torch.utils.data import DataLoader, "
            "DistributedSampler"
        ),
    ),
    "fixed_train.py": _file(
        fixed_train,
        header="import math\n\nimport torch\nimport torch.distributed as dist",
        rename={"def fixed_train(": "def train("},
    ),
}
