"""Find, follow and kill a whole process tree, and run a command that leaves nothing behind.

A process started with ``start_new_session=True`` is the root of a tree that a plain
``proc.kill()`` does not clean up: its children survive it, and a child that starts a session
of its own (torchrun's workers do, and so does any daemon) is not even in the root's process
group. :class:`ProcessTree` therefore remembers every descendant it has ever seen, and every
process in the root's session, and :meth:`ProcessTree.terminate` signals all of them.

:func:`run` puts this together: a command with a timeout, its output captured, and the tree
killed on timeout, on Ctrl-C, and after a normal exit if anything was left running::

    >>> from ddp_lab.proctree import run
    >>> res = run(["python", "-c", "print('hi')"], timeout=30)
    >>> res.returncode, res.stdout, res.timed_out, res.killed
    (0, 'hi\\n', False, 0)

What cannot be found: a descendant that leaves the root's session *and* loses its parent
between two scans (every :data:`SCAN_S` seconds) is reparented to init and out of sight.
Linux and macOS only (the table is read from ``/proc``, or from ``ps`` where there is none).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import IO, NamedTuple

#: Seconds between SIGTERM and SIGKILL when :mod:`ddp_lab.launch` kills a torchrun tree.
GRACE_S = 5.0
#: Seconds between two scans of the process table while a tree runs.
SCAN_S = 0.5
#: Seconds between two checks whether the root has exited.
POLL_S = 0.1


class ProcInfo(NamedTuple):
    """One row of :func:`process_table`."""

    ppid: int
    pgid: int
    #: Session id; 0 where it is not known (macOS).
    sid: int
    #: Start time in clock ticks since boot (``""`` on macOS); tells a reused pid apart.
    start: str


def process_table(zombies: bool = False) -> dict[int, ProcInfo]:
    """Every process on the machine, as ``pid -> ProcInfo(ppid, pgid, sid, start)``.

    Args:
        zombies: also list processes that have exited but are not reaped yet.

    Returns:
        A dict keyed by pid; empty if the table cannot be read.

    Example:
        >>> import os
        >>> table = process_table()
        >>> table[os.getpid()].ppid == os.getppid()
        True
    """
    table: dict[int, ProcInfo] = {}
    if os.path.isdir("/proc"):
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    stat = f.read().decode("utf-8", "replace")
            except OSError:
                continue
            # after "pid (comm) ": state ppid pgrp session ... starttime (field 22 of stat)
            fields = stat[stat.rfind(")") + 2 :].split()
            if len(fields) > 19 and (zombies or fields[0] not in ("Z", "X")):
                table[int(name)] = ProcInfo(
                    int(fields[1]), int(fields[2]), int(fields[3]), fields[19]
                )
        return table
    try:  # macOS: no /proc
        out = subprocess.run(
            ["ps", "-A", "-o", "pid=,ppid=,pgid=,stat="], capture_output=True, text=True, timeout=10
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return table
    for row in out.splitlines():
        parts = row.split()
        if len(parts) >= 4 and (zombies or not parts[3].startswith("Z")):
            table[int(parts[0])] = ProcInfo(int(parts[1]), int(parts[2]), 0, "")
    return table


class ProcessTree:
    """A root process and every descendant ever seen, including those in sessions of their own.

    Call :meth:`refresh` now and then while the root runs: a process is found through its
    parent, so a grandchild that starts its own session and whose parent exits before the next
    refresh is lost. Processes still in the root's session are found without that help (the
    root should be started with ``start_new_session=True``, so that session is the tree's).

    Args:
        root: the process at the top, as returned by :class:`subprocess.Popen`.

    Attributes:
        known: ``pid -> start time`` of every descendant seen (the start time guards against
            a reused pid).
        killed: processes that were alive when :meth:`terminate` was called, in total.

    Example:
        >>> import subprocess, sys
        >>> cmd = [sys.executable, "-c", "import time; time.sleep(60)"]
        >>> tree = ProcessTree(subprocess.Popen(cmd, start_new_session=True))
        >>> tree.terminate(grace=1.0)
        1
    """

    def __init__(self, root: subprocess.Popen):
        self.root = root
        self.known: dict[int, str] = {}
        self.killed = 0

    def refresh(self) -> dict[int, ProcInfo]:
        """Add the current descendants (and members of the root's session) to the known ones.

        Returns:
            The process table that was read, for :meth:`alive`.
        """
        table = process_table()
        children: dict[int, list[int]] = {}
        for pid, info in table.items():
            children.setdefault(info.ppid, []).append(pid)

        def adopt(pid: int) -> bool:
            if pid == self.root.pid or self.known.get(pid) == table[pid].start:
                return False
            self.known[pid] = table[pid].start
            return True

        stack = self.alive(table)
        if self._session_is_ours(table):
            stack += [p for p, info in table.items() if info.sid == self.root.pid and adopt(p)]
        while stack:
            for child in children.get(stack.pop(), ()):
                if adopt(child):
                    stack.append(child)
        return table

    def _session_is_ours(self, table: dict[int, ProcInfo]) -> bool:
        """True when a session id equal to the root's pid can only be the root's session.

        The kernel does not hand out a pid that still names a session, so once the root is
        reaped, that session lives on only while no other process holds the root's pid.
        """
        return self.root.poll() is None or self.root.pid not in table

    def alive(self, table: dict[int, ProcInfo], root: bool = True) -> list[int]:
        """Known processes still in ``table``.

        Args:
            table: a process table from :meth:`refresh` or :func:`process_table`.
            root: put the root first in the list while it has not exited.

        Returns:
            Their pids.
        """
        pids = [p for p, start in self.known.items() if p in table and table[p].start == start]
        return ([self.root.pid] if root and self.root.poll() is None else []) + pids

    def _signal(self, sig: int, table: dict[int, ProcInfo], root: bool) -> None:
        pids = self.alive(table, root)
        groups = {table[p].pgid for p in pids if p in table} - {os.getpgrp(), 0, 1}
        if not root:
            groups.discard(self.root.pid)  # the root's own group
        for pgid in groups:
            with contextlib.suppress(OSError):  # already gone
                os.killpg(pgid, sig)
        for pid in pids:
            with contextlib.suppress(OSError):  # already gone
                os.kill(pid, sig)

    def _wait(self, seconds: float, zombies: bool = False) -> None:
        """Wait until no known process is left (with ``zombies``: not even unreaped)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            table = process_table(zombies) if zombies else self.refresh()
            if not self.alive(table, root=not zombies):
                return
            time.sleep(0.05)

    def terminate(self, grace: float) -> int:
        """SIGTERM the tree, SIGKILL what is left after ``grace`` s, and reap the root.

        SIGKILL goes to the descendants first, so that their parents can still reap them;
        orphans would wait for init, which may be slow to reap. A Ctrl-C during the grace
        period goes straight to SIGKILL and is then re-raised.

        Args:
            grace: seconds the processes get to exit after SIGTERM.

        Returns:
            How many processes (the root included) were alive when it was called.
        """
        table = self.refresh()
        count = len(self.alive(table))
        self.killed += count
        try:
            self._signal(signal.SIGTERM, table, root=True)
            self._wait(grace)
        finally:
            table = self.refresh()
            if self.alive(table, root=False):
                self._signal(signal.SIGKILL, table, root=False)
                self._wait(1.0, zombies=True)
            if self.root.poll() is None:
                self.root.kill()
            self.root.wait()
            self._wait(3.0, zombies=True)
        return count


@dataclass
class TreeRun:
    """What :func:`run` left behind.

    Attributes:
        returncode: the command's exit status (negative: killed by that signal); ``None``
            when it was killed for the timeout.
        stdout: its standard output (UTF-8, undecodable bytes replaced).
        stderr: its standard error.
        seconds: wall-clock duration, the clean-up included.
        timed_out: the command ran past its timeout and the tree was killed.
        killed: processes still alive that had to be killed (0 on a clean exit).
        too_many: the tree grew past ``max_processes`` and was killed.
    """

    returncode: int | None
    stdout: str
    stderr: str
    seconds: float
    timed_out: bool
    killed: int
    too_many: bool = False


def run(
    cmd: Sequence[str],
    *,
    timeout: float,
    cwd: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    grace: float = 2.0,
    stdin_devnull: bool = True,
    max_processes: int | None = None,
) -> TreeRun:
    """Run ``cmd`` in a session of its own and make sure no process of its tree survives it.

    The output goes to temporary files (no pipe to fill, whatever its size). On timeout the
    whole tree gets SIGTERM, then SIGKILL after ``grace`` s. After a normal exit, descendants
    left behind (a daemon the command started) are killed the same way and counted in
    ``killed``.

    Args:
        cmd: the program and its arguments (not a shell string).
        timeout: seconds before the tree is killed.
        cwd: working directory of the command (default: the current one).
        env: the *complete* environment of the command; it is not merged with this process's
            environment (pass ``{**os.environ, "X": "1"}`` to add a variable). ``None``
            inherits this process's environment.
        grace: seconds between SIGTERM and SIGKILL.
        stdin_devnull: give the command an empty stdin; False lets it inherit this one.
        max_processes: kill the tree when a scan finds more processes alive in it (a
            process-spawning loop; the scans run every ``SCAN_S`` s, so a fast loop may
            get further in between).

    Returns:
        A :class:`TreeRun`; a non-zero exit or a timeout is reported there, not raised.

    Raises:
        ValueError: ``timeout`` is not positive or ``grace`` is negative.
        TypeError: ``cmd`` is a string instead of a sequence of arguments.
        OSError: the program could not be started (e.g. :class:`FileNotFoundError`).
        KeyboardInterrupt: re-raised after the tree is killed.

    Example:
        >>> res = run(["sh", "-c", "sleep 60 & sleep 60"], timeout=1.0, grace=1.0)
        >>> res.timed_out, res.returncode   # sh and both sleeps were killed
        (True, None)
    """
    if isinstance(cmd, str | bytes):
        raise TypeError(f"cmd must be a sequence of arguments, not a string: {cmd!r}")
    if not timeout or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if grace < 0:
        raise ValueError(f"grace must be >= 0 seconds, got {grace!r}")
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.monotonic()
        proc = subprocess.Popen(
            [os.fspath(arg) for arg in cmd],
            cwd=cwd,
            env=dict(env) if env is not None else None,
            stdin=subprocess.DEVNULL if stdin_devnull else None,
            stdout=out,
            stderr=err,
            start_new_session=True,
        )
        tree = ProcessTree(proc)
        too_many = [False]
        try:
            timed_out = not _wait_for_root(proc, tree, t0 + timeout, max_processes, too_many)
            if timed_out or too_many[0]:
                killed = tree.terminate(grace)
            else:  # anything the command left running
                killed = tree.terminate(grace) if tree.alive(tree.refresh()) else 0
        except BaseException:  # Ctrl-C, or a bug here: never leave the tree behind
            tree.terminate(grace)
            raise
        seconds = time.monotonic() - t0
        return TreeRun(
            returncode=None if timed_out or too_many[0] else proc.returncode,
            stdout=_read(out),
            stderr=_read(err),
            seconds=seconds,
            timed_out=timed_out,
            killed=killed,
            too_many=too_many[0],
        )


def _wait_for_root(
    proc: subprocess.Popen,
    tree: ProcessTree,
    deadline: float,
    max_processes: int | None = None,
    too_many: list[bool] | None = None,
) -> bool:
    """Scan the tree until the root exits (True), the deadline passes (False), or the tree
    grows past ``max_processes`` (True, with ``too_many[0]`` set)."""
    next_scan = 0.0
    while True:
        now = time.monotonic()
        if now >= deadline:
            return proc.poll() is not None
        if now >= next_scan:  # remember every descendant, in case one outlives its parent
            table = tree.refresh()
            next_scan = now + SCAN_S
            if max_processes is not None and len(tree.alive(table)) > max_processes:
                if too_many is not None:
                    too_many[0] = True
                return True
        try:
            proc.wait(timeout=min(POLL_S, deadline - now))
            return True
        except subprocess.TimeoutExpired:
            pass


def _read(f: IO[bytes]) -> str:
    f.seek(0)
    return f.read().decode("utf-8", "replace")
