"""Helpers the tests share: subprocess runners with a timeout that kill the process tree."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_tree(
    cmd: list[str], timeout: float = 240, env: dict | None = None, cwd: str | None = None
) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own session; on timeout kill the whole process group and fail."""
    full_env = {
        **os.environ,
        "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]),
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        **(env or {}),
    }
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=full_env,
        cwd=cwd or REPO,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"{' '.join(cmd)} timed out after {timeout} s\n{out}\n{err}") from None
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # nothing of the run may outlive it
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def trainer_command(args: list[str], nproc: int = 1) -> list[str]:
    """``python -m ddp_lab.train`` for one process, the real torchrun command line otherwise."""
    if nproc == 1:
        return [sys.executable, "-m", "ddp_lab.train", *args]
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    return [torchrun, "--standalone", f"--nproc_per_node={nproc}", "-m", "ddp_lab.train", *args]


def run_trainer(
    args: list[str], nproc: int = 1, timeout: float = 240, env: dict | None = None
) -> subprocess.CompletedProcess:
    """Run the trainer; return the completed process (check ``returncode`` yourself)."""
    return run_tree(trainer_command(args, nproc), timeout=timeout, env=env)


def spawn_gloo(fn, world_size: int, tmp_dir: str, *args, timeout: float = 120) -> None:
    """Run ``fn(rank, world_size, tmp_dir, *args)`` in ``world_size`` gloo processes.

    ``fn`` must be importable (defined in a module, not in a test or a notebook). The
    process group rendezvous through a file in ``tmp_dir``: no port is ever used. Fails
    when a process fails or the group does not finish in ``timeout`` s; kills leftovers.
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world_size, tmp_dir, args))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout)
        codes = [p.exitcode for p in procs]
        assert all(c == 0 for c in codes), f"worker exit codes {codes}"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()


def _entry(fn, rank: int, world_size: int, tmp_dir: str, args: tuple) -> None:
    import datetime

    import torch.distributed as dist

    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp_dir}/pg-store",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        fn(rank, world_size, tmp_dir, *args)
    finally:
        dist.destroy_process_group()


def assert_verdicts(judge, seed: int, inputs: dict, right: dict, wrongs: dict) -> None:
    """``judge`` accepts the right outputs and rejects every wrong one (``name -> outputs``)
    for the inputs drawn with ``seed`` (the labs' property tests over many draws)."""
    from ddp_lab.checks import CheckFailed

    try:
        judge(inputs, right)
    except CheckFailed as err:
        pytest.fail(f"seed {seed}: the right answer failed: {err}")
    for name, outputs in wrongs.items():
        with pytest.raises(CheckFailed):
            judge(inputs, outputs)
            pytest.fail(f"seed {seed}: the mistake {name!r} passed")
