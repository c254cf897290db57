"""Helpers the tests share (one kit, so that no test file grows its own copy):

- subprocess runners with a timeout that kill the process tree (:func:`run_tree`,
  :func:`run_trainer`), in the course's child environment (:func:`ddp_lab.childenv.child_env`);
- notebooks: a lab's solution and released sources (:func:`solution_sources`,
  :func:`released_sources`), a lab notebook with some solution cells replaced
  (:func:`notebook_with`);
- processes: what is left alive that mentions a marker (:func:`leftover_processes`,
  :func:`new_leftovers`), a test's own temporary folder as that marker (:func:`own_tmpdir`);
  Jupyter's stop button pressed once some files exist (:func:`stop_button`);
- gloo groups joined through a ``file://`` store, no port (:func:`spawn_gloo`,
  :func:`join_gloo`);
- one lab's graded pieces for its test file: the full judge, inputs of a draw, a mistake
  (:class:`GradedLab`), and outputs as the judge receives them (:func:`saved`);
- verdicts over many draws (:func:`assert_verdicts`).
"""

from __future__ import annotations

import _thread
import contextlib
import copy
import datetime
import importlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
import torch

from ddp_lab.childenv import child_env
from ddp_lab.grading.notebook import is_solution, load, nbgrader_meta
from ddp_lab.grading.notebook import solution_sources as _sources

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = Path(REPO)


def run_tree(
    cmd: list[str], timeout: float = 240, env: dict | None = None, cwd: str | None = None
) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own session; on timeout kill the whole process group and fail."""
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    full_env = child_env({"PATH": path, "OMP_NUM_THREADS": "1", **(env or {})})
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


def join_gloo(rank: int, world_size: int, store_dir: str | Path, timeout_s: float = 60) -> None:
    """Join a gloo group of ``world_size`` through the file ``store_dir/pg-store`` (no port)."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"file://{Path(store_dir) / 'pg-store'}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def _entry(fn, rank: int, world_size: int, tmp_dir: str, args: tuple) -> None:
    import torch.distributed as dist

    os.environ["OMP_NUM_THREADS"] = "1"
    join_gloo(rank, world_size, tmp_dir)
    try:
        fn(rank, world_size, tmp_dir, *args)
        # every rank done with its pairs before any tears them down (ci11: gloo aborted one
        # rank with "terminate called without an active exception" once in 11 runs)
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    # Done, results written: leave without running gloo's C++ destructors, which still
    # aborted a rank of a finished group now and then (SIGABRT after the barrier, "terminate
    # called without an active exception": test-fast of 2026-12-06, test_collectives world 3).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# --- notebooks ---------------------------------------------------------------------------


def lab_notebook(lab: str, folder: str = "solutions") -> dict:
    """A lab's notebook as JSON: ``folder`` is ``"solutions"`` (source) or ``"labs"`` (release)."""
    return load(ROOT / folder / lab / f"{lab}.ipynb")


def solution_sources(lab: str) -> dict[str, str]:
    """``grade_id -> source`` of the solution cells of a lab's *solutions* notebook."""
    return _sources(lab_notebook(lab, "solutions"))


def released_sources(lab: str) -> dict[str, str]:
    """``grade_id -> source`` of the solution cells as released (the stubs)."""
    return _sources(lab_notebook(lab, "labs"))


def notebook_with(lab: str, replace: Mapping[str, str], folder: str = "solutions") -> dict:
    """The lab's notebook with the solution cells named in ``replace`` swapped for new sources.

    Example:
        >>> nb = notebook_with("lab01_data_parallel", {"ex2_data_parallel_step": "x = 1"})
    """
    nb = copy.deepcopy(lab_notebook(lab, folder))
    unknown = set(replace) - {nbgrader_meta(c).get("grade_id") for c in nb["cells"]}
    assert not unknown, f"{lab} has no solution cells {sorted(unknown)}"
    for cell in nb["cells"]:
        gid = nbgrader_meta(cell).get("grade_id")
        if is_solution(cell) and gid in replace:
            cell["source"] = replace[gid]
    return nb


