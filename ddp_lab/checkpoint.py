"""Checkpoints: written atomically by rank 0, checksummed, loaded by every rank, pruned,
and the best one kept for a rollback; plus the data order that lets a run resume mid-epoch.

A checkpoint is one checksummed file ``ckpt-<step>.pt`` written atomically
(:mod:`ddp_lab.ckptfile`), or with ``--ckpt-format dcp`` a folder ``ckpt-<step>.dcp`` that
every rank writes its share of (:mod:`ddp_lab.dcp`). A checkpoint whose checksum does not
match (truncated, damaged) is reported in one line and the previous one is used.

Resuming at another world size: the epoch's global order is the same for every world size
(:class:`ResumableSampler`, equal to ``DistributedSampler``), and after ``k`` steps exactly
the first ``k x global batch`` samples of it have been read. The resumed run re-shards the
rest of that order over the new ranks, so no sample of the epoch is read twice or skipped
(the tail smaller than one global batch is dropped, as in every epoch).
"""

from __future__ import annotations

import os
import random
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from ddp_lab.ckptfile import CorruptCheckpoint, decode, encode, verify, write_atomic
from ddp_lab.dist import DistEnv, print0
from ddp_lab.errors import UsageError

if TYPE_CHECKING:
    from ddp_lab.options import Config

NAME = re.compile(r"^ckpt-(\d{8})\.(pt|dcp)$")
#: The file name's suffix of each ``--ckpt-format``: one file, or a folder (:mod:`ddp_lab.dcp`).
SUFFIX = {"file": "pt", "dcp": "dcp"}

#: Flags a resumed run must share with the run that wrote the checkpoint.
MUST_MATCH = ("model", "dataset", "train_size", "seed", "amp", "sync_bn", "momentum")
#: ... and, for ``--model gpt``, the transformer's size.
MUST_MATCH_GPT = ("seq_len", "width", "heads", "layers")


def checkpoint_name(step: int, fmt: str = "file") -> str:
    """The name of the checkpoint written after optimizer step ``step``: a file, or a folder
    with ``fmt="dcp"``.

    Example:
        >>> checkpoint_name(42), checkpoint_name(42, "dcp")
        ('ckpt-00000042.pt', 'ckpt-00000042.dcp')
    """
    return f"ckpt-{step:08d}.{SUFFIX[fmt]}"


def list_checkpoints(ckpt_dir: str) -> list[tuple[int, str]]:
    """``(step, path)`` of every checkpoint (file or DCP folder) in ``ckpt_dir``, oldest
    first."""
    if not os.path.isdir(ckpt_dir):
        return []
    return sorted(
        (int(m.group(1)), os.path.join(ckpt_dir, n))
        for n in os.listdir(ckpt_dir)
        if (m := NAME.match(n))
    )


def read_checkpoint(path: str, map_location: str | torch.device | None = None) -> dict:
    """Read and verify one checkpoint file (see :func:`decode`)."""
    with open(path, "rb") as f:
        return decode(f.read(), map_location)


def newest_valid(
    ckpt_dir: str, report: Callable[[str], None] = print
) -> tuple[str | None, list[str]]:
    """The newest checkpoint in ``ckpt_dir`` whose checksum verifies.

    Each newer file that fails is reported in one line through ``report``, naming the file
    used instead.

    Returns:
        ``(path or None, paths of the corrupt files skipped)``.
    """
    chosen, bad = None, []
    for _, path in reversed(list_checkpoints(ckpt_dir)):
        try:
            if os.path.isdir(path):
                from ddp_lab import dcp

                dcp.verify(path)  # every file's checksum
            else:
                with open(path, "rb") as f:
                    verify(f.read())  # the checksum; every rank loads the chosen file next
            chosen = path
            break
        except (CorruptCheckpoint, OSError) as err:
            bad.append((path, err))
    instead = os.path.basename(chosen) if chosen else "none left, starting from scratch"
    for path, err in bad:
        report(f"checkpoint {os.path.basename(path)} is corrupt ({err}); using {instead}")
    return chosen, [p for p, _ in bad]


def prune(ckpt_dir: str, keep_last: int, keep: set[str] = frozenset()) -> list[str]:
    """Delete all but the newest ``keep_last`` checkpoints, except the paths in ``keep``.

    Returns:
        The deleted paths.
    """
    found = [p for _, p in list_checkpoints(ckpt_dir)]
    doomed = [p for p in found[: max(0, len(found) - keep_last)] if p not in keep]
    for path in doomed:
        if os.path.isdir(path):  # a DCP folder
            shutil.rmtree(path)
        else:
            os.remove(path)
    return doomed


def rng_state() -> dict:
    """This process's random number generator states (torch CPU, CUDA when present, Python).

    Example:
        >>> s = rng_state(); a = torch.rand(1); set_rng_state(s); bool(torch.rand(1) == a)
        True
    """
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"].cpu())
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


