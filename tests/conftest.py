"""Shared test set-up: one thread per process, gloo-friendly torchrun, runners for the CLI."""

from __future__ import annotations

import os

# Set before torch is imported by any test: 2 cores, several processes per test.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"

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
