"""Run a script under torchrun from a notebook, a Makefile target or a test.

:func:`torchrun` starts ``python -m torch.distributed.run --standalone`` (a free port every
time, so two launches never collide), shows a compact live view of the ranks' output, enforces
a timeout, and on timeout or Ctrl-C (Jupyter's stop button) kills the whole process tree:
torchrun *and* its workers, which torchrun starts in sessions of their own.

How the per-rank logs are captured: torchrun runs with ``--redirects 3 --log-dir DIR``, so
each worker writes its stdout and stderr to ``DIR/<run>/attempt_<k>/<local_rank>/std*.log``,
and torchrun's own (agent) output goes to a separate file. The launcher follows those files
as they grow (``PYTHONUNBUFFERED=1`` makes the workers write line by line), so it knows which
rank wrote each line without parsing prefixes, and it still has every line after a kill.

A worker script hands a result back to the notebook with :func:`write_result`::

    # worker.py, run by every rank
    import torch, torch.distributed as dist
    from ddp_lab.launch import write_result
    dist.init_process_group("gloo")
    t = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(t)
    write_result({"sum": t.item()})          # rank 0 writes, the others return

    # notebook
    >>> from ddp_lab.launch import torchrun
    >>> res = torchrun("worker.py", nproc=2)  # doctest: +SKIP
    [rank0] ...
    torchrun: 2 processes, exit 0, 3.1 s
    >>> res.result                            # doctest: +SKIP
    {'sum': 3.0}

Command line: ``python -m ddp_lab.launch --nproc 2 worker.py -- --flag value``.
Linux and macOS only: the tree is found and killed by :mod:`ddp_lab.proctree` (through
``/proc``, or ``ps`` where there is none).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ddp_lab.proctree import GRACE_S, POLL_S, SCAN_S, ProcessTree

#: The variable that tells a worker where to write its JSON result (see :func:`write_result`).
RESULT_ENV = "DDP_LAB_RESULT"
#: ``stream="summary"`` prints at most this many lines of rank output, then only errors.
SUMMARY_MAX_LINES = 200
#: Lines of the failing rank's log quoted in a :class:`LaunchFailed` message.
TAIL_LINES = 15
#: A line that reports an error: ``ValueError: ...``, ``prog: error: ...``, a fatal signal.
_ALERT = re.compile(
    r"\s*(?:[\w.]*(?:Error|Exception|Interrupt)\b|[\w.]+: error:"
    r"|Segmentation fault|Killed|Fatal Python error)"
)

#: The first line of a traceback, or of the next one in a chain.
_CHAINED = re.compile(
    r"Traceback \(most recent call last\)|During handling of the above|The above exception was"
)


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


def write_result(obj: Mapping) -> None:
    """Write a JSON result for the launching notebook, atomically, from rank 0 only.

    The file is the one named by ``$DDP_LAB_RESULT``, which :func:`torchrun` sets; without
    it (plain ``python worker.py``) this does nothing. Other ranks return without writing, so
    every rank may call it. Tensors and numpy values are converted with ``.tolist()``.

    Args:
        obj: a JSON-serialisable mapping.

    Example:
        >>> write_result({"loss": 0.25})   # no-op outside ddp_lab.launch.torchrun
    """
    if not isinstance(obj, Mapping):
        raise TypeError(f"write_result needs a dict, got {type(obj).__name__}")
    path = os.environ.get(RESULT_ENV)
    if not path or os.environ.get("RANK", "0") != "0":
        return
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(dict(obj), f, default=_jsonable)
    os.replace(tmp, path)


def _jsonable(o):
    if hasattr(o, "tolist"):  # torch.Tensor, numpy arrays and scalars
        return o.tolist()
    if isinstance(o, os.PathLike):
        return os.fspath(o)
    raise TypeError(f"write_result: {type(o).__name__} is not JSON serialisable")


def torchrun(
    target: str,
    args: Sequence[str] = (),
    *,
    nproc: int = 2,
    module: bool = False,
    timeout: float = 300,
    cwd: str | None = None,
    env: Mapping[str, str] | None = None,
    max_restarts: int = 0,
    stream: bool | str = "summary",
    check: bool = True,
    log_dir: str | None = None,
) -> LaunchResult:
    """Run ``target`` under ``torchrun --standalone`` with ``nproc`` processes.

    Args:
        target: path of a Python script (relative to ``cwd``), or a module with ``module=True``.
        args: command-line arguments for the script.
        nproc: processes (ranks) to start on this machine.
        module: run ``target`` as ``python -m target``.
        timeout: seconds before the whole process tree is killed and :class:`LaunchTimeout`
            raised (whatever ``check`` says).
        cwd: working directory of the workers (default: the current one).
        env: variables added to this process's environment. ``OMP_NUM_THREADS`` defaults to
            1; ``PYTHONUNBUFFERED=1``, ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (restarted gloo
            workers hang in rendezvous without it) and ``DDP_LAB_RESULT`` are always set, and
            this ``ddp_lab`` is put on ``PYTHONPATH``.
        max_restarts: how often torchrun restarts all workers after a failure.
        stream: ``"summary"`` (or True): rank 0's lines, other ranks' error lines and a
            one-line summary; ``"all"``: every line of every rank and of torchrun;
            False: print nothing.
        check: raise :class:`LaunchFailed` on a non-zero exit instead of returning.
        log_dir: keep the log files in a new folder under this one (default: a temporary
            folder, deleted afterwards; the logs are in the result either way).

    Returns:
        A :class:`LaunchResult`.

    Raises:
        LaunchFailed: non-zero exit with ``check=True``.
        LaunchTimeout: the launch took longer than ``timeout``.
        KeyboardInterrupt: re-raised after the process tree is killed.

    Example:
        >>> res = torchrun("worker.py", ["--steps", "10"], nproc=2)  # doctest: +SKIP
        [rank0] step 10 loss 0.41
        torchrun: 2 processes, exit 0, 4.2 s
        >>> res.ok, res.logs[1].splitlines()[0]                     # doctest: +SKIP
        (True, 'rank 1 ready')
    """
    mode = _stream_mode(stream)
    target = os.fspath(target)
    if not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc must be a positive integer, got {nproc!r}")
    if not timeout or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    workdir = Path(cwd) if cwd is not None else Path.cwd()
    if not module and not (workdir / target).is_file():
        raise FileNotFoundError(
            f"no script {target!r} in {workdir}; pass the script's path (relative to cwd=) "
            "or module=True for a module name"
        )
    if log_dir is not None:
        os.makedirs(log_dir, exist_ok=True)
        run_dir = Path(tempfile.mkdtemp(prefix=time.strftime("%Y%m%d-%H%M%S-"), dir=log_dir))
    else:
        run_dir = Path(tempfile.mkdtemp(prefix="ddp_lab-launch-"))
    result_path = run_dir / "result.json"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        f"--max-restarts={max_restarts}",
        f"--log-dir={run_dir / 'torchrun'}",
        "--redirects=3",
        *(["-m"] if module else []),
        target,
        *map(str, args),
    ]
    printer = _Printer(mode)
    logs = _Logs(run_dir, nproc, printer)
    try:
        t0 = time.monotonic()
        with open(run_dir / "agent.log", "wb") as agent_out:
            proc = subprocess.Popen(
                command,
                cwd=workdir,
                env=_worker_env(env, result_path),
                stdin=subprocess.DEVNULL,
                stdout=agent_out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        tree = ProcessTree(proc)
        try:
            killed = _supervise(proc, tree, logs, t0 + timeout)
        except BaseException:  # Ctrl-C, or a bug here: never leave workers behind
            tree.terminate(GRACE_S)
            logs.poll(final=True)
            printer.note(
                f"torchrun: interrupted after {time.monotonic() - t0:.1f} s; "
                f"killed {_n(tree.killed, 'process')}"
            )
            raise
        seconds = time.monotonic() - t0
        logs.poll(final=True)
        res = LaunchResult(
            returncode=proc.returncode,
            logs=logs.texts(),
            result=_read_result(result_path),
            seconds=seconds,
            command=command,
            log_dir=str(run_dir) if log_dir is not None else None,
        )
    finally:
        if log_dir is None:
            shutil.rmtree(run_dir, ignore_errors=True)
    procs = _n(nproc, "process")
    if killed is not None:
        printer.note(
            f"torchrun: {procs}, timed out after {timeout:g} s, killed {_n(killed, 'process')}"
        )
        raise LaunchTimeout(_timeout_message(res, target, timeout, killed), res)
    if res.ok:
        printer.note(f"torchrun: {procs}, exit 0, {seconds:.1f} s")
        return res
    rank, code = _first_failure(res)
    who = f", rank {rank} failed first" if rank is not None else ""
    printer.note(f"torchrun: {procs}, exit {res.returncode}{who}, {seconds:.1f} s")
    if check:
        raise LaunchFailed(_failure_message(res, target, rank, code), res)
    return res


def _stream_mode(stream: bool | str) -> str | None:
    if stream is True or stream == "summary":
        return "summary"
    if stream is False or stream is None or stream == "none":
        return None
    if stream == "all":
        return "all"
    raise ValueError(f"stream must be 'summary', 'all' or False, got {stream!r}")


def _worker_env(extra: Mapping[str, str] | None, result_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(extra or {})
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    env[RESULT_ENV] = str(result_path)
    root = str(Path(__file__).resolve().parent.parent)  # so workers import this ddp_lab
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in paths:
        env["PYTHONPATH"] = os.pathsep.join([root, *paths])
    return env


def _supervise(
    proc: subprocess.Popen, tree: ProcessTree, logs: _Logs, deadline: float
) -> int | None:
    """Follow the logs until torchrun exits (None) or the deadline passes (processes killed)."""
    next_scan = 0.0
    while True:
        logs.poll()
        if proc.poll() is not None:
            break
        now = time.monotonic()
        if now >= deadline:
            return tree.terminate(GRACE_S)
        if now >= next_scan:  # remember every descendant, in case one outlives torchrun
            tree.refresh()
            next_scan = now + SCAN_S
        time.sleep(POLL_S)
    if tree.alive(tree.refresh()):  # a worker's own child that torchrun left behind
        tree.terminate(1.0)
    return None


def _read_result(path: Path) -> dict | None:
    try:
        with open(path) as f:
            obj = json.load(f)
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}es"


# --- following the log files -------------------------------------------------------------


class _Follower:
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


class _Logs:
    """Every line of torchrun (rank -1) and of each rank, in the order they were read."""

    def __init__(self, run_dir: Path, nproc: int, printer: _Printer):
        self.root = run_dir / "torchrun"
        self.printer = printer
        self.lines: dict[int, list[str]] = {r: [] for r in range(-1, nproc)}
        self.agent = _Follower(run_dir / "agent.log")
        self.files: dict[tuple[int, int, int], _Follower] = {}  # (attempt, rank, 0/1)
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
                            self.files[key] = _Follower(rank_dir / f"{name}.log")
            if attempt > self.newest:
                self.newest = attempt
                self.printer.note(f"torchrun: restarting all workers (restart {attempt})")

    def _add(self, rank: int, line: str) -> None:
        self.lines.setdefault(rank, []).append(line)
        self.printer.line(rank, line)

    def texts(self) -> dict[int, str]:
        return {r: "".join(f"{line}\n" for line in lines) for r, lines in self.lines.items()}


def _display(line: str, rank: int) -> str:
    """A log line as shown: last progress-bar update only, torch's ``[rankN]:`` prefix gone."""
    line = next((part for part in reversed(line.split("\r")) if part.strip()), "")
    for prefix in (f"[rank{rank}]: ", f"[rank{rank}]:"):
        if line.startswith(prefix):
            return line[len(prefix) :].rstrip()
    return line.rstrip()


