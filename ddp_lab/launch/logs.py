"""Following torchrun's per-rank log files as they grow, and the live view of them.

torchrun runs with ``--redirects 3 --log-dir DIR``: each worker writes its stdout and stderr
to ``DIR/<run>/attempt_<k>/<local_rank>/std*.log`` and the agent's own output goes to a
separate file. :class:`Logs` follows those files (so it knows which rank wrote each line
without parsing prefixes, and still has every line after a kill); :class:`Printer` shows a
compact live view of them.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

#: ``stream="summary"`` prints at most this many lines of rank output, then only errors.
SUMMARY_MAX_LINES = 200
#: A line that reports an error: ``ValueError: ...``, ``prog: error: ...``, a fatal signal.
ALERT = re.compile(
    r"\s*(?:[\w.]*(?:Error|Exception|Interrupt)\b|[\w.]+: error:"
    r"|Segmentation fault|Killed|Fatal Python error)"
)

#: The first line of a traceback, or of the next one in a chain.
_CHAINED = re.compile(
    r"Traceback \(most recent call last\)|During handling of the above|The above exception was"
)


class Follower:
    """The complete new lines of one growing file (a partial last line waits for its end)."""

    def __init__(self, path: Path):
        self.path, self.offset, self.partial = path, 0, b""

    def read(self, final: bool = False) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            data = b""
        self.offset += len(data)
        *lines, self.partial = (self.partial + data).split(b"\n")
        if final and self.partial:
            lines.append(self.partial)
            self.partial = b""
        return [line.decode("utf-8", "replace") for line in lines]


class Logs:
    """Every line of torchrun (rank -1) and of each rank, in the order they were read."""

    def __init__(self, run_dir: Path, nproc: int, printer: Printer):
        self.root = run_dir / "torchrun"
        self.printer = printer
        self.lines: dict[int, list[str]] = {r: [] for r in range(-1, nproc)}
        self.agent = Follower(run_dir / "agent.log")
        self.files: dict[tuple[int, int, int], Follower] = {}  # (attempt, rank, 0/1)
        self.attempt = {r: 0 for r in range(nproc)}
        self.newest = 0

    def poll(self, final: bool = False) -> None:
        for line in self.agent.read(final):
            self._add(-1, line)
        self._discover()
        for (attempt, rank, _), follower in sorted(self.files.items()):
            lines = follower.read(final or attempt < self.newest)
            if lines and attempt > self.attempt.setdefault(rank, attempt):
                self.attempt[rank] = attempt
                self.lines.setdefault(rank, []).append(f"--- torchrun restart {attempt} ---")
            for line in lines:
                self._add(rank, line)

    def _discover(self) -> None:
        for attempt_dir in self.root.glob("*/attempt_*"):
            attempt = int(attempt_dir.name.rpartition("_")[2])
            for rank_dir in attempt_dir.iterdir():
                if rank_dir.name.isdigit():
                    for i, name in enumerate(("stdout", "stderr")):  # tracebacks last
                        key = (attempt, int(rank_dir.name), i)
                        if key not in self.files:
                            self.files[key] = Follower(rank_dir / f"{name}.log")
            if attempt > self.newest:
                self.newest = attempt
                self.printer.note(f"torchrun: restarting all workers (restart {attempt})")

    def _add(self, rank: int, line: str) -> None:
        self.lines.setdefault(rank, []).append(line)
        self.printer.line(rank, line)

    def texts(self) -> dict[int, str]:
        return {r: "".join(f"{line}\n" for line in lines) for r, lines in self.lines.items()}


def display(line: str, rank: int) -> str:
    """A log line as shown: last progress-bar update only, torch's ``[rankN]:`` prefix gone."""
    line = next((part for part in reversed(line.split("\r")) if part.strip()), "")
    for prefix in (f"[rank{rank}]: ", f"[rank{rank}]:"):
        if line.startswith(prefix):
            return line[len(prefix) :].rstrip()
    return line.rstrip()


class Printer:
    """The live view. ``summary``: rank 0's lines, other ranks' error lines, and every
    traceback shortened to its last line (the whole one is in the error and in the logs)."""

    def __init__(self, mode: str | None):
        self.mode, self.shown, self.capped = mode, 0, False
        self.in_traceback: set[int] = set()
        self.after_traceback: set[int] = set()

    def line(self, rank: int, line: str) -> None:
        if self.mode is None:
            return
        text = display(line, rank)
        if self.mode == "all":
            self._emit(f"[torchrun] {text}" if rank < 0 else f"[rank{rank}] {text}")
            return
        if rank < 0 or self._traceback_body(rank, text):
            return
        if ALERT.match(text):
            self._emit(f"[rank{rank}] {text}")
        elif rank == 0 and self.shown < SUMMARY_MAX_LINES:
            self._emit(f"[rank{rank}] {text}")
        elif rank == 0 and not self.capped:
            self.capped = True
            self._emit(
                f"[ddp_lab.launch] more than {SUMMARY_MAX_LINES} lines; showing only "
                "errors now (all lines: result.logs)"
            )

    def _traceback_body(self, rank: int, text: str) -> bool:
        """True for the lines of a traceback before its final ``SomeError: ...`` line."""
        if _CHAINED.match(text):
            self.in_traceback.add(rank)
            return True
        if rank in self.in_traceback:
            if not text or text[0].isspace():
                return True
            self.in_traceback.discard(rank)
            self.after_traceback.add(rank)  # hide the blank line before a chained traceback
            return False
        if rank in self.after_traceback:
            if not text:
                return True
            self.after_traceback.discard(rank)
        return False

    def note(self, text: str) -> None:
        if self.mode is not None:
            self._emit(text)

    def _emit(self, text: str) -> None:
        print(text, file=sys.stdout, flush=True)
        self.shown += 1
