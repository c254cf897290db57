"""Turning what student code returned into plain, saveable values, and drawing inputs.

The student's process saves its outputs with ``torch.save`` and the judge loads them with
``weights_only=True``, which only accepts tensors, numbers, strings, lists and dicts: student
objects are turned into those here (:func:`plain`). Inputs are drawn from a
``torch.Generator`` that the grader seeds at grading time (:func:`randint`, :func:`uniform`).
Parameter dicts (name -> tensor) are compared with :func:`max_diff` and :func:`same_bits`.
"""

from __future__ import annotations

import math

import torch


def plain(value):
    """``value`` made saveable: detached tensor copies, numbers, strings, None, and lists and
    dicts of those; anything else becomes a tag ``"<TypeName>"`` that messages can name.

    Example:
        >>> plain((torch.ones(1, requires_grad=True), 2, object()))
        [tensor([1.]), 2, '<object>']
    """
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if hasattr(value, "tolist") and hasattr(value, "dtype"):  # numpy arrays and scalars
        return torch.as_tensor(value.tolist(), dtype=torch.float64)
    return f"<{type(value).__name__}>"


def kind(value) -> str:
    """A few words on what ``value`` is, for messages (``a tensor of shape (2,)``, ``a list``).

    Example:
        >>> kind(torch.zeros(2)), kind("<generator>"), kind(3)
        ('a tensor of shape (2,)', 'a generator', 'a int')
    """
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, str) and value.startswith("<") and value.endswith(">"):
        return f"a {value.strip('<>')}"
    return f"a {type(value).__name__}"


def number(value) -> float:
    """A student's scalar as a float (a one-element tensor counts); ``nan`` when it is none.

    Example:
        >>> number(torch.tensor([2.5])), math.isnan(number("x"))
        (2.5, True)
    """
    if isinstance(value, torch.Tensor):
        return float(value.reshape(()).item()) if value.numel() == 1 else math.nan
    if isinstance(value, bool):
        return math.nan
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def first(items, k: int = 6) -> str:
    """The first ``k`` items, comma-separated, ``...`` when there are more.

    Example:
        >>> first(range(10), 3)
        '0, 1, 2, ...'
    """
    items = list(items)
    return ", ".join(str(i) for i in items[:k]) + (", ..." if len(items) > k else "")


def randint(gen: torch.Generator, low: int, high: int) -> int:
    """A random int in ``[low, high]`` (both ends included).

    Example:
        >>> randint(torch.Generator().manual_seed(0), 3, 3)
        3
    """
    return int(torch.randint(low, high + 1, (1,), generator=gen))


def uniform(gen: torch.Generator, low: float, high: float) -> float:
    """A random float in ``[low, high)``.

    Example:
        >>> 1.0 <= uniform(torch.Generator().manual_seed(0), 1.0, 2.0) < 2.0
        True
    """
    return low + (high - low) * float(torch.rand(1, generator=gen, dtype=torch.float64))


def log_uniform(gen: torch.Generator, low: float, high: float) -> float:
    """A random float between ``low`` and ``high``, uniform on a log scale.

    Example:
        >>> 1e-3 <= log_uniform(torch.Generator().manual_seed(0), 1e-3, 1.0) <= 1.0
        True
    """
    return math.exp(uniform(gen, math.log(low), math.log(high)))


def max_diff(a, b) -> float:
    """Largest absolute difference between two parameter dicts (``inf`` when they do not
    match in names or shapes, or hold a non-finite value).

    Example:
        >>> max_diff({"w": torch.ones(2)}, {"w": torch.tensor([1.0, 1.5])})
        0.5
    """
    if not isinstance(a, dict) or not isinstance(b, dict) or set(a) != set(b):
        return math.inf
    worst = 0.0
    for k in b:
        x, y = a[k], b[k]
        if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
            return math.inf
        if x.shape != y.shape:
            return math.inf
        d = (x.double() - y.double()).abs()
        if not bool(torch.isfinite(d).all()):
            return math.inf
        worst = max(worst, float(d.max()) if d.numel() else 0.0)
    return worst


def same_bits(a, b) -> bool:
    """True when two parameter dicts hold the same tensors bit for bit: same names, dtypes,
    shapes and bytes (a NaN equals the same NaN).

    Example:
        >>> nan = torch.tensor([float("nan")])
        >>> same_bits({"w": nan}, {"w": nan.clone()}), same_bits({"w": nan}, {"w": nan.half()})
        (True, False)
    """
    if not isinstance(a, dict) or not isinstance(b, dict) or set(a) != set(b):
        return False

    def raw(t: torch.Tensor) -> torch.Tensor:
        return t.detach().contiguous().reshape(-1).view(torch.uint8)

    return all(
        isinstance(a[k], torch.Tensor)
        and isinstance(b[k], torch.Tensor)
        and a[k].dtype == b[k].dtype
        and a[k].shape == b[k].shape
        and bool(torch.equal(raw(a[k]), raw(b[k])))
        for k in b
    )