class _Printer:
    """The live view. ``summary``: rank 0's lines, other ranks' error lines, and every
    traceback shortened to its last line (the whole one is in the error and in the logs)."""

    def __init__(self, mode: str | None):
        self.mode, self.shown, self.capped = mode, 0, False
        self.in_traceback: set[int] = set()
        self.after_traceback: set[int] = set()

    def line(self, rank: int, line: str) -> None:
        if self.mode is None:
            return
        text = _display(line, rank)
        if self.mode == "all":
            self._emit(f"[torchrun] {text}" if rank < 0 else f"[rank{rank}] {text}")
            return
        if rank < 0 or self._traceback_body(rank, text):
            return
        if _ALERT.match(text):
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


# --- error messages ----------------------------------------------------------------------


def _first_failure(res: LaunchResult) -> tuple[int | None, int | None]:
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
        if any(_ALERT.match(_display(line, r)) for line in res.logs[r].splitlines()):
            return r, None
    return None, None


def _describe(code: int | None) -> str:
    if code is None:
        return "an error"
    if code >= 0:
        return f"exit code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    return f"{name}" + (" (out of memory?)" if name == "SIGKILL" else "")


def _tail(res: LaunchResult, rank: int, n: int) -> str:
    lines = [_display(line, rank) for line in res.logs.get(rank, "").splitlines()[-n:]]
    return "\n".join(f"    {line}" for line in lines) if lines else "    (no output)"


