"""Launching the real jobs that exercises 1 and 2 read: one ``torchrun`` launch, several jobs.

A module that records jobs (:mod:`~ddp_lab.checks.lab08.trace_jobs`,
:mod:`~ddp_lab.checks.lab08.straggler_jobs`) gives :func:`worker` its ``train(spec, group,
rank, folder) -> events``; :func:`launch` runs it under ``torchrun`` on as many ranks as the
largest job has. Each job gets a process group of its own (ranks ``0 .. world_size - 1``),
so a rank outside a job's group goes on to the next job's group; every rank's events come
back per job, rank 0 first. A launch of the same specs again in one process (the tests'
fixed seeds) returns what the first one recorded.
"""

from __future__ import annotations

import copy
import datetime
import json
import signal
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

#: the keys every kept event has (``args`` dropped: the traces stay small)
KEYS = ("name", "ph", "ts", "dur", "tid", "pid", "cat")
LAUNCH_S = 120.0
GROUP_S = 60.0
#: A launch whose worker died of one of these signals is run again, :data:`RETRIES` times at
#: most. Kineto's profiler now and then kills a worker of these jobs (the grader's own DDP
#: loops, no student code): measured, 2 launches of 80 with two launches at a time on 2
#: cores, SIGSEGV or SIGABRT; the same before and after the course's changes around it.
CRASHES = (-signal.SIGSEGV, -signal.SIGABRT)
RETRIES = 2
#: (module, specs as JSON) -> per job, every rank's events: the launches of this process
_RECORDED: dict[tuple[str, str], list] = {}


def complete_events(path: str | Path) -> list[dict]:
    """The complete events (``"ph": "X"``) of a Chrome trace file, with :data:`KEYS` only."""
    trace = json.loads(Path(path).read_text())
    keep = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    return [{k: e[k] for k in KEYS if k in e} for e in keep]


def worker(specs_path: str, out_dir: str, train: Callable) -> None:
    """One rank of a launch: every job in turn, on a process group of its own."""
    torch.set_num_threads(1)
    specs = torch.load(specs_path, weights_only=True)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=LAUNCH_S))
    rank = dist.get_rank()
    events: list = []
    for i, spec in enumerate(specs):
        members = list(range(spec["world_size"]))
        group = dist.new_group(members, timeout=datetime.timedelta(seconds=GROUP_S))
        if rank not in members:
            events.append(None)
            continue
        folder = Path(out_dir) / f"job{i}"
        folder.mkdir(exist_ok=True)
        events.append(train(spec, group, rank, folder))
        dist.barrier(group=group)
    torch.save(events, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def launch(module: str, specs: list[dict]) -> list[list[list[dict]]]:
    """Run ``python -m module SPECS OUT`` under torchrun (the module calls :func:`worker`);
    per job, every rank's events."""
    from ddp_lab.launch import LaunchFailed, torchrun
    from ddp_lab.launch.messages import first_failure

    key = (module, json.dumps(specs, sort_keys=True))
    if key not in _RECORDED:
        nproc = max(s["world_size"] for s in specs)
        with tempfile.TemporaryDirectory(prefix="ddp_lab-jobs-") as tmp:
            torch.save(specs, Path(tmp) / "specs.pt")
            for attempt in range(RETRIES + 1):
                try:
                    torchrun(
                        module,
                        [str(Path(tmp) / "specs.pt"), tmp],
                        nproc=nproc,
                        module=True,
                        timeout=LAUNCH_S,
                        stream=False,
                    )
                    break
                except LaunchFailed as err:  # the profiler's crash: record again
                    if attempt == RETRIES or first_failure(err.result)[1] not in CRASHES:
                        raise
            ranks = [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=True) for r in range(nproc)]
        _RECORDED[key] = [
            [ranks[r][i] for r in range(s["world_size"])] for i, s in enumerate(specs)
        ]
    return copy.deepcopy(_RECORDED[key])
