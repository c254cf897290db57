"""Helpers of the trainer's fault and elastic tests: free ports, several torchrun agents at
once, and a check that no process of a run outlives it.

torchrun starts its workers in sessions of their own, so killing torchrun's process group
(what ``_harness.run_tree`` does on a timeout) can leave workers behind. Every run here
carries a unique folder on its command line (its ``--out``); :func:`leftovers` finds the
processes that still carry it, and :func:`reap` kills them and says which they were.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import torch
from _harness import REPO, run_tree, trainer_command


def leftovers(marker: str) -> list[int]:
    """PIDs of live processes whose command line contains ``marker`` (not this process)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmdline and state != "Z":
            found.append(int(pid))
    return found


def reap(marker: str, grace_s: float = 3.0) -> list[int]:
    """Wait up to ``grace_s`` for the processes carrying ``marker`` to end, then SIGKILL
    the rest. Returns the PIDs that had to be killed (a test asserts it is empty)."""
    deadline = time.monotonic() + grace_s
    while (alive := leftovers(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in alive:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return alive


def run(args: list[str], out, nproc: int = 1, timeout: float = 180, torchrun_args=()):
    """Run the trainer (``torchrun_args`` go before ``-m``), then reap what it left.

    Returns:
        ``(CompletedProcess, pids that outlived it)``.
    """
    cmd = trainer_command([*args, "--out", str(out), "--no-progress"], nproc)
    if torchrun_args:
        i = cmd.index("-m")
        cmd = [*cmd[:i], *torchrun_args, *cmd[i:]]
    try:
        proc = run_tree(cmd, timeout=timeout)
    finally:
        left = reap(str(out))
    return proc, left


def start_agent(cmd: list[str], log_path: str) -> subprocess.Popen:
    """Start one torchrun agent in its own session, output into ``log_path``."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]),
    }
    with open(log_path, "w") as log:
        return subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True
        )


def wait_all(procs: list[subprocess.Popen], timeout: float) -> list[int | None]:
    """Wait for every process (``None`` for one still running at the deadline, then
    killed with its process group)."""
    deadline = time.monotonic() + timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            codes.append(None)
    return codes


def weights(out) -> dict:
    """The ``model.pt`` of a run folder."""
    return torch.load(os.path.join(out, "model.pt"), weights_only=True)


def max_abs_diff(a: dict, b: dict) -> float:
    """Largest absolute difference between two state dicts with the same keys."""
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def bit_identical(a: dict, b: dict) -> bool:
    """Same keys, same tensors bit for bit."""
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def jsonl(path) -> list[dict]:
    """The JSON objects of a ``.jsonl`` file."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def summary(out) -> dict:
    """The ``summary.json`` of a run folder."""
    with open(os.path.join(out, "summary.json")) as f:
        return json.load(f)