def _failure_message(res: LaunchResult, target: str, rank: int | None, code: int | None) -> str:
    head = f"torchrun {target} failed with exit code {res.returncode} after {res.seconds:.1f} s"
    if rank is None:
        return f"{head}; no rank reported an error. torchrun said:\n{_tail(res, -1, TAIL_LINES)}"
    return (
        f"{head}: rank {rank} failed first ({_describe(code)}). Last lines of rank {rank} "
        f"(all logs: err.result.logs):\n{_tail(res, rank, TAIL_LINES)}"
    )


def _timeout_message(res: LaunchResult, target: str, timeout: float, killed: int) -> str:
    ranks = sorted(r for r in res.logs if r >= 0)
    shown = "\n".join(f"Last lines of rank {r}:\n{_tail(res, r, 5)}" for r in ranks[:4])
    more = f"\n(ranks {ranks[4]}-{ranks[-1]} not shown: err.result.logs)" if len(ranks) > 4 else ""
    return (
        f"torchrun {target} did not finish within {timeout:g} s; killed "
        f"{_n(killed, 'process')}. A hang usually means the ranks disagree about the next "
        "collective (one skipped a barrier or all_reduce) or wait for a rank that died; if "
        f"the job is just slow, raise timeout=.\n{shown}{more}"
    )


