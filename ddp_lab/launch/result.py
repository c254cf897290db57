"""What a launch leaves behind, and the errors it raises."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LaunchResult:
    """What a torchrun launch left behind.

    Attributes:
        returncode: torchrun's exit status (negative: killed by that signal).
        logs: combined stdout and stderr of each rank (``rank -> text``); key ``-1`` holds
            torchrun's own output. A restart inserts a ``--- torchrun restart N ---`` line.
        result: the JSON object a worker wrote with :func:`write_result`, or ``None``.
        seconds: wall-clock duration of the launch.
        command: the command that was run.
        log_dir: where the log files were kept (only when ``log_dir=`` was given).
    """

    returncode: int
    logs: dict[int, str]
    result: dict | None
    seconds: float
    command: list[str]
    log_dir: str | None = field(default=None, repr=False)

    @property
    def ok(self) -> bool:
        """True when torchrun exited with status 0."""
        return self.returncode == 0


class LaunchError(RuntimeError):
    """A torchrun launch that did not succeed; ``.result`` holds what it left behind."""

    def __init__(self, message: str, result: LaunchResult | None = None):
        super().__init__(message)
        self.result = result


class LaunchTimeout(LaunchError):
    """The launch ran past its timeout; the whole process tree was killed."""


class LaunchFailed(LaunchError):
    """torchrun exited with a non-zero status (some rank failed)."""
