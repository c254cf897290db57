"""Student-code guards: what a solution may not import or call, and how it is refused.

One home for every lab and for the grader, so that the quick feedback in the notebook and
the grade refuse the same things in the same way:

- :func:`refuse_mentions`: a solution cell may not *mention* the modules that hold the course's
  answers or its checks (``ddp_lab.checks``, ``ddp_lab.answers``, ``ddp_lab.grading``), nor
  the runtime modules an exercise asks students to rewrite (``forbid_modules``);
- :func:`forbidden_calls`: while student code runs, the named ``torch.distributed`` functions
  raise, in ``torch.distributed`` *and* in ``distributed_c10d`` (where a name imported early,
  ``from torch.distributed.distributed_c10d import all_reduce``, would otherwise escape);
- :func:`watched_collectives`: every collective the code calls is noted, then runs (the
  checkers count and size what student code sends);
- :func:`refused_class`: constructing a class raises (``DistributedDataParallel`` in "write
  your own DDP");
- :func:`recorded_process_group`: ``init_process_group`` / ``destroy_process_group`` only
  record their calls (the checker has joined the group already);
- :func:`call_watchdog`: a call that does not return in time ends the rank with one line
  saying why (a deadlock), instead of waiting for the whole job's timeout;
- :func:`exit_on_student_error`: an exception of student code on a rank becomes one line
  naming the student's file and line, then ``exit(1)``.
"""

from __future__ import annotations

import os
import re
import runpy
import sys
import threading
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch.distributed as dist

#: Modules no solution cell may name: the checks, the grader and the instructor's answers.
ALWAYS_FORBIDDEN_MODULES = ("ddp_lab.checks", "ddp_lab.answers", "ddp_lab.grading")

#: ``torch.distributed`` functions that move data between many ranks (refused where an
#: exercise asks for point-to-point code).
COLLECTIVES = tuple(
    name
    for name in (
        "all_reduce",
        "all_reduce_coalesced",
        "reduce",
        "broadcast",
        "broadcast_object_list",
        "all_gather",
        "all_gather_coalesced",
        "all_gather_into_tensor",
        "all_gather_object",
        "all_gather_single",
        "reduce_scatter",
        "reduce_scatter_single",
        "reduce_scatter_tensor",
        "all_to_all",
        "all_to_all_single",
        "gather",
        "gather_into_tensor",
        "gather_object",
        "gather_single",
        "scatter",
        "scatter_object_list",
        "_all_gather_base",
        "_reduce_scatter_base",
        "_broadcast_coalesced",
    )
    if hasattr(dist, name)
)


def mentions(source: str, module: str) -> bool:
    """True when ``source`` names ``module`` (``a.b`` or ``from a import b``).

    Example:
        >>> mentions("from ddp_lab import checks as c", "ddp_lab.checks")
        True
        >>> mentions("import ddp_lab.data", "ddp_lab.checks")
        False
    """
    package, _, leaf = module.rpartition(".")
    pattern = rf"from\s+{re.escape(package)}\s+import\s+[^\n]*\b{re.escape(leaf)}\b"
    return module in source or bool(package and re.search(pattern, source))


def refuse_mentions(sources: Mapping[str, str], forbid_modules: Iterable[str] = ()) -> None:
    """Raise when a solution cell names a forbidden module.

    Args:
        sources: ``cell id -> source`` of the solution cells (or files) to scan.
        forbid_modules: modules the exercise asks students to rewrite, on top of
            :data:`ALWAYS_FORBIDDEN_MODULES`.

    Raises:
        PermissionError: naming the cell and the module.

    Example:
        >>> refuse_mentions({"ex1": "import torch"})
    """
    for cell, source in sources.items():
        for module in (*ALWAYS_FORBIDDEN_MODULES, *forbid_modules):
            if mentions(source, module):
                raise PermissionError(
                    f"{cell} uses {module}, which this exercise does not allow: write the "
                    "code yourself"
                )


def _refuser(name: str, why: str) -> Callable:
    def refuse(*args, **kwargs):
        raise RuntimeError(f"torch.distributed.{name} is not allowed in this exercise: {why}")

    return refuse


@contextmanager
def forbidden_calls(
    names: Iterable[str], why: str = "build it from send/recv (isend/irecv) yourself"
) -> Iterator[None]:
    """While the block runs, the named ``torch.distributed`` functions raise.

    They are replaced in ``torch.distributed`` and in ``distributed_c10d``, and restored
    afterwards (also when the block raises).

    Example:
        >>> import torch
        >>> with forbidden_calls(["all_reduce"]):
        ...     dist.all_reduce(torch.zeros(1))
        Traceback (most recent call last):
        RuntimeError: torch.distributed.all_reduce is not allowed in this exercise: ...
    """
    import torch.distributed.distributed_c10d as c10d

    saved = []
    for name in names:
        for module in (dist, c10d):
            if hasattr(module, name):
                saved.append((module, name, getattr(module, name)))
                setattr(module, name, _refuser(name, why))
    try:
        yield
    finally:
        for module, name, value in reversed(saved):
            setattr(module, name, value)