# --- command line ------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m ddp_lab.launch [--nproc N] [--timeout S] [-m] target -- args...``."""
    p = argparse.ArgumentParser(
        prog="python -m ddp_lab.launch",
        description="Run a script under torchrun --standalone with a timeout, compact "
        "per-rank output and no process left behind.",
    )
    p.add_argument("--nproc", type=int, default=2, help="processes (default 2)")
    p.add_argument("--timeout", type=float, default=300, help="seconds (default 300)")
    p.add_argument("--max-restarts", type=int, default=0)
    p.add_argument("--stream", choices=["summary", "all", "none"], default="summary")
    p.add_argument("--log-dir", help="keep per-rank log files under this folder")
    p.add_argument("-m", "--module", action="store_true", help="target is a module name")
    p.add_argument("target", help="script path, or module name with -m")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the target")
    ns = p.parse_args(argv)
    args = ns.args[1:] if ns.args[:1] == ["--"] else ns.args
    try:
        res = torchrun(
            ns.target,
            args,
            nproc=ns.nproc,
            module=ns.module,
            timeout=ns.timeout,
            max_restarts=ns.max_restarts,
            stream=ns.stream,
            log_dir=ns.log_dir,
        )
    except LaunchTimeout as err:
        print(f"ddp_lab.launch: {err}", file=sys.stderr)
        return 124
    except LaunchFailed as err:
        print(f"ddp_lab.launch: {err}", file=sys.stderr)
        return err.result.returncode if err.result else 1
    except (ValueError, FileNotFoundError) as err:
        print(f"ddp_lab.launch: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return res.returncode


if __name__ == "__main__":
    sys.exit(main())
