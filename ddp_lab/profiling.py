"""``--profile DIR``: where a distributed step's time goes, as a trace per rank.

:class:`StepProfiler` runs ``torch.profiler`` over a few chosen optimizer steps (``wait``
steps skipped, ``warmup`` steps recorded and thrown away, ``active`` steps kept: the
profiler's own ``schedule``) and writes every rank's trace as Chrome trace JSON
(``DIR/trace-rank<r>.json``), which Perfetto (ui.perfetto.dev) and TensorBoard open. The
trainer marks its phases with ``record_function`` ranges: ``ddp_lab: data``, ``ddp_lab:
forward``, ``ddp_lab: backward``, ``ddp_lab: optimizer``, and one ``ddp_lab: all_reduce
bucket <i>`` per DDP bucket and step (where the comm hook launches it); the backend's own
events (``gloo:all_reduce`` on CPU, NCCL kernels on CUDA) show when the bytes actually
moved. Memory is recorded too (``profile_memory``); on CUDA the CUDA activity as well.

Profiling reads, it never changes the run: the same weights bit for bit with and without
``--profile`` (``tests/test_profiling.py``).

Example:
    >>> prof = StepProfiler(None, rank=0, device_type="cpu")  # off: every call is a no-op
    >>> with prof.range("forward"):
    ...     pass
    >>> prof.step(); prof.close()
"""

from __future__ import annotations

import contextlib
import os

import torch
from torch.profiler import ProfilerActivity, record_function, schedule

#: The trainer's range names (the figure and the tests read them).
PREFIX = "ddp_lab: "
PHASES = ("data", "forward", "backward", "optimizer")
BUCKET = PREFIX + "all_reduce bucket "
#: name prefixes of the backends' collective events (gloo on CPU, NCCL kernels on CUDA)
COLLECTIVE_PREFIXES = ("gloo:", "nccl:", "ncclDevKernel", "ncclKernel")
#: Default schedule: skip 2 steps (start-up), warm up 1, keep 3.
DEFAULT_SCHEDULE = (2, 1, 3)


def parse_schedule(text: str) -> tuple[int, int, int]:
    """``"2,1,3"`` -> ``(wait, warmup, active)`` (raises ValueError when it is not three
    integers >= 0 with active >= 1).

    Example:
        >>> parse_schedule("0,1,2")
        (0, 1, 2)
    """
    parts = tuple(int(v) for v in text.split(","))
    if len(parts) != 3 or min(parts) < 0 or parts[2] < 1:
        raise ValueError(f"expected WAIT,WARMUP,ACTIVE (active >= 1), got {text!r}")
    return parts  # type: ignore[return-value]


def trace_path(folder: str, rank: int) -> str:
    """Where rank ``rank``'s trace goes."""
    return os.path.join(folder, f"trace-rank{rank}.json")


class StepProfiler:
    """``torch.profiler`` over the steps of :data:`DEFAULT_SCHEDULE` (or ``steps``), or
    nothing at all when ``folder`` is None.

    Args:
        folder: where the traces go (created), or None for no profiling.
        rank: this process's rank (names its trace).
        device_type: ``"cuda"`` adds CUDA activity.
        steps: ``(wait, warmup, active)`` optimizer steps.
    """

    def __init__(
        self,
        folder: str | None,
        rank: int,
        device_type: str,
        steps: tuple[int, int, int] = DEFAULT_SCHEDULE,
    ) -> None:
        self.folder, self.rank, self.written = folder, rank, None
        self._prof = None
        if folder is None:
            return
        os.makedirs(folder, exist_ok=True)
        activities = [ProfilerActivity.CPU]
        if device_type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        wait, warmup, active = steps
        self._prof = torch.profiler.profile(
            activities=activities,
            schedule=schedule(wait=wait, warmup=warmup, active=active, repeat=1),
            on_trace_ready=self._write,
            record_shapes=True,
            profile_memory=True,
        )
        self._prof.start()

    @property
    def enabled(self) -> bool:
        return self._prof is not None

    def range(self, name: str):
        """A ``record_function`` range named ``ddp_lab: <name>`` (a no-op when off)."""
        return record_function(PREFIX + name) if self._prof else contextlib.nullcontext()

    def step(self) -> None:
        """One optimizer step done (advances the schedule)."""
        if self._prof is not None:
            self._prof.step()

    def close(self) -> None:
        """Stop; a run shorter than the schedule still writes what it recorded."""
        if self._prof is not None:
            self._prof.stop()
            self._prof = None

    def _write(self, prof) -> None:
        self.written = trace_path(self.folder, self.rank)
        prof.export_chrome_trace(self.written)
