"""Shared test set-up: one thread per process, gloo-friendly torchrun, runners for the CLI."""

from __future__ import annotations

import os

# Set before torch is imported by any test: 2 cores, several processes per test.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
# The grader's self-test lab (tests/selftest), for this process and every child it starts.
_TESTS = os.path.dirname(os.path.abspath(__file__))
os.environ["DDP_LAB_EXTRA_CHECKS"] = "selftest"
os.environ["PYTHONPATH"] = os.pathsep.join(
    [_TESTS, *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)]
)

import pytest  # noqa: E402
from _harness import run_trainer  # noqa: E402


@pytest.fixture
def trainer(tmp_path):
    """Run ``ddp_lab.train`` (plain python for nproc=1, real torchrun otherwise) into tmp dirs.

    Returns a function ``trainer(name, args, nproc=1) -> (CompletedProcess, out_dir)``.
    """

    def run(name: str, args: list[str], nproc: int = 1, **kwargs):
        out = tmp_path / name
        proc = run_trainer([*args, "--out", str(out), "--no-progress"], nproc=nproc, **kwargs)
        return proc, out

    return run
