"""What a failed check is, and the comparisons every check uses.

This module imports nothing of the grader (``ddp_lab.grading``) and nothing of a lab: the
visible checks in the student kit, the grader's judge process and the tests all use it.
A check either prints one ``OK: ...`` line (:func:`passed`) or raises :class:`CheckFailed`
with a message that says what was expected and what came back.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Mapping

import torch

#: Longest line of a failure as the notebook shows it. nbgrader's Validate indents each line
#: by 4 and cuts it past 87 characters (``Validator.width`` 90, minus 3), and its dialog does
#: not wrap: shorter lines are shown whole.
WIDTH = 80


class CheckFailed(AssertionError):
    """A check that did not hold; the message says what was expected and what came back.

    In a notebook it shows as that message alone, wrapped (IPython asks an exception for
    ``_render_traceback_`` before it formats frames): the student reads what is wrong, not
    the checker's source. It is still an error output, so nbgrader's Validate lists the cell.
    """

    def _render_traceback_(self) -> list[str]:
        lines = render(str(self))
        lines[0] = lines[0].replace("CheckFailed:", "\x1b[0;31mCheckFailed\x1b[0m:", 1)
        return lines


def render(message: str) -> list[str]:
    """The lines of a failed check as a notebook shows them: ``CheckFailed: message``, wrapped.

    Example:
        >>> render("expected 3 samples in shard 0, got 2")
        ['CheckFailed: expected 3 samples in shard 0, got 2']
        >>> [len(line) for line in render("word " * 40)]
        [77, 76, 61]
    """
    lines: list[str] = []
    for i, paragraph in enumerate(message.strip().splitlines() or [""]):
        first = "CheckFailed: " if i == 0 else ""
        lines += textwrap.wrap(
            first + paragraph, WIDTH, subsequent_indent="  ", break_on_hyphens=False
        ) or [""]
    return lines


def passed(message: str) -> None:
    """Print a success line for a check (stdout, short).

    Example:
        >>> passed("the sum is right")
        OK: the sum is right
    """
    print(f"OK: {message}")


def require(condition: bool, message: str) -> None:
    """Raise :class:`CheckFailed` with ``message`` unless ``condition`` holds.

    Example:
        >>> require(1 + 1 == 2, "arithmetic")
    """
    if not condition:
        raise CheckFailed(message)


def is_close(got, expected: torch.Tensor, atol: float = 1e-6, rtol: float = 1e-5) -> bool:
    """True when ``got`` is a finite tensor of ``expected``'s shape within ``atol + rtol*|e|``.

    Example:
        >>> is_close(torch.ones(2), torch.ones(2)), is_close([1.0, 1.0], torch.ones(2))
        (True, False)
    """
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(expected.shape):
        return False
    g, e = got.detach().double().cpu(), expected.detach().double().cpu()
    return bool(torch.isfinite(g).all()) and bool(((g - e).abs() <= atol + rtol * e.abs()).all())


def all_close(got, expected, atol: float = 1e-6, rtol: float = 1e-5) -> bool:
    """:func:`is_close` for every pair of two lists (or two dicts with the same keys).

    Example:
        >>> all_close([torch.ones(1)], [torch.ones(1)]), all_close({"a": 1}, {"b": 1})
        (True, False)
    """
    if isinstance(expected, Mapping):
        if not isinstance(got, Mapping) or set(got) != set(expected):
            return False
        return all(is_close(got[k], expected[k], atol, rtol) for k in expected)
    if not isinstance(got, (list, tuple)) or len(got) != len(expected):
        return False
    return all(is_close(g, e, atol, rtol) for g, e in zip(got, expected, strict=True))


def max_abs_diff(got, expected) -> float:
    """Largest absolute difference between two tensors, lists or dicts of tensors (``inf``
    when shapes, lengths or keys differ, or a value is not finite).

    Example:
        >>> max_abs_diff({"w": torch.zeros(2)}, {"w": torch.tensor([0.0, 0.5])})
        0.5
    """
    if isinstance(expected, torch.Tensor):
        if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
            return math.inf
        d = (got.detach().double().cpu() - expected.detach().double().cpu()).abs()
        d = torch.nan_to_num(d, nan=math.inf)
        return float(d.max()) if d.numel() else 0.0
    if isinstance(expected, Mapping):
        if not isinstance(got, Mapping) or set(got) != set(expected):
            return math.inf
        return max((max_abs_diff(got[k], expected[k]) for k in expected), default=0.0)
    if not isinstance(got, (list, tuple)) or len(got) != len(expected):
        return math.inf
    return max((max_abs_diff(g, e) for g, e in zip(got, expected, strict=True)), default=0.0)


def assert_close(
    got, expected: torch.Tensor, what: str, atol: float = 1e-6, rtol: float = 1e-5
) -> None:
    """Check that ``got`` is a tensor of ``expected``'s shape with values close to it.

    Raises:
        CheckFailed: naming ``what``, the expected and received shapes or values, and the
            largest difference.

    Example:
        >>> assert_close(torch.ones(2), torch.ones(2), "the average")
    """
    if not isinstance(got, torch.Tensor):
        raise CheckFailed(f"{what}: expected a tensor, got {type(got).__name__}")
    if tuple(got.shape) != tuple(expected.shape):
        raise CheckFailed(f"{what}: expected shape {tuple(expected.shape)}, got {tuple(got.shape)}")
    got_d, exp_d = got.detach().double().cpu(), expected.detach().double().cpu()
    if not bool(torch.isfinite(got_d).all()):
        raise CheckFailed(f"{what}: contains NaN or inf")
    diff = (got_d - exp_d).abs()
    tol = atol + rtol * exp_d.abs()
    if bool((diff > tol).any()):
        i = int(torch.argmax(diff - tol))
        raise CheckFailed(
            f"{what}: max abs difference {diff.max().item():.3g} (allowed {atol:g} + "
            f"{rtol:g}*|expected|); e.g. at flat index {i}: expected "
            f"{exp_d.flatten()[i].item():.6g}, got {got_d.flatten()[i].item():.6g}"
        )
