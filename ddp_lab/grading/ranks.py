"""The grader's ranks: one distributed case's ranks forked from the student process.

Under torchrun every rank of a case is a fresh interpreter that imports torch again (about
2 s of CPU each), and torchrun's agent is one more: grading a distributed exercise spent most
of its time starting processes. The grader's student process (:mod:`ddp_lab.grading.student`)
has torch loaded already, so it forks the ranks instead. Each child

- sets torchrun's variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
  ``MASTER_ADDR``, ``MASTER_PORT``) and works in the same folder,
- writes its stdout and stderr to a log of its own (``rank<r>.log``; the grader keeps them
  in ``<workdir>/case<i>/``),
- runs the same :mod:`ddp_lab.checks.rank_worker` on the same files, in a process group of
  its own (so anything it starts is stopped with it).

What torchrun does for a job is done here too: the first rank that fails stops the others,
a job past its timeout is killed, nothing outlives the call, and the same
:class:`~ddp_lab.launch.LaunchFailed` / :class:`~ddp_lab.launch.LaunchTimeout` carry the
per-rank logs, so the verdict's messages are the same. The forked ranks inherit the student
process's limits and confinement. The visible checks in the notebook keep torchrun (the
course teaches it, and a Jupyter kernel must not fork); so does any platform other than
Linux (:func:`available`).
"""

from __future__ import annotations

import errno
import math
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

from ddp_lab.dist import free_port
from ddp_lab.launch.messages import describe
from ddp_lab.launch.result import LaunchFailed, LaunchResult, LaunchTimeout

#: Seconds between two looks at the ranks.
POLL_S = 0.01
#: Attempts when another process took the rendezvous port between its choice and its use.
PORT_ATTEMPTS = 3


#: Set to ``0`` to start the grader's ranks with torchrun, as on other platforms.
ENV = "DDP_LAB_FORK_RANKS"


def available() -> bool:
    """True where ranks are forked (Linux, unless ``$DDP_LAB_FORK_RANKS`` is ``0``)."""
    linux = sys.platform.startswith("linux") and hasattr(os, "fork") and hasattr(os, "waitid")
    return linux and os.environ.get(ENV, "1") != "0"


def fork_ranks(
    main: Callable[[list[str]], int | None],
    args: Sequence[str],
    *,
    nproc: int,
    timeout: float,
    cwd: str | os.PathLike,
    logs: str | os.PathLike,
) -> LaunchResult:
    """Run ``main(args)`` on ``nproc`` forked ranks of one gloo job, like ``torchrun`` would.

    Args:
        main: what every rank runs (``ddp_lab.checks.rank_worker.main``); it returns (or
            ``sys.exit``\\ s with) the rank's exit status.
        args: its arguments.
        nproc: the world size.
        timeout: seconds before every rank is killed and :class:`LaunchTimeout` raised.
        cwd: the ranks' working folder.
        logs: the folder for ``rank<r>.log``.

    Returns:
        A :class:`~ddp_lab.launch.LaunchResult` (returncode 0, each rank's log).

    Raises:
        LaunchFailed: a rank failed (the others were stopped); ``.result.logs`` holds the logs.
        LaunchTimeout: the job ran past ``timeout``.

    Example:
        >>> def main(args):
        ...     import torch.distributed as dist
        ...     dist.init_process_group("gloo")
        ...     print("rank", dist.get_rank(), "of", dist.get_world_size())
        ...     dist.destroy_process_group()
        >>> fork_ranks(main, [], nproc=2, timeout=60, cwd=".", logs=tmp).logs[1]  # doctest: +SKIP
        'rank 1 of 2\\n'
    """
    for attempt in range(PORT_ATTEMPTS):
        res, failed, why = _job(main, list(map(str, args)), nproc, timeout, Path(cwd), Path(logs))
        taken = any(_port_taken(text) for text in res.logs.values())
        if not (why == "failed" and taken and attempt + 1 < PORT_ATTEMPTS):
            break
    if why == "timeout":
        raise LaunchTimeout(
            f"{nproc} ranks did not finish within {timeout:g} s and were stopped", res
        )
    if failed is not None:
        raise LaunchFailed(
            f"rank {failed} failed first ({describe(res.returncode)}) after {res.seconds:.1f} s",
            res,
        )
    return res


