"""The checker's instruments for exercise 1: what it records and what it breaks while the
student's ``save_checkpoint`` runs (in the student's process).

- :func:`recorded_file_ops`: ``os.fsync`` / ``os.fdatasync`` (which file, how large it was
  then) and ``os.replace`` / ``os.rename`` (source, destination, the source's size);
- :func:`disk_full_at`: files may not grow past a size (``RLIMIT_FSIZE``), as on a full
  disk;
- :class:`Explodes`: a state entry that raises while it is serialised (a crash mid-write).
"""

from __future__ import annotations

import os
import resource
import signal
import threading
from contextlib import contextmanager
from pathlib import Path


class SimulatedCrash(RuntimeError):
    """What the state's poisoned entry raises while it is being serialised."""


class Explodes:
    """An entry that cannot be serialised: pickling it raises :class:`SimulatedCrash`."""

    def __reduce_ex__(self, protocol):
        raise SimulatedCrash("simulated crash while the checkpoint was being written")


def _fd_path(fd) -> str | None:
    fd = fd if isinstance(fd, int) else fd.fileno()
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        pass
    try:  # macOS
        import fcntl

        raw = fcntl.fcntl(fd, fcntl.F_GETPATH, bytes(1024))  # type: ignore[attr-defined]
        return raw.split(b"\0", 1)[0].decode()
    except (ImportError, AttributeError, OSError):
        return None


@contextmanager
def recorded_file_ops(folder: Path, ops: list):
    """Record ``fsync`` / ``fdatasync`` (file, its size then) and ``replace`` / ``rename``
    (source, destination, the source's size), paths relative to ``folder``."""
    base = os.path.realpath(folder)
    saved = {name: getattr(os, name) for name in ("fsync", "fdatasync", "replace", "rename")}

    def rel(p) -> str:
        return os.path.relpath(os.path.realpath(os.fspath(p)), base)

    def syncing(name):
        def sync(fd):
            where = _fd_path(fd)
            size = os.fstat(fd if isinstance(fd, int) else fd.fileno()).st_size
            ops.append([name, rel(where) if where else "?", size])
            return saved[name](fd)

        return sync

    def renaming(name):
        def rename(src, dst, *args, **kwargs):
            size = os.stat(src).st_size if os.path.exists(src) else -1
            ops.append(["rename", rel(src), rel(dst), size])
            return saved[name](src, dst, *args, **kwargs)

        return rename

    for name in ("fsync", "fdatasync"):
        setattr(os, name, syncing(name))
    for name in ("replace", "rename"):
        setattr(os, name, renaming(name))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(os, name, fn)


@contextmanager
def disk_full_at(limit: int):
    """Files may not grow beyond ``limit`` bytes while the block runs (``RLIMIT_FSIZE``): a
    write past it fails with ``EFBIG`` (``SIGXFSZ`` ignored), as on a full disk."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    main = threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN) if main else None
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        if main:
            signal.signal(signal.SIGXFSZ, old)
