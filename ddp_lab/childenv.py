"""The environment every child process of the course gets: one contract, one place.

The launcher's torchrun workers, the grader's student and judge processes, and the tests'
subprocesses all start from :func:`child_env`:

- ``OMP_NUM_THREADS=1`` unless the caller set it: N processes share the cores, and N
  processes x all cores oversubscribe a laptop;
- ``PYTHONUNBUFFERED=1``: workers write line by line, so per-rank logs can be followed live
  and nothing is lost when a process is killed;
- ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: without it, restarted gloo workers hang in
  rendezvous (torchrun ``--max-restarts``);
- ``MPLBACKEND=Agg``: no window is ever opened by a child;
- the folder that holds this ``ddp_lab`` first on ``PYTHONPATH``, so children import the
  same package as their parent, whatever their working folder;
- optionally without torchrun's variables (``RANK``, ``WORLD_SIZE``, ...), so that a child
  of a worker does not believe it is part of the parent's job.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

#: The folder that holds the ``ddp_lab`` package (the repository, or the student kit).
PACKAGE_PARENT = str(Path(__file__).resolve().parent.parent)

#: Variables torchrun sets for its workers.
TORCHRUN_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_RUN_ID",
)


def child_env(
    extra: Mapping[str, str] | None = None,
    *,
    base: Mapping[str, str] | None = None,
    drop_torchrun: bool = False,
    drop_prefixes: tuple[str, ...] = (),
) -> dict[str, str]:
    """The environment for a child process.

    Args:
        extra: variables to add or override (after the defaults below, except that an
            ``OMP_NUM_THREADS`` given here or in ``base`` is kept).
        base: the environment to start from (default: this process's).
        drop_torchrun: remove torchrun's variables (:data:`TORCHRUN_VARS`).
        drop_prefixes: remove every variable whose name starts with one of these
            (e.g. ``("JPY_", "NBGRADER_")`` for processes the grader starts).

    Returns:
        A new dict.

    Example:
        >>> env = child_env({"X": "1"}, base={"RANK": "3"}, drop_torchrun=True)
        >>> env["OMP_NUM_THREADS"], env["X"], "RANK" in env
        ('1', '1', False)
    """
    env = dict(os.environ if base is None else base)
    if drop_prefixes:
        env = {k: v for k, v in env.items() if not k.startswith(drop_prefixes)}
    if drop_torchrun:
        for name in TORCHRUN_VARS:
            env.pop(name, None)
    env.update(extra or {})
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    env.setdefault("MPLBACKEND", "Agg")
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if PACKAGE_PARENT not in paths:
        env["PYTHONPATH"] = os.pathsep.join([PACKAGE_PARENT, *paths])
    return env