class GradedLab:
    """One lab's exercises as its test file uses them: ``judge(gid)`` is the grader's full
    judge (kit oracle + ``HIDDEN``), ``inputs(gid, seed)`` a draw, ``mistake(name)`` one of
    ``MISTAKES``/``MORE_MISTAKES`` and ``mistake_ns(name)`` its cell run in a namespace.

    Example:
        >>> lab = GradedLab("lab05_amp_accumulation")
        >>> sorted(lab.inputs("test_ex4_ddp_step", 0)) == ["cases"]
        True
    """

    def __init__(self, lab: str) -> None:
        from ddp_lab.checks.contract import exercises

        answers = importlib.import_module(f"ddp_lab.answers.{lab.split('_', 1)[0]}")
        self.lab = lab
        self.exercises = exercises(lab)
        self.sources = solution_sources(lab)
        self.hidden = answers.HIDDEN
        self.mistakes = (*answers.MISTAKES, *getattr(answers, "MORE_MISTAKES", ()))

    def judge(self, gid: str):
        from ddp_lab.answers import full_judge

        return full_judge(self.exercises[gid], self.hidden.get(gid))

    def inputs(self, gid: str, seed: int) -> dict:
        return self.exercises[gid].make_inputs(torch.Generator().manual_seed(seed))

    def mistake(self, name: str):
        return next(m for m in self.mistakes if m.name == name)

    def mistake_ns(self, name: str) -> dict:
        from ddp_lab.checks.runner import namespace

        m = self.mistake(name)
        return namespace({m.cell: m.source}, [m.cell])


def saved(outputs):
    """What a judge gets: ``outputs`` through ``torch.save`` / ``torch.load(weights_only=True)``."""
    with tempfile.TemporaryDirectory() as tmp:
        torch.save(outputs, Path(tmp) / "o.pt")
        return torch.load(Path(tmp) / "o.pt", weights_only=True)


# --- processes -----------------------------------------------------------------------------


def leftover_processes(marker: str) -> list[str]:
    """Live processes (not zombies, not this one) whose command line or working folder
    contains ``marker``, as ``"pid: command (in cwd)"``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            cwd = os.readlink(f"/proc/{pid}/cwd")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and (marker in cmd or marker in cwd) and int(pid) != os.getpid():
            found.append(f"{pid}: {cmd[:200]} (in {cwd})")
    return found


def wait_for_files(paths: list[Path], seconds: float) -> bool:
    """True once every file of ``paths`` exists; False after ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if all(p.exists() for p in paths):
            return True
        time.sleep(0.05)
    return False


@contextlib.contextmanager
def stop_button(paths: list[Path], within: float, delay: float = 0.5) -> Iterator[list[bool]]:
    """Press Jupyter's stop button (SIGINT to the kernel's main thread, here
    ``_thread.interrupt_main``) ``delay`` seconds after every file of ``paths`` exists, if
    that happens within ``within`` seconds and before the block ends. Yields a list that holds
    True once pressed.

    ``interrupt_main`` does nothing while SIGINT is ignored or at its default: the press needs
    Python's own handler, which tests/conftest.py puts in place before every test (a worker
    started in the background inherits SIGINT ignored)."""
    pressed: list[bool] = []
    done = threading.Event()

    def press() -> None:
        if wait_for_files(paths, within) and not done.wait(delay):
            pressed.append(True)
            _thread.interrupt_main()

    threading.Thread(target=press, daemon=True).start()
    try:
        yield pressed
    finally:
        done.set()


def own_tmpdir(monkeypatch, path: Path) -> str:
    """Make ``path`` the temporary folder of this process and its children (``TMPDIR``): the
    grader's and the checks' folders, and so every process they start (by its command line
    or working folder), carry it. Returns it as the marker for :func:`new_leftovers`, which
    then finds this test's processes only, not those of a test running beside it."""
    monkeypatch.setenv("TMPDIR", str(path))
    monkeypatch.setattr(tempfile, "tempdir", None)
    return str(path)


def new_leftovers(before: set[str], marker: str) -> list[str]:
    """:func:`leftover_processes` among the processes started since ``before``
    (``before = set(os.listdir("/proc"))`` taken earlier)."""
    return [p for p in leftover_processes(marker) if p.split(":", 1)[0] not in before]


def assert_verdicts(judge, seed: int, inputs: dict, right: dict, wrongs: dict) -> None:
    """``judge`` accepts the right outputs and rejects every wrong one (``name -> outputs``)
    for the inputs drawn with ``seed`` (the labs' property tests over many draws)."""
    from ddp_lab.checks.failure import CheckFailed

    try:
        judge(inputs, right)
    except CheckFailed as err:
        pytest.fail(f"seed {seed}: the right answer failed: {err}")
    for name, outputs in wrongs.items():
        with pytest.raises(CheckFailed):
            judge(inputs, outputs)
            pytest.fail(f"seed {seed}: the mistake {name!r} passed")
