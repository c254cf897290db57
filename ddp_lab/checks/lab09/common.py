"""What lab 9's exercises share: the lab's name, its files, and counting collectives."""

from __future__ import annotations

from collections import Counter

from ddp_lab.checks.lab07.common import DTYPES, WATCHDOG_S, randn

__all__ = [
    "DTYPES",
    "FSDP_FILE",
    "LAB",
    "MESH_FILE",
    "PLAN_FILE",
    "WATCHDOG_S",
    "collectives",
    "randn",
]

LAB = "lab09_fsdp_dtensor"

#: Files the notebook's distributed solution cells write (``%%writefile``).
FSDP_FILE, PLAN_FILE, MESH_FILE = "fsdp.py", "tp_plan.py", "mesh2d.py"


def collectives(mode) -> dict[str, int]:
    """The collectives a ``CommDebugMode`` saw, by name (``all_reduce``, ``all_gather``,
    ``reduce_scatter``, ...): DTensor's functional collectives and ``torch.distributed``'s
    (``allreduce_``, ``_allgather_base_``, ``_reduce_scatter_base_``) added up together."""
    out: Counter = Counter()
    for op, n in mode.get_comm_counts().items():
        name = str(op).split(".")[-1].strip("_").replace("_base", "")
        for short in ("all_reduce", "all_gather", "reduce_scatter"):
            if name.replace("_", "").startswith(short.replace("_", "")):
                name = short
        out[name] += n
    return dict(out)
