"""What a communication hook sends, recorded on a rank (exercise 3's checker).

:class:`Recorder` wraps every ``torch.distributed`` collective while it is installed and
notes, per call made inside a hook, its name, dtype, size, group size and bucket; and it
wraps a hook as DDP calls it, noting each bucket's size and what its Future gives back.
It only watches: every call then runs as it would.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import torch
import torch.distributed as dist

from ddp_lab.checks.guards import watched_collectives
from ddp_lab.checks.values import kind


class Recorder:
    """While installed, every ``torch.distributed`` collective called during a backward pass
    is recorded as ``[name, dtype, numbers, group size, bucket]`` (``bucket``: the index of
    the bucket whose hook this thread is running, -1 outside a hook) and then runs."""

    def __init__(self) -> None:
        self.calls: list | None = None  # this step's collectives (None: not recording)
        self.buckets: list = []  # this step's buckets, as the hook saw them
        self.here = threading.local()

    @contextmanager
    def installed(self):
        def note(name, args, kwargs):
            if self.calls is not None:
                self.calls.append(self._call(name, args, kwargs))

        with watched_collectives(note):
            yield self

    def _call(self, name: str, args, kwargs) -> list:
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        lists = [a for a in (*args, *kwargs.values()) if isinstance(a, list | tuple)]
        tensors += [t for a in lists for t in a if isinstance(t, torch.Tensor)]
        group = kwargs.get("group")
        if group is None:
            group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
        big = max(tensors, key=lambda t: t.numel(), default=None)
        dtype = str(big.dtype).removeprefix("torch.") if big is not None else "none"
        size = dist.get_world_size(group)
        return [name, dtype, 0 if big is None else big.numel(), size, getattr(self.here, "b", -1)]

    def watch(self, hook):
        """``hook`` as DDP calls it: each bucket's size and its Future's value are noted in
        :attr:`buckets` (the current step's list)."""

        def watched(state, bucket):
            note = {"index": bucket.index(), "numel": bucket.buffer().numel(), "value": "<none>"}
            self.buckets.append(note)
            self.here.b = bucket.index()
            try:
                fut = hook(state, bucket)
            finally:
                self.here.b = -1
            if not isinstance(fut, torch._C.Future):  # what .then() and get_future() give
                what = fut if isinstance(fut, torch.Tensor) else f"<{type(fut).__name__}>"
                raise TypeError(
                    f"your hook returned {kind(what)}: it must return a torch.futures.Future "
                    "whose value is the bucket's averaged gradients"
                )

            def seen(f):
                value = f.value()
                if isinstance(value, torch.Tensor):
                    note["value"] = [str(value.dtype).removeprefix("torch."), value.numel()]
                else:
                    note["value"] = f"<{type(value).__name__}>"
                return value

            return fut.then(seen)

        return watched
