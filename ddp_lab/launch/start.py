"""Starting torchrun, supervising it until it ends or times out, and handing back results."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from ddp_lab.childenv import child_env
from ddp_lab.launch.logs import Logs, Printer
from ddp_lab.launch.messages import failure_message, first_failure, plural, timeout_message
from ddp_lab.launch.result import LaunchFailed, LaunchResult, LaunchTimeout
from ddp_lab.proctree import GRACE_S, POLL_S, SCAN_S, ProcessTree

#: The variable that tells a worker where to write its JSON result (see :func:`write_result`).
RESULT_ENV = "DDP_LAB_RESULT"


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
    printer = Printer(mode)
    logs = Logs(run_dir, nproc, printer)
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
                f"killed {plural(tree.killed, 'process')}"
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
    procs = plural(nproc, "process")
    if killed is not None:
        printer.note(
            f"torchrun: {procs}, timed out after {timeout:g} s, killed {plural(killed, 'process')}"
        )
        raise LaunchTimeout(timeout_message(res, target, timeout, killed), res)
    if res.ok:
        printer.note(f"torchrun: {procs}, exit 0, {seconds:.1f} s")
        return res
    rank, code = first_failure(res)
    who = f", rank {rank} failed first" if rank is not None else ""
    printer.note(f"torchrun: {procs}, exit {res.returncode}{who}, {seconds:.1f} s")
    if check:
        raise LaunchFailed(failure_message(res, target, rank, code), res)
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
    """The workers' environment: :func:`ddp_lab.childenv.child_env` plus the result file."""
    return child_env({**(extra or {}), RESULT_ENV: str(result_path)})


def _supervise(
    proc: subprocess.Popen, tree: ProcessTree, logs: Logs, deadline: float
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