def gather_rng_states(env: DistEnv) -> list[dict]:
    """Every rank's :func:`rng_state`, in rank order, on every rank (a collective)."""
    if not env.distributed:
        return [rng_state()]
    states: list = [None] * env.world_size
    dist.all_gather_object(states, rng_state())
    return states


class ResumableSampler(Sampler[int]):
    """``DistributedSampler(shuffle=True, drop_last=True)``'s order, able to start mid-epoch.

    Epoch ``e`` shuffles all indices with ``seed + e`` (exactly as ``DistributedSampler``);
    rank ``r`` of ``W`` reads every ``W``-th index of that order, starting at global position
    ``start + r``, and every rank gets the same count. With ``start = 0`` this equals
    ``DistributedSampler``; after ``k`` steps of global batch ``G`` the first ``k * G``
    positions have been read, at any world size, so ``start = k * G`` resumes the epoch,
    also on another number of ranks.

    Example:
        >>> s = ResumableSampler(10, world_size=2, rank=1, seed=0)
        >>> s.set_epoch(0, start=4)
        >>> len(s), list(s) == ResumableSampler.order(10, 0, 0)[5::2][:3]
        (3, True)
    """

    def __init__(self, size: int, world_size: int, rank: int, seed: int = 0) -> None:
        self.size, self.world_size, self.rank, self.seed = size, world_size, rank, seed
        self.epoch = self.start = 0

    @staticmethod
    def order(size: int, seed: int, epoch: int) -> list[int]:
        """The global order of epoch ``epoch`` (``DistributedSampler``'s permutation)."""
        g = torch.Generator()
        g.manual_seed(seed + epoch)
        return torch.randperm(size, generator=g).tolist()

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Read epoch ``epoch`` from global position ``start`` (0: the whole epoch)."""
        self.epoch, self.start = epoch, start

    def __len__(self) -> int:
        return max(0, self.size - self.start) // self.world_size

    def __iter__(self) -> Iterator[int]:
        order = self.order(self.size, self.seed, self.epoch)
        end = self.start + len(self) * self.world_size
        return iter(order[self.start + self.rank : end : self.world_size])


class Checkpoints:
    """The trainer's checkpoints in ``ckpt_dir``: save (rank 0, atomic, then a barrier),
    load the newest valid one (every rank, ``map_location`` to its device), prune to
    ``keep_last``, and keep the best one by validation accuracy for a rollback.

    With ``fmt="dcp"`` a checkpoint is a folder that every rank writes its share of
    (:mod:`ddp_lab.dcp`); loading restores ``model`` and ``optimizer`` in place. Either
    format is read back, whichever wrote the newest checkpoint.

    Args:
        ckpt_dir: the folder (created by rank 0; shared by all ranks of the job).
        env: this process's :class:`~ddp_lab.dist.DistEnv`.
        keep_last: how many of the newest checkpoints stay (the best one stays too).
        fmt: ``"file"`` (one file, written by rank 0) or ``"dcp"``.
        model: the model a DCP checkpoint saves and restores.
        optimizer: its optimizer.
    """

    def __init__(
        self,
        ckpt_dir: str,
        env: DistEnv,
        keep_last: int,
        fmt: str = "file",
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> None:
        self.dir, self.env, self.keep_last, self.fmt = ckpt_dir, env, keep_last, fmt
        self.model, self.optimizer = model, optimizer
        #: ``{"step", "accuracy", "path"}`` of the best checkpoint so far, or ``None``.
        self.best: dict | None = None
        if env.is_rank0:
            os.makedirs(ckpt_dir, exist_ok=True)

    def save(self, step: int, state: dict, accuracy: float | None = None) -> dict:
        """Write ``state`` (plus every rank's RNG states and the best-so-far) as the
        checkpoint of ``step``. A collective: every rank calls it.

        Args:
            step: the optimizer steps done.
            state: what to save (model, optimizer, ... : see ``ddp_lab.train``).
            accuracy: validation accuracy of these weights, when measured (for rollback).

        Returns:
            ``{"path", "bytes", "seconds"}`` (bytes and seconds on rank 0; 0 elsewhere).
        """
        rng = gather_rng_states(self.env)  # every rank's generators, on rank 0 too
        path = os.path.join(self.dir, checkpoint_name(step, self.fmt))
        if accuracy is not None and (self.best is None or accuracy > self.best["accuracy"]):
            self.best = {"step": step, "accuracy": accuracy, "path": path}
        info = {"path": path, "bytes": 0, "seconds": 0.0}
        t0 = time.perf_counter()
        state = {**state, "rng": rng, "accuracy": accuracy, "best": self.best}
        if self.fmt == "dcp":
            from ddp_lab import dcp

            rest = {k: v for k, v in state.items() if k not in ("model", "optimizer")}
            info["bytes"] = dcp.save(path, self.model, self.optimizer, rest, self.env)
        elif self.env.is_rank0:
            data = encode(state)
            write_atomic(data, path)
            info["bytes"] = len(data)
        if self.env.is_rank0:
            keep = {self.best["path"]} if self.best else set()
            prune(self.dir, self.keep_last, keep)
            info["seconds"] = time.perf_counter() - t0
        if self.env.distributed:
            dist.barrier()  # nobody runs ahead of a checkpoint that may not exist yet
        return info

    def load_latest(self) -> dict | None:
        """The newest valid checkpoint, read by every rank onto its device (``None`` when
        there is none). Rank 0 picks the file (reporting corrupt ones in one line each) and
        tells the others. Restores this rank's RNG states and the best-so-far."""
        choice = [None]
        if self.env.is_rank0:
            choice[0] = newest_valid(self.dir, report=self._report)[0]
        if self.env.distributed:
            dist.broadcast_object_list(choice, src=0)
        if choice[0] is None:
            return None
        state = self._read(choice[0])
        rng = state["rng"]
        set_rng_state(rng[self.env.rank] if self.env.rank < len(rng) else rng[0])
        self.best = state.get("best")
        state["path"] = choice[0]
        return state

    def load_best(self) -> dict:
        """The best checkpoint's state (onto this rank's device).

        Raises:
            CorruptCheckpoint: when there is no best checkpoint, or it cannot be read.
        """
        if self.best is None:
            raise CorruptCheckpoint("no checkpoint with a validation accuracy yet")
        return self._read(self.best["path"])

    def _read(self, path: str) -> dict:
        """A checkpoint's state onto this rank's device; a DCP folder also restores the
        model and the optimizer in place (a collective)."""
        if not os.path.isdir(path):
            return read_checkpoint(path, map_location=self.env.device)
        from ddp_lab import dcp

        if self.model is None or self.optimizer is None:
            raise CorruptCheckpoint(f"{path} is a DCP folder: it loads into a model")
        return dcp.load(path, self.model, self.optimizer)

    def dropped(self, accuracy: float, drop_points: float) -> bool:
        """True when ``accuracy`` is more than ``drop_points`` percentage points below the
        best checkpoint's (the seeds' rule: restore the best one then). The drop is rounded
        to 1e-9 points first: 0.725 -> 0.675 is a drop of exactly 5 points, not of
        5.000000000000004, so it does not exceed ``--rollback-drop 5``.

        Example:
            >>> ck = Checkpoints.__new__(Checkpoints); ck.best = {"accuracy": 0.725}
            >>> ck.dropped(0.675, 5.0), ck.dropped(0.674, 5.0)
            (False, True)
        """
        if self.best is None:
            return False
        return round(100 * (self.best["accuracy"] - accuracy), 9) > drop_points

    def _report(self, line: str) -> None:
        print0(f"ddp_lab.checkpoint: {line}", env=self.env, file=sys.stderr)


@dataclass
class Position:
    """Where training is: optimizer steps done, the epoch, and the global samples of that
    epoch already read (the same number at every world size)."""

    step: int = 0
    epoch: int = 0
    samples: int = 0


def training_state(
    cfg: Config,
    env: DistEnv,
    pos: Position,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    scheduler,
    loader: torch.utils.data.DataLoader,
    evals: list[dict],
) -> dict:
    """Everything a bit-identical resume needs, as a checkpoint holds it (the RNG states of
    every rank are added by :meth:`Checkpoints.save`)."""
    return {
        "format": 1,
        "step": pos.step,
        "epoch": pos.epoch,
        "epoch_samples": pos.samples,
        "world_size": env.world_size,
        "global_batch": cfg.batch_size * env.world_size * cfg.accum_steps,
        "config": asdict(cfg),
        "model": getattr(model, "module", model).state_dict(),
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict(),
        "scheduler": scheduler.state_dict(),
        "loader_generator": loader.generator.get_state(),
        "evals": evals,
    }


def check_resumable(state: dict, cfg: Config, env: DistEnv, dataset_size: int) -> None:
    """Refuse a checkpoint written with other essential flags (:data:`MUST_MATCH`, and
    :data:`MUST_MATCH_GPT` for the transformer), in one
    line naming them; say so when the number of processes changed (the rest of the epoch
    is re-sharded).

    Raises:
        UsageError: the checkpoint's flags differ from ``cfg`` in an essential one.
    """
    old = state["config"]
    keys = MUST_MATCH + (MUST_MATCH_GPT if cfg.model == "gpt" else ())
    diff = [
        f"--{k.replace('_', '-')} {old.get(k)} (now {getattr(cfg, k)})"
        for k in keys
        if old.get(k) != getattr(cfg, k)
    ]
    if diff:
        raise UsageError(
            f"the checkpoint {state['path']} was written with {', '.join(diff)}; resume "
            "with the same flags, or start afresh with another --ckpt-dir"
        )
    if state["world_size"] != env.world_size:
        left = dataset_size - state["epoch_samples"]
        print0(
            f"ddp_lab.train: resuming a {state['world_size']}-process checkpoint on "
            f"{env.world_size} process(es): {left} remaining samples of epoch "
            f"{state['epoch']} are re-sharded over the new ranks",
            env=env,
            file=sys.stderr,
        )
