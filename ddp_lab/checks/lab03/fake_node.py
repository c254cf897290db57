"""The environments in which lab 3's checks call a student's ``setup()``.

``setup()`` chooses the backend and the device from what the machine has. So that a right
solution gets the same verdict on every host (a laptop, a GPU grading machine), the checker
never lets it see the real GPUs:

- :func:`no_cuda`: CUDA reported unavailable (the run that really trains, with gloo);
- :func:`gpu_node`: a faked rank of a multi-node GPU job (``RANK`` different from
  ``LOCAL_RANK``, CUDA reported available with a few devices). Nothing runs on a GPU:
  ``torch.cuda.set_device`` and ``dist.init_process_group`` only record their calls, and
  ``dist.get_rank()`` / ``get_world_size()`` answer what the faked job would.

Both patch only the checker's own process, for the duration of the student's call.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from unittest import mock

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

#: The faked job: 2 nodes of 4 GPUs; the checker's rank r plays local rank r + 1 of node 1.
GPUS_PER_NODE, NODES = 4, 2


def node_env(rank: int) -> dict[str, str]:
    """torchrun's variables for the checker's rank ``rank`` playing a rank of node 1.

    Example:
        >>> node_env(0)["RANK"], node_env(0)["LOCAL_RANK"]
        ('5', '1')
    """
    local = rank % (GPUS_PER_NODE - 1) + 1
    return {
        "RANK": str(GPUS_PER_NODE + local),
        "LOCAL_RANK": str(local),
        "WORLD_SIZE": str(GPUS_PER_NODE * NODES),
        "LOCAL_WORLD_SIZE": str(GPUS_PER_NODE),
        "GROUP_RANK": "1",
        "NODE_RANK": "1",
        "MASTER_ADDR": "node0",
        "MASTER_PORT": "29500",
    }


def device_index(device) -> int | None:
    """The GPU index of what a student passed as a device (``1``, ``"cuda:1"``,
    ``torch.device("cuda", 1)``); None when it names none.

    Example:
        >>> device_index("cuda:2"), device_index(torch.device("cuda", 1)), device_index("cuda")
        (2, 1, None)
    """
    if isinstance(device, bool):
        return None
    if isinstance(device, int):
        return device
    try:
        return torch.device(device).index
    except (TypeError, RuntimeError, ValueError):
        return None


@contextmanager
def no_cuda() -> Iterator[None]:
    """While the block runs, ``torch.cuda.is_available()`` is False and there is no GPU."""
    with (
        mock.patch.object(torch.cuda, "is_available", lambda: False),
        mock.patch.object(torch.cuda, "device_count", lambda: 0),
    ):
        yield


@contextmanager
def gpu_node(env: dict[str, str], calls: list) -> Iterator[None]:
    """While the block runs, this process is a faked rank of a GPU job (see the module
    docstring); ``calls`` receives ``["set_device", index]``, ``["init", backend, device_id
    index]`` and ``["destroy"]``."""
    state = {"joined": False, "device": 0}

    def set_device(device) -> None:
        index = device_index(device)
        calls.append(["set_device", -1 if index is None else index])
        if index is not None:
            state["device"] = index

    def init(*args, **kwargs) -> None:
        backend = args[0] if args else kwargs.get("backend")
        device_id = device_index(kwargs["device_id"]) if kwargs.get("device_id") else None
        calls.append(
            [
                "init",
                "" if backend is None else str(backend),
                -1 if device_id is None else device_id,
            ]
        )
        state["joined"] = True

    def destroy(*args, **kwargs) -> None:
        calls.append(["destroy"])
        state["joined"] = False

    fakes = {
        "init_process_group": init,
        "destroy_process_group": destroy,
        "is_initialized": lambda: state["joined"],
        "get_rank": lambda group=None: int(env["RANK"]),
        "get_world_size": lambda group=None: int(env["WORLD_SIZE"]),
    }
    patches = [mock.patch.object(dist, name, fake) for name, fake in fakes.items()]
    patches += [mock.patch.object(c10d, name, fake) for name, fake in fakes.items()]
    patches += [
        mock.patch.dict(os.environ, env),
        mock.patch.object(torch.cuda, "is_available", lambda: True),
        mock.patch.object(torch.cuda, "device_count", lambda: GPUS_PER_NODE),
        mock.patch.object(torch.cuda, "set_device", set_device),
        mock.patch.object(torch.cuda, "current_device", lambda: state["device"]),
    ]
    for p in patches:
        p.start()
    try:
        yield
    finally:
        for p in reversed(patches):
            p.stop()
