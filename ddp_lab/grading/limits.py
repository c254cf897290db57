"""Resource limits for student code: memory, processes, file size and CPU time.

Student code runs during grading in the notebook's kernel and in the processes that re-run
each exercise; one ``torch.zeros(10**10)``, a process-spawning loop or a runaway log file
must cost that student the exercise, not the grading machine. Every such process starts
through :func:`wrap`, which runs ``python -m ddp_lab.grading.limits [limits] -- CMD``: that
sets the limits on itself and then ``exec``\\ s the command, so the command and everything
it starts (torchrun, its ranks) inherit them.

=============  ============================================  =================================
limit          how                                            what student code sees
=============  ============================================  =================================
memory         ``RLIMIT_DATA`` per process (heap and private  ``MemoryError`` / torch's "can't
               mappings: every tensor)                        allocate memory"
processes      a ``pids`` cgroup per process tree where the   ``BlockingIOError`` (fork fails)
               cgroup file system is writable (root, or a
               delegated cgroup); else the grader's process-
               tree watcher stops a tree that grows past it
file size      ``RLIMIT_FSIZE`` per file                      ``OSError: File too large``
CPU time       ``RLIMIT_CPU`` per process                     the process is killed (SIGXCPU)
=============  ============================================  =================================

``RLIMIT_NPROC`` is no use here: root ignores it, and it counts every process of the user.
The memory limit is per process, so a tree may use up to ``memory x processes``; the wall
clock is limited separately (the exercise's timeout, ``make autograde --timeout``).
:func:`explain` turns what a limited process printed into one clear line for the verdict.

``make autograde --memory-mb M --max-processes P --file-mb F --cpu-s S`` sets them (passed
to nbgrader's processes through ``$DDP_LAB_LIMITS``); :data:`DEFAULT` holds the defaults.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

ENV = "DDP_LAB_LIMITS"
PIDS_ROOT = Path("/sys/fs/cgroup/pids")
#: Where the per-tree ``pids`` cgroups go (emptied ones are removed by :func:`sweep`).
CGROUP_DIR = "ddp-lab"
MB = 1024 * 1024


@dataclass(frozen=True)
class Limits:
    """Limits of one student process tree (None: no limit).

    Attributes:
        memory_mb: heap and private mappings per process, in MiB.
        processes: processes alive at once in one tree (a kernel, or one exercise's run); a
            ``pids`` cgroup counts every thread as one (a torchrun job of 4 gloo ranks on a
            2-D device mesh holds about 80).
        file_mb: the largest file a process may write, in MiB.
        cpu_s: CPU seconds per process.
    """

    memory_mb: int | None = 4096
    processes: int | None = 128  # a pids cgroup counts threads: 4 gloo ranks hold ~80
    file_mb: int | None = 256
    cpu_s: int | None = 900

    def to_env(self) -> str:
        """The JSON form carried in ``$DDP_LAB_LIMITS``."""
        return json.dumps(asdict(self))


DEFAULT = Limits()


def current() -> Limits:
    """The limits configured for this grading run (``$DDP_LAB_LIMITS``, else the defaults)."""
    text = os.environ.get(ENV)
    return Limits(**json.loads(text)) if text else DEFAULT


def wrap(cmd: list[str], limits: Limits | None = None) -> list[str]:
    """``cmd`` prefixed so that it runs under ``limits`` (default: :func:`current`).

    Example:
        >>> wrap(["python", "x.py"], Limits(64, 8, 16, 60))[2:]
        ['ddp_lab.grading.limits', '--memory-mb', '64', '--max-processes', '8', '--file-mb', \
'16', '--cpu-s', '60', '--', 'python', 'x.py']
    """
    limits = limits or current()
    args = [sys.executable, "-m", "ddp_lab.grading.limits"]
    for flag, value in (
        ("--memory-mb", limits.memory_mb),
        ("--max-processes", limits.processes),
        ("--file-mb", limits.file_mb),
        ("--cpu-s", limits.cpu_s),
    ):
        if value is not None:
            args += [flag, str(value)]
    return [*args, "--", *cmd]


def pids_cgroups_available() -> bool:
    """True when a ``pids`` cgroup can be made here (cgroup v1 ``pids`` writable)."""
    return (PIDS_ROOT / "cgroup.procs").is_file() and os.access(PIDS_ROOT, os.W_OK)


def _join_pids_cgroup(processes: int) -> bool:
    """Put this process into a fresh ``pids`` cgroup capped at ``processes``."""
    if not pids_cgroups_available():
        return False
    try:
        group = PIDS_ROOT / CGROUP_DIR / f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        group.mkdir(parents=True)
        (group / "pids.max").write_text(str(processes))
        (group / "cgroup.procs").write_text(str(os.getpid()))
        return True
    except OSError:
        return False


def sweep() -> int:
    """Remove the per-tree cgroups whose processes have all ended; return how many."""
    removed = 0
    base = PIDS_ROOT / CGROUP_DIR
    for group in base.glob("*") if base.is_dir() else ():
        try:
            if not (group / "cgroup.procs").read_text().strip():
                group.rmdir()
                removed += 1
        except OSError:
            pass
    return removed


def apply(limits: Limits) -> dict[str, bool]:
    """Set ``limits`` on this process (inherited by everything it starts)."""
    done = {}
    for name, value, scale in (
        ("memory", limits.memory_mb, MB),
        ("file", limits.file_mb, MB),
        ("cpu", limits.cpu_s, 1),
    ):
        if value is None:
            continue
        which = {"memory": resource.RLIMIT_DATA, "file": resource.RLIMIT_FSIZE}.get(
            name, resource.RLIMIT_CPU
        )
        soft, hard = resource.getrlimit(which)
        want = value * scale
        if hard != resource.RLIM_INFINITY:
            want = min(want, hard)
        resource.setrlimit(which, (want, want if name != "cpu" else max(want, want + 5)))
        done[name] = True
    if limits.processes is not None:
        done["processes"] = _join_pids_cgroup(limits.processes)
    return done


def explain(text: str, limits: Limits | None = None, returncode: int | None = None) -> str | None:
    """The limit a failed student process ran into, in one line, or None.

    Args:
        text: what the process printed (its stderr).
        limits: the limits it ran under (default: :func:`current`).
        returncode: its exit status (``-24``, SIGXCPU: the CPU limit).

    Example:
        >>> explain("RuntimeError: DefaultCPUAllocator: can't allocate memory", Limits(512))
        'your code needed more than the memory limit of 512 MiB per process and was refused'
    """
    limits = limits or current()
    lower = text.lower()
    if "can't allocate memory" in lower or "memoryerror" in lower or "cannot allocate" in lower:
        return (
            f"your code needed more than the memory limit of {limits.memory_mb} MiB per "
            "process and was refused"
        )
    if "file too large" in lower or "errno 27" in lower:
        return f"your code wrote a file larger than the limit of {limits.file_mb} MiB"
    if "resource temporarily unavailable" in lower or "too many processes" in lower:
        return (
            f"your code tried to run more than {limits.processes} processes at once "
            "(a process-spawning loop?) and was refused"
        )
    if returncode == -24:
        return f"your code used more than {limits.cpu_s} s of CPU time and was stopped"
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ddp_lab.grading.limits", description=__doc__)
    p.add_argument("--memory-mb", type=int)
    p.add_argument("--max-processes", type=int)
    p.add_argument("--file-mb", type=int)
    p.add_argument("--cpu-s", type=int)
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        p.error("give the command after --")
    apply(Limits(args.memory_mb, args.max_processes, args.file_mb, args.cpu_s))
    os.execvp(cmd[0], cmd)
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main())
