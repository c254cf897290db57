"""Faults on purpose, failures explained, and the restart timeline.

- **Injection** (``--fail-at-step N --fault KIND --fail-rank R``): at global step ``N``, on
  the first attempt only (``TORCHELASTIC_RESTART_COUNT`` 0, and no fault of this torchrun
  job in ``events.jsonl`` yet: with several agents a healthy agent restarts its workers
  with the count still 0), one rank fails in the way ``KIND`` says (see :data:`KINDS`), so
  a run restarted by ``torchrun --max-restarts`` does not fail again. Deterministic: same
  flags, same fault, same step.
- **Explanation**: a collective that times out (``--pg-timeout``) or loses a peer raises a
  backend error deep inside DDP. :meth:`Faults.explain` turns it into one line that names
  this rank, the collective and the step, and, for a timeout, the ranks that never arrived
  (each waiting rank leaves its mark in the process group's store).
- **Timeline** (``events.jsonl`` in ``--out``): process start, process group joined,
  checkpoint loaded, first step, checkpoints, rollbacks, the fault itself, the end; one JSON
  object per line with a wall-clock ``time``, for the restart timeline of lab 6.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

from ddp_lab.dist import DistEnv

#: The fault kinds of ``--fault`` and what each simulates.
KINDS = {
    "raise": "the rank raises an exception (a bug, a bad batch)",
    "sigkill": "the rank is killed by SIGKILL (out of memory, a lost machine)",
    "hang": "the rank stops without a word (a deadlock, a stuck read); the other ranks "
    "wait in their next collective until --pg-timeout",
    "inf": "the rank's gradients of that step are non-finite (an fp16 overflow): with "
    "--amp fp16 the scaler skips the step, without it the weights turn NaN",
    "scramble": "every rank's weights are reset to a fresh initialisation (a divergence; "
    "the test of --rollback-drop)",
}


class InjectedFault(RuntimeError):
    """The exception of ``--fault raise``."""


def attempt() -> int:
    """Which attempt this is: 0 first, then 1, 2, ... after torchrun restarts the group."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def run_id() -> str:
    """The torchrun job's id (``--rdzv-id``, or a fresh one per ``--standalone`` run)."""
    return os.environ.get("TORCHELASTIC_RUN_ID", "none")