def _job(
    main: Callable, args: list[str], nproc: int, timeout: float, cwd: Path, logs: Path
) -> tuple[LaunchResult, int | None, str]:
    """One attempt: ``(result, the rank that failed first or None, why it ended)``."""
    logs.mkdir(parents=True, exist_ok=True)
    for stale in logs.glob("rank*.failed"):  # an earlier attempt's
        stale.unlink()
    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_RANK": "0",
    }
    sys.stdout.flush()  # or the children print the parent's buffered lines again
    sys.stderr.flush()
    t0 = time.monotonic()
    pids: dict[int, int] = {}  # pid -> rank
    ended: dict[int, int] = {}
    why = "failed"
    try:
        for rank in range(nproc):
            log = logs / f"rank{rank}.log"
            pid = os.fork()
            if pid == 0:  # the child never returns from here
                _rank(main, args, {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}, cwd, log)
            pids[pid] = rank
        why = _wait(pids, ended, t0 + timeout)
    finally:
        _stop(pids)  # every rank's group, then reap: nothing outlives the job
    failed = _first_failure(ended, logs)
    returncode = -signal.SIGKILL if why == "timeout" else ended.get(failed, 0)
    res = LaunchResult(
        returncode=returncode,
        logs={r: _read(logs / f"rank{r}.log") for r in range(nproc)},
        result=None,
        seconds=time.monotonic() - t0,
        command=["fork", *args],
    )
    return res, failed, why


def _first_failure(ended: dict[int, int], logs: Path) -> int | None:
    """The rank that failed first, among those seen failed: the earliest failure time a rank
    noted (the others failed because of it: a closed connection, a timeout); a rank killed
    by a signal noted none and counts as first."""
    failed = [rank for rank, code in ended.items() if code != 0]
    return min(failed, key=lambda r: _float(_read(logs / f"rank{r}.failed")), default=None)


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return -math.inf


def _rank(main: Callable, args: list[str], env: dict, cwd: Path, log: Path) -> None:
    """The forked child: one rank. Ends the process with the rank's exit status; a failed
    rank notes when it failed in ``rank<r>.failed`` beside its log."""
    code, failed_at = 1, None
    try:
        os.setpgid(0, 0)
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        # Python's own streams too, whatever the parent had put there (a test's capture)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        os.chdir(cwd)
        os.environ.update(env)
        code = main(args) or 0
    except SystemExit as exit_:
        failed_at = time.monotonic()
        if isinstance(exit_.code, int) or exit_.code is None:
            code = exit_.code or 0
        else:  # sys.exit("message") prints the message, as Python does
            print(exit_.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - whatever it was, it is this rank's failure
        failed_at = time.monotonic()
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
            if code != 0:
                log.with_suffix(".failed").write_text(repr(failed_at or time.monotonic()))
        finally:
            os._exit(code if isinstance(code, int) and 0 <= code < 256 else 1)


def _wait(pids: dict[int, int], ended: dict[int, int], deadline: float) -> str:
    """Watch the ranks until all ended, one failed or the deadline passed.

    Fills ``ended`` (``rank -> exit status``) and returns why it stopped watching:
    ``"done"``, ``"failed"`` or ``"timeout"``. The ranks are not reaped here, so their pids
    (and process groups) stay theirs until :func:`_stop`.
    """
    while len(ended) < len(pids):
        for pid, rank in pids.items():
            if rank in ended:
                continue
            info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            if info is not None and info.si_pid == pid:
                exited = info.si_code == os.CLD_EXITED
                ended[rank] = info.si_status if exited else -info.si_status
        if any(code != 0 for code in ended.values()):  # after a whole round: who was first
            return "failed"
        if len(ended) < len(pids) and time.monotonic() >= deadline:
            return "timeout"
        time.sleep(POLL_S)
    return "done"


def _stop(pids: dict[int, int]) -> None:
    """Kill every rank's process group (a rank's own children too), then reap the ranks."""
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for pid in pids:
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _port_taken(text: str) -> bool:
    lower = text.lower()
    return "address already in use" in lower or f"errno {errno.EADDRINUSE}" in lower
