"""How many bytes tensors hold on this rank: measured, not computed.

Four measures, each a sum of ``numel * element_size`` over real tensors (for a sharded
``DTensor``, FSDP's parameters and gradients, only this rank's local part):

- :func:`model_bytes`: a model's parameters and gradients;
- :func:`optimizer_bytes`: an optimizer's state tensors (AdamW's ``exp_avg`` and
  ``exp_avg_sq``; its 0-d ``step`` counters are left out, they are a few bytes);
- :func:`held_bytes`: every tensor reachable from any Python object (its attributes, lists,
  dicts, inner optimizers), counted by *storage*: a slice of a large tensor keeps the
  whole tensor alive, so it counts the whole; tensors named in ``exclude`` (the model's own
  parameters and gradients) do not count;
- :func:`saved_tensors` / :func:`saved_bytes`: the activations autograd keeps for the
  backward pass of one call (``module(x)``), caught as they are saved
  (``torch.autograd.graph.saved_tensors_hooks``), each storage once, the module's
  parameters left out. Works on the ``meta`` device too (sizes without memory).

Example:
    >>> import torch
    >>> from torch import nn
    >>> model = nn.Linear(3, 2)
    >>> model_bytes(model)
    {'params': 32, 'grads': 0}
    >>> held_bytes({"piece": torch.zeros(10)[:2]})  # the slice keeps all 10 numbers
    40
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Iterable

import torch
from torch import nn

#: How deep :func:`held_bytes` follows attributes, containers and their items.
MAX_DEPTH = 8


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: ``t.to_local()`` for a ``DTensor``, ``t`` itself otherwise.

    (``DTensor`` is looked up only once its module is loaded, by FSDP: without it there is
    none, and importing it would cost a second in every process.)
    """
    dtensor = sys.modules.get("torch.distributed.tensor")
    return t.to_local() if dtensor is not None and isinstance(t, dtensor.DTensor) else t


def nbytes(t: torch.Tensor | None) -> int:
    """``numel * element_size`` of this rank's part of ``t`` (0 for None).

    Example:
        >>> nbytes(torch.zeros(3, dtype=torch.float64))
        24
    """
    if t is None:
        return 0
    t = local(t)
    return t.numel() * t.element_size()


def model_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of this rank's parameters and gradients (None gradients count 0)."""
    params = list(model.parameters())
    return {
        "params": sum(nbytes(p) for p in params),
        "grads": sum(nbytes(p.grad) for p in params),
    }


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of an optimizer's state tensors on this rank, ``step`` counters left out.

    Works for plain optimizers, FSDP's (state held as ``DTensor``) and
    ``ZeroRedundancyOptimizer`` (whose own ``.optim`` holds this rank's state).
    """
    inner = getattr(optimizer, "optim", optimizer)
    return sum(
        nbytes(v)
        for per_param in inner.state.values()
        for k, v in per_param.items()
        if isinstance(v, torch.Tensor) and k != "step"
    )


def _storage(t: torch.Tensor) -> tuple[int, int]:
    s = local(t).untyped_storage()
    return s.data_ptr(), s.nbytes()


def held_bytes(obj, exclude: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of every tensor storage reachable from ``obj``, each storage counted once.

    Follows attributes (``__dict__``), dicts (keys and values), lists, tuples and sets, and a
    tensor's ``.grad``, up to :data:`MAX_DEPTH` levels. Storages of the ``exclude`` tensors
    do not count.

    Example:
        >>> w = torch.zeros(4)
        >>> held_bytes([w, w[1:], torch.ones(2)], exclude=[w])
        8
    """
    skip = {_storage(t)[0] for t in exclude if t is not None and local(t).numel()}
    seen_storages: dict[int, int] = {}
    seen_objects: set[int] = set()

    def visit(o, depth: int) -> None:
        if depth > MAX_DEPTH or id(o) in seen_objects:
            return
        seen_objects.add(id(o))
        if isinstance(o, torch.Tensor):
            if local(o).numel():
                ptr, size = _storage(o)
                if ptr not in skip:
                    seen_storages[ptr] = size
            if o.grad is not None:
                visit(o.grad, depth + 1)
            return
        if isinstance(o, dict):
            for k, v in o.items():
                visit(k, depth + 1)
                visit(v, depth + 1)
        elif isinstance(o, (list, tuple, set, frozenset)):
            for v in o:
                visit(v, depth + 1)
        elif hasattr(o, "__dict__") and not isinstance(o, (type, types.ModuleType)):
            for v in vars(o).values():
                visit(v, depth + 1)

    visit(obj, 0)
    return sum(seen_storages.values())


def saved_tensors(fn: Callable, *args, exclude: Iterable[torch.Tensor] = ()) -> list[dict]:
    """What autograd keeps for the backward pass of ``fn(*args)``: one row per distinct
    storage, in the order the forward saved them, ``{"shape", "dtype", "bytes", "times"}``
    (``bytes`` of the whole storage; ``times``: how often it was saved, by one or several
    operations). The parameters of ``fn`` (when it is a module) and the ``exclude`` tensors
    are not activations and are left out.

    Example:
        >>> layer = nn.Linear(4, 3)
        >>> x = torch.zeros(2, 4, requires_grad=True)
        >>> [(r["shape"], r["bytes"]) for r in saved_tensors(lambda t: layer(t).relu(), x,
        ...                                                  exclude=layer.parameters())]
        [((2, 4), 32), ((2, 3), 24)]
    """
    params = list(fn.parameters()) if isinstance(fn, nn.Module) else []
    skip = {t.untyped_storage()._cdata for t in [*params, *exclude]}
    rows: dict[int, dict] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage._cdata  # the storage itself: views share it (and on meta, too)
        if key not in skip:
            row = rows.setdefault(
                key,
                {"shape": tuple(t.shape), "dtype": t.dtype, "bytes": storage.nbytes(), "times": 0},
            )
            row["times"] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return list(rows.values())


def saved_bytes(fn: Callable, *args, exclude: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of every storage autograd keeps for the backward of ``fn(*args)``, each once,
    parameters left out (:func:`saved_tensors`).

    Example:
        >>> saved_bytes(torch.sigmoid, torch.zeros(10, requires_grad=True))  # its output
        40
    """
    return sum(row["bytes"] for row in saved_tensors(fn, *args, exclude=exclude))