@contextmanager
def watched_collectives(note: Callable[[str, tuple, dict], None]) -> Iterator[None]:
    """While the block runs, every collective of :data:`COLLECTIVES` calls
    ``note(name, args, kwargs)`` and then runs as usual; a collective that calls another one
    inside is noted once. Replaced in ``torch.distributed`` and ``distributed_c10d`` (so a
    name imported from either is watched), restored afterwards.

    Example:
        >>> import torch
        >>> seen = []
        >>> with watched_collectives(lambda name, args, kwargs: seen.append(name)):
        ...     pass
        >>> seen
        []
    """
    import torch.distributed.distributed_c10d as c10d

    saved, inside = [], [0]
    for name in COLLECTIVES:
        original = getattr(c10d, name, None) or getattr(dist, name)

        def watched(*args, _name=name, _original=original, **kwargs):
            if not inside[0]:
                note(_name, args, kwargs)
            inside[0] += 1
            try:
                return _original(*args, **kwargs)
            finally:
                inside[0] -= 1

        for module in (dist, c10d):
            if hasattr(module, name):
                saved.append((module, name, getattr(module, name)))
                setattr(module, name, watched)
    try:
        yield
    finally:
        for module, name, value in reversed(saved):
            setattr(module, name, value)


@contextmanager
def refused_class(cls: type, message: str) -> Iterator[None]:
    """While the block runs, ``cls(...)`` raises ``RuntimeError(message)``.

    Example:
        >>> class A: ...
        >>> with refused_class(A, "write your own"):
        ...     A()
        Traceback (most recent call last):
        RuntimeError: write your own
    """

    def refuse(self, *args, **kwargs):
        raise RuntimeError(message)

    original = cls.__init__
    cls.__init__ = refuse
    try:
        yield
    finally:
        cls.__init__ = original


@contextmanager
def recorded_process_group(calls: list) -> Iterator[None]:
    """Record the student's ``init_process_group`` / ``destroy_process_group`` calls.

    The checker's rank worker has joined the process group already; inside this block the
    two functions only append ``("init", backend)`` / ``("destroy", "")`` to ``calls``, so
    that a student's ``setup()`` and ``teardown()`` can be checked without tearing down the
    checker's group. ``dist.is_initialized()`` reports what the student's own calls did
    (torch's internals use ``distributed_c10d``'s, which still sees the real group).
    """
    import torch.distributed.distributed_c10d as c10d

    joined = [False]

    def init(*args, **kwargs):
        backend = args[0] if args else kwargs.get("backend")
        calls.append(("init", "" if backend is None else str(backend)))
        joined[0] = True

    def destroy(*args, **kwargs):
        calls.append(("destroy", ""))
        joined[0] = False

    fakes = {
        "init_process_group": init,
        "destroy_process_group": destroy,
        "is_initialized": lambda: joined[0],
    }
    saved = [(dist, n, getattr(dist, n)) for n in fakes]
    saved += [(c10d, n, getattr(c10d, n)) for n in fakes if n != "is_initialized"]
    for module, name, _ in saved:
        setattr(module, name, fakes[name])
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


@contextmanager
def call_watchdog(seconds: float, explain: Callable[[], str]) -> Iterator[None]:
    """End this process with a one-line ``TimeoutError`` when the block runs too long.

    A deadlocked rank would otherwise wait for the whole job's timeout and end with a generic
    message; after ``seconds`` this prints ``explain()`` (what hung, and the likely cause) to
    stderr and exits at once; torchrun then stops the other ranks.
    """

    def fire() -> None:
        print(f"TimeoutError: {explain()}", file=sys.stderr, flush=True)
        os._exit(1)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


@contextmanager
def exit_on_student_error(filename: str) -> Iterator[None]:
    """Turn an exception of the student's code on one rank into one line and ``exit(1)``.

    torchrun then stops the other ranks at once (they would otherwise wait for this one), and
    the rank's last log line, which the messages quote, is the student's error and the line
    of their file rather than a traceback through the checks.
    """
    try:
        yield
    except Exception as err:  # noqa: BLE001 - any error of the student's code
        lines = [
            f.lineno
            for f in traceback.extract_tb(err.__traceback__)
            if Path(f.filename).name == filename or f.filename.startswith("<cell")
        ]
        if isinstance(err, SyntaxError):  # its message names the file and line already
            lines = []
        said = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
        at = f" ({filename} line {lines[-1]})" if lines else ""
        print(f"{said}{at}", file=sys.stderr, flush=True)
        sys.exit(1)


def load_student_file(path: str | Path, forbid: Iterable[str] = ()) -> dict:
    """Run the file a ``%%writefile`` cell wrote; return its namespace.

    The file runs as module ``__student__`` (its ``if __name__ == "__main__":`` block does
    not run), with the ``forbid``-den calls refused while it loads.

    Raises:
        FileNotFoundError: the notebook's ``%%writefile`` cell was not run.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"{path.name} was not written: run the cell that starts with %%writefile {path.name}"
        )
    refuse_mentions({path.name: path.read_text()})
    with forbidden_calls(forbid):
        return runpy.run_path(str(path), run_name="__student__")
