"""A slow network for lab 3's own DDP wrappers: real sums, simulated time, every call counted.

The checks of exercises 4 and 5 (and the notebook's overlap measurement) replace
``dist.all_reduce`` by :meth:`SlowNetwork.all_reduce` in the checker's own rank process:

- the *sum is real*: every call all-reduces a copy of the tensor at once with the real gloo
  collective (so the ranks pair their calls exactly as they would);
- the *time is simulated*: a message occupies one link for ``latency`` seconds, one message
  after the other. With ``async_op=True`` the call returns at once and the result lands in
  the caller's tensor when the caller waits for it (``work.wait()``, or the work's future),
  never earlier: as with NCCL, the tensor holds the sum only after the wait, so dividing
  before it is lost, whatever the timing. With ``sync=True`` every call blocks until its
  message is through: what the same code costs when nothing overlaps;
- every call is *recorded*: the step, the number of elements, the dtype, and when it
  started relative to the step (:meth:`SlowNetwork.begin_step`).

:class:`Compute` is the backward pass's stand-in for real work: an identity whose backward
sleeps, so that the time a backward pass takes does not depend on how loaded the machine is.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

_real_all_reduce = dist.all_reduce  # taken before any student code runs


class _Work:
    """What the slow ``all_reduce(..., async_op=True)`` returns: the result lands in the
    tensor at :meth:`wait` (or when the future completes), not before."""

    def __init__(self, tensor: torch.Tensor, result: torch.Tensor, done_at: float):
        self._tensor, self._result, self._done_at = tensor, result, done_at
        self._landed = False
        self._lock = threading.Lock()

    def _land(self) -> None:
        with self._lock:
            if not self._landed:
                with torch.no_grad():
                    self._tensor.copy_(self._result)
                self._landed = True

    def wait(self, timeout=None) -> bool:
        """Sleep until the message is through; then the tensor holds the sum."""
        delay = self._done_at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        self._land()
        return True

    def is_completed(self) -> bool:
        """True once the message is through (the tensor then holds the sum)."""
        if time.perf_counter() >= self._done_at:
            self._land()
            return True
        return False

    def is_success(self) -> bool:
        return self.is_completed()

    def exception(self):
        return None

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return [self._tensor]

    def synchronize(self) -> None:
        self.wait()

    def get_future(self) -> torch.futures.Future:
        """A future that completes (with ``[tensor]``) when the message is through."""
        fut: torch.futures.Future = torch.futures.Future()

        def complete() -> None:
            self._land()
            fut.set_result([self._tensor])

        timer = threading.Timer(max(0.0, self._done_at - time.perf_counter()), complete)
        timer.daemon = True
        timer.start()
        return fut


class SlowNetwork:
    """``dist.all_reduce`` with simulated time (see the module docstring).

    Attributes:
        latency: seconds each message occupies the link (0: no delay, results still land
            only when waited for).
        sync: every call blocks until its message is through (no overlap possible).
        calls: ``[step, numel, dtype name, seconds since the step began, async_op]`` per call.

    Example:
        >>> net = SlowNetwork(latency=0.01)
        >>> with net.installed():  # doctest: +SKIP
        ...     work = dist.all_reduce(t, async_op=True)  # returns at once
        ...     work.wait()  # about 10 ms later: t holds the sum
    """

    def __init__(self, latency: float = 0.0, sync: bool = False):
        self.latency, self.sync = latency, sync
        self.calls: list[list] = []
        self.step = -1
        self._step_start = time.perf_counter()
        self._link_free = 0.0

    def reset(self, latency: float = 0.0, sync: bool = False) -> None:
        """Forget every call; set the link's ``latency`` and whether calls block."""
        self.latency, self.sync = latency, sync
        self.calls, self.step = [], -1

    def begin_step(self) -> float:
        """Start counting a new step (its calls and times); returns the step's start time."""
        self.step += 1
        self._step_start = time.perf_counter()
        self._link_free = self._step_start
        return self._step_start

    def since_step(self) -> float:
        """Seconds since :meth:`begin_step`."""
        return time.perf_counter() - self._step_start

    def calls_of(self, step: int) -> list[list]:
        """The calls made during ``step``."""
        return [c for c in self.calls if c[0] == step]

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        """The real sum of a copy, now; the simulated message; the result at the wait."""
        now = time.perf_counter()
        self.calls.append(
            [self.step, int(tensor.numel()), str(tensor.dtype), now - self._step_start, async_op]
        )
        result = tensor.detach().clone()
        _real_all_reduce(result, op=op, group=group)
        start = max(now, self._link_free)
        self._link_free = done_at = start + self.latency
        work = _Work(tensor, result, done_at)
        if self.sync or not async_op:
            work.wait()
        return work if async_op else None

    @contextmanager
    def installed(self) -> Iterator[SlowNetwork]:
        """While the block runs, ``dist.all_reduce`` (in ``torch.distributed`` and in
        ``distributed_c10d``) is :meth:`all_reduce`."""
        import torch.distributed.distributed_c10d as c10d

        saved = [(m, m.all_reduce) for m in (dist, c10d)]
        for module, _ in saved:
            module.all_reduce = self.all_reduce
        try:
            yield self
        finally:
            for module, value in saved:
                module.all_reduce = value


class Compute(torch.autograd.Function):
    """Identity in forward; its backward sleeps ``seconds``: the compute time of a layer's
    backward, the same on a busy machine and an idle one."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        time.sleep(ctx.seconds)
        return grad, None


class SlowBackwardNet(nn.Module):
    """``layers`` linear layers of ``width`` units; between two layers the backward pass
    computes for ``seconds`` (:class:`Compute`), so gradients become ready layer by layer,
    the last layer's first."""

    def __init__(self, layers: int, width: int, seconds: float):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            if i:
                x = Compute.apply(torch.tanh(x), self.seconds)
            x = layer(x)
        return x


def measure_step(wrapper: nn.Module, x: torch.Tensor, net: SlowNetwork, sync: bool) -> dict:
    """One step of a DDP-like ``wrapper`` (``forward -> backward -> wrapper.finish()``) on
    ``net``'s link, its calls blocking (``sync``) or not.

    Returns:
        ``{"step": seconds, "end": seconds when backward returned, "calls": [[seconds since
        the step began, elements, async_op], ...]}``.
    """
    net.reset(net.latency, sync)
    for p in wrapper.parameters():
        p.grad = None
    start = net.begin_step()
    wrapper(x).square().mean().backward()
    end = net.since_step()
    wrapper.finish()
    took = time.perf_counter() - start
    return {"step": took, "end": end, "calls": [[c[3], c[1], bool(c[4])] for c in net.calls]}


def best_steps(wrapper: nn.Module, x: torch.Tensor, net: SlowNetwork, reps: int = 3) -> dict:
    """The fastest of ``reps`` steps (after one to warm up) with the link's calls returning
    at once (``"overlapped"``) and blocking (``"blocking"``), the two interleaved so that a
    busy machine slows both alike."""
    best: dict = {}
    for rep in range(reps + 1):
        for mode, sync in (("overlapped", False), ("blocking", True)):
            got = measure_step(wrapper, x, net, sync)
            if rep and (mode not in best or got["step"] < best[mode]["step"]):
                best[mode] = got
    return best
