"""The launcher's messages: who failed first, why, and the last lines that show it.

Also :func:`student_problem`, the one line a check quotes when a student's script failed
under torchrun: the first rank that raised, its error, and the line of the student's file.
"""

from __future__ import annotations

import re
import signal

from ddp_lab.launch.logs import ALERT, display
from ddp_lab.launch.result import LaunchResult

#: Lines of the failing rank's log quoted in a failure message.
TAIL_LINES = 15


def plural(count: int, noun: str) -> str:
    """``"1 process"``, ``"2 processes"``.

    Example:
        >>> plural(2, "process")
        '2 processes'
    """
    return f"{count} {noun}" if count == 1 else f"{count} {noun}es"


def first_failure(res: LaunchResult) -> tuple[int | None, int | None]:
    """(rank, exit code) of the first failed worker: from torchrun's report, else a guess."""
    agent = res.logs.get(-1, "")
    root = agent.rpartition("Root Cause")[2] if "Root Cause" in agent else ""
    rank = re.search(r"^\s*rank\s*:\s*(\d+)", root, re.M)
    code = re.search(r"^\s*exitcode\s*:\s*(-?\d+)", root, re.M)
    if rank and code:
        return int(rank[1]), int(code[1])
    failed = re.findall(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)", agent)
    if failed:
        return int(failed[-1][1]), int(failed[-1][0])
    for r in sorted(k for k in res.logs if k >= 0):
        if any(ALERT.match(display(line, r)) for line in res.logs[r].splitlines()):
            return r, None
    return None, None


def describe(code: int | None) -> str:
    if code is None:
        return "an error"
    if code >= 0:
        return f"exit code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    return f"{name}" + (" (out of memory?)" if name == "SIGKILL" else "")


def tail(res: LaunchResult, rank: int, n: int) -> str:
    lines = [display(line, rank) for line in res.logs.get(rank, "").splitlines()[-n:]]
    return "\n".join(f"    {line}" for line in lines) if lines else "    (no output)"


def failure_message(res: LaunchResult, target: str, rank: int | None, code: int | None) -> str:
    head = f"torchrun {target} failed with exit code {res.returncode} after {res.seconds:.1f} s"
    if rank is None:
        return f"{head}; no rank reported an error. torchrun said:\n{tail(res, -1, TAIL_LINES)}"
    return (
        f"{head}: rank {rank} failed first ({describe(code)}). Last lines of rank {rank} "
        f"(all logs: err.result.logs):\n{tail(res, rank, TAIL_LINES)}"
    )


def timeout_message(res: LaunchResult, target: str, timeout: float, killed: int) -> str:
    ranks = sorted(r for r in res.logs if r >= 0)
    shown = "\n".join(f"Last lines of rank {r}:\n{tail(res, r, 5)}" for r in ranks[:4])
    more = f"\n(ranks {ranks[4]}-{ranks[-1]} not shown: err.result.logs)" if len(ranks) > 4 else ""
    return (
        f"torchrun {target} did not finish within {timeout:g} s; killed "
        f"{plural(killed, 'process')}. A hang usually means the ranks disagree about the next "
        "collective (one skipped a barrier or all_reduce) or wait for a rank that died; if "
        f"the job is just slow, raise timeout=.\n{shown}{more}"
    )


def student_problem(err: Exception, filename: str) -> str:
    """The student's error from a failed torchrun job (a :class:`LaunchError`): the first rank
    that raised, its message, and the line of ``filename`` it came from.

    Example:
        >>> class E(Exception): result = LaunchResult(1, {0: 'ValueError: bad\\n'}, None, 1.0, [])
        >>> student_problem(E("x"), "ring.py")
        'ring.py failed on rank 0: ValueError: bad'
    """
    logs = getattr(getattr(err, "result", None), "logs", None) or {}
    for rank in sorted(r for r in logs if r >= 0):
        lines = [re.sub(r"^\[rank\d+\]:\s?", "", line) for line in logs[rank].splitlines()]
        errors = [line.strip() for line in lines if re.match(r"\s*[\w.]*(Error|Exception)\b", line)]
        if errors:
            places = re.findall(rf'File "[^"]*{re.escape(filename)}", line (\d+)', logs[rank])
            at = f" ({filename} line {places[-1]})" if places else ""
            return f"{filename} failed on rank {rank}: {errors[-1][:400]}{at}"
    return f"{filename} failed: {str(err).splitlines()[0]}"
