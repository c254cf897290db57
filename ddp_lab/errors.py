"""User-facing errors: one clear line that names the fix, a non-zero exit, no traceback wall."""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import wraps
from typing import TypeVar

F = TypeVar("F", bound=Callable[..., int | None])

#: Exit status for every usage error (bad flag, bad environment, missing data, ...).
USAGE_EXIT = 2


class UsageError(Exception):
    """An error caused by how the program was called, not by a bug.

    The message is shown to the user as one line, so it must say what is wrong *and* how
    to fix it.

    Examples
    --------
    >>> raise UsageError("--backend nccl needs a CUDA GPU; use --backend gloo on CPU")
    Traceback (most recent call last):
    ...
    ddp_lab.errors.UsageError: --backend nccl needs a CUDA GPU; use --backend gloo on CPU
    """


def exit_on_usage_error(prog: str) -> Callable[[F], F]:
    """Decorate a ``main`` so that a :class:`UsageError` becomes one line and exit code 2.

    Args:
        prog: program name printed before the message, e.g. ``"ddp_lab.train"``.

    Returns:
        A decorator for a ``main(...) -> int | None`` function.
    """

    def decorate(main: F) -> F:
        @wraps(main)
        def wrapper(*args, **kwargs):
            try:
                return main(*args, **kwargs)
            except UsageError as err:
                rank = _rank_prefix()
                print(f"{prog}: error: {rank}{err}", file=sys.stderr, flush=True)
                sys.exit(USAGE_EXIT)

        return wrapper  # type: ignore[return-value]

    return decorate


def _rank_prefix() -> str:
    import os

    if "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return f"[rank {os.environ['RANK']}] "
    return ""
