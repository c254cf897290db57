"""Faults on purpose: a hang ends at --pg-timeout with a line naming the rank, the collective
and the step; a crash without restarts fails cleanly naming the failing rank; an fp16 inf
step is skipped and halves the scale; a forced accuracy drop triggers the rollback."""

from __future__ import annotations

import time

import pytest
from _trainer_helpers import jsonl, run, summary

SMALL = ["--model", "mlp", "--train-size", "256", "--test-size", "40", "--batch-size", "16"]


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "ddp_lab.train: error:" in line]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_hang_ends_at_the_pg_timeout_naming_rank_collective_and_step(tmp_path):
    t0 = time.monotonic()
    proc, left = run(
        [*SMALL, "--fail-at-step", "3", "--fault", "hang", "--pg-timeout", "4"],
        tmp_path / "out",
        nproc=2,
        timeout=100,
        torchrun_args=["--max-restarts=0"],
    )
    seconds = time.monotonic() - t0
    print(f"hang ended after {seconds:.1f} s (start-up included)\n{proc.stderr[-1500:]}")
    assert proc.returncode != 0
    assert not left, f"processes left behind: {left}"
    errors = _errors(proc.stderr)
    assert len(errors) == 1, proc.stderr[-3000:]
    line = errors[0]
    assert "[rank 0]" in line and "gradient all-reduce of step 3" in line
    assert "timed out after --pg-timeout 4 s" in line and "rank(s) 1 never arrived" in line
    assert "this rank stops here" in proc.stderr  # the hung rank said where it stopped
    assert seconds < 60  # start-up + 4 s + a short grace, never the 30-minute default


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_crash_without_restarts_fails_cleanly_naming_the_rank(tmp_path):
    proc, left = run(
        [*SMALL, "--fail-at-step", "2", "--fault", "raise"],
        tmp_path / "out",
        nproc=2,
        torchrun_args=["--max-restarts=0"],
    )
    assert proc.returncode != 0 and not left
    errors = _errors(proc.stderr)
    assert any("[rank 1] injected fault at step 2" in e for e in errors), proc.stderr[-3000:]
    assert all("[rank 0]" in e and "closed its connection" in e for e in errors if "rank 0" in e)
    assert 'ddp_lab/train.py", line' not in proc.stderr  # no traceback wall from our code
    assert "rank      : 1" in proc.stderr  # torchrun's summary names the failing rank
    assert not (tmp_path / "out" / "model.pt").exists()


@pytest.mark.timeout(120)
def test_fp16_inf_fault_is_skipped_and_halves_the_scale(tmp_path):
    flags = [*SMALL, "--amp", "fp16", "--max-steps", "5", "--log-every", "1"]
    proc, left = run([*flags, "--fail-at-step", "3", "--fault", "inf"], tmp_path / "out")
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = jsonl(tmp_path / "out" / "metrics.jsonl")
    assert [r["skipped"] for r in records] == [0, 0, 1, 0, 0]
    scales = [r["loss_scale"] for r in records]
    assert scales[:2] == [65536.0, 65536.0] and scales[2:] == [32768.0] * 3
    assert records[3]["loss"] == records[3]["loss"]  # the step after is finite again


@pytest.mark.timeout(120)
def test_rollback_restores_the_best_checkpoint_after_a_forced_accuracy_drop(tmp_path):
    """--fault scramble resets the weights at step 26 (a divergence on purpose); the
    checkpoint of step 28 measures the drop and restores the one of step 24. (A 200-sample
    test set moves by a few points between checkpoints: the rule here is 10 points.)"""
    flags = [*SMALL, "--test-size", "200", "--epochs", "2", "--lr", "0.1"]
    flags += ["--ckpt-dir", str(tmp_path / "ck"), "--ckpt-every", "4", "--rollback-drop", "10"]
    flags += ["--fail-at-step", "26", "--fault", "scramble"]
    proc, left = run(flags, tmp_path / "out")
    assert proc.returncode == 0, proc.stderr[-2000:]
    s = summary(tmp_path / "out")
    assert len(s["rollbacks"]) == 1, s["rollbacks"]
    rb = s["rollbacks"][0]
    print(rb)
    assert rb["step"] == 28 and rb["restored_step"] == 24
    assert 100 * (rb["restored_accuracy"] - rb["accuracy"]) > 10
    assert "rollback at step 28" in proc.stderr
    flagged = [r for r in jsonl(tmp_path / "out" / "metrics.jsonl") if "rollback" in r]
    assert [r["step"] for r in flagged] == [30]  # the record covering step 28
    assert [
        e["step"] for e in jsonl(tmp_path / "out" / "events.jsonl") if e["event"] == "rollback"
    ] == [28]
    assert s["accuracy"] > rb["accuracy"]  # training went on from the restored weights