def process_start_time() -> float:
    """Wall-clock time this process started (Linux ``/proc``; now, elsewhere)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


class Events:
    """``events.jsonl`` in ``out``: the moments of a run and of its restarts.

    Rank 0 writes (a fault is written by the faulting rank itself); each line is flushed
    and fsync'ed, so that it survives a SIGKILL right after. A fresh run (not ``--resume``)
    starts the file anew, unless this torchrun job already wrote to it (a restart).
    """

    def __init__(self, out: str, env: DistEnv, fresh: bool) -> None:
        self.path, self.env = os.path.join(out, "events.jsonl"), env
        if env.is_rank0:
            os.makedirs(out, exist_ok=True)
            if fresh and attempt() == 0 and not self._read(run_id()):
                open(self.path, "w").close()

    def _read(self, job: str) -> list[dict]:
        """The events of torchrun job ``job`` so far (none for a plain python run)."""
        if job == "none":
            return []
        try:
            with open(self.path) as f:
                lines = [json.loads(line) for line in f if line.strip()]
        except (OSError, ValueError):
            return []
        return [e for e in lines if e.get("run_id") == job]

    def log(self, event: str, everyone: bool = False, when: float | None = None, **fields):
        """Append ``{"event", "time", "rank", "attempt", **fields}`` (rank 0, or any rank
        with ``everyone``)."""
        if not (self.env.is_rank0 or everyone):
            return
        record = {
            "event": event,
            "time": time.time() if when is None else when,
            "rank": self.env.rank,
            "attempt": attempt(),
            "run_id": run_id(),
            **fields,
        }
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def fired(self, step: int) -> bool:
        """True when this torchrun job already logged a fault at ``step``: with several
        agents, a healthy agent restarts its workers with ``TORCHELASTIC_RESTART_COUNT``
        still 0, and its rank may now be the failing one."""
        return any(e["event"] == "fault" and e.get("step") == step for e in self._read(run_id()))


class Faults:
    """Fault injection at a global step, and the place the loop is at (for error lines).

    Args:
        at_step: the global step at which to fail (``None``: never).
        kind: one of :data:`KINDS`.
        rank: the rank that fails (ignored by ``scramble``, which hits every rank).
        env: this process's :class:`~ddp_lab.dist.DistEnv`.
        events: the run's :class:`Events`.
        pg_timeout: the process group's timeout in seconds (for the messages).
        rebuild: a function that returns a freshly initialised model (for ``scramble``).
    """

    def __init__(
        self,
        at_step: int | None,
        kind: str,
        rank: int,
        env: DistEnv,
        events: Events | None,
        pg_timeout: float,
        rebuild=None,
    ) -> None:
        self.at_step, self.kind, self.rank = at_step, kind, rank
        self.env, self.events, self.pg_timeout, self.rebuild = env, events, pg_timeout, rebuild
        self.where = "start-up"
        self._hook = None

    def at(self, where: str) -> None:
        """Say what the loop does now (named when a collective fails); ends an ``inf``."""
        self.where = where
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def before_step(self, step: int, model: torch.nn.Module) -> None:
        """Called before global step ``step`` (1-based) runs; fails here when due."""
        self.at(f"the gradient all-reduce of step {step}")
        due = self.at_step == step and attempt() == 0
        if not due or (self.kind != "scramble" and self.env.rank != self.rank):
            return
        if self.events is not None and self.events.fired(step):
            return  # this job failed here once already (another agent's first attempt)
        what = f"--fail-at-step {step} --fault {self.kind}"
        if self.events is not None:
            self.events.log("fault", everyone=True, step=step, kind=self.kind)
        if self.kind == "raise":
            raise InjectedFault(f"injected fault at step {step} ({what}, first attempt)")
        if self.kind == "sigkill":
            print(f"[rank {self.env.rank}] {what}: SIGKILL now", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if self.kind == "hang":
            print(
                f"[rank {self.env.rank}] {what}: this rank stops here; the others will time "
                f"out after --pg-timeout {self.pg_timeout:g} s",
                file=sys.stderr,
                flush=True,
            )
            threading.Event().wait()  # until the launcher ends this process
        if self.kind == "inf":
            inner = getattr(model, "module", model)
            self._hook = inner.register_forward_hook(lambda m, i, out: out * float("inf"))
        if self.kind == "scramble":
            getattr(model, "module", model).load_state_dict(self.rebuild().state_dict())

    def explain(self, err: BaseException) -> str | None:
        """One line for a failed collective (timeout, lost peer), or ``None`` when ``err``
        is something else."""
        text = str(err)
        lost = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
        timed_out = "imed out" in text or "Timeout" in text
        if not (
            isinstance(err, dist.DistBackendError) or timed_out or any(s in text for s in lost)
        ):
            return None
        first = text.strip().splitlines()[0] if text.strip() else type(err).__name__
        first = first.rsplit("] ", 1)[-1].split(". ")[0]  # the backend's own words, short
        if timed_out:
            missing = self._missing_ranks()
            who = f"; rank(s) {', '.join(map(str, missing))} never arrived" if missing else ""
            return (
                f"{self.where} timed out after --pg-timeout {self.pg_timeout:g} s{who}: a rank "
                "hung or took another code path (a collective in a rank-dependent branch, "
                "uneven data); its own log shows where it stopped. Debug with a short "
                f"--pg-timeout and TORCH_DISTRIBUTED_DEBUG=DETAIL ({first})"
            )
        return (
            f"{self.where} failed: a peer rank closed its connection (it crashed or was "
            "killed; its log and torchrun's summary name it). Under torchrun --max-restarts "
            f"the group restarts; --resume --ckpt-dir continues from a checkpoint ({first})"
        )

    def _missing_ranks(self, grace_s: float = 2.0) -> list[int] | None:
        """Ranks that did not also time out here: each waiting rank marks the store."""
        if not (self.env.distributed and dist.is_initialized()):
            return None
        try:
            store = dist.distributed_c10d._get_default_store()
            prefix = f"ddp_lab/timeout/{attempt()}/{self.where}"
            store.set(f"{prefix}/{self.env.rank}", "1")
            deadline = time.monotonic() + min(grace_s, self.pg_timeout)
            while True:
                missing = [
                    r for r in range(self.env.world_size) if not store.check([f"{prefix}/{r}"])
                ]
                if not missing or time.monotonic() > deadline:
                    return missing
                time.sleep(0.1)
        except Exception:  # the store itself may be gone with the failed rank
            return None
