"""The trainer's command line: every contract flag documented and accepted by torchrun."""

from __future__ import annotations

import json

import pytest
from _harness import REPO, run_trainer

COURSE_FLAGS = [
    "--dataset",
    "--data-dir",
    "--model",
    "--epochs",
    "--max-steps",
    "--batch-size",
    "--lr",
    "--seed",
    "--sync-bn",
    "--amp",
    "--accum-steps",
    "--clip-grad-norm",
    "--ckpt-dir",
    "--ckpt-every",
    "--keep-last",
    "--resume",
    "--rollback-drop",
    "--fail-at-step",
    "--fault",
    "--fail-rank",
    "--warmup-steps",
    "--grad-norm-warn",
    "--log-every",
    "--backend",
    "--pg-timeout",
    "--tensorboard",
    "--out",
]

# Every flag that takes effect today, with a value, as a student would type it.
ALL_FLAGS = [
    "--dataset",
    "synthetic",
    "--data-dir",
    "data",
    "--train-size",
    "64",
    "--test-size",
    "8",
    "--num-workers",
    "0",
    "--model",
    "mlp",
    "--epochs",
    "1",
    "--max-steps",
    "2",
    "--batch-size",
    "8",
    "--lr",
    "0.1",
    "--scale-lr",
    "--momentum",
    "0.5",
    "--weight-decay",
    "0.0001",
    "--seed",
    "1",
    "--amp",
    "bf16",
    "--accum-steps",
    "2",
    "--clip-grad-norm",
    "1.0",
    "--warmup-steps",
    "1",
    "--grad-norm-warn",
    "10",
    "--ckpt-dir",
    "CK",
    "--ckpt-every",
    "1",
    "--keep-last",
    "2",
    "--resume",
    "--rollback-drop",
    "50",
    "--fault",
    "raise",
    "--fail-rank",
    "1",
    "--backend",
    "gloo",
    "--pg-timeout",
    "60",
    "--tensorboard",
    "TB",
    "--out",
    "OUT",
    "--log-every",
    "1",
    "--no-progress",
]


@pytest.mark.timeout(60)
def test_help_documents_every_contract_flag():
    proc = run_trainer(["--help"], timeout=60)
    assert proc.returncode == 0
    for flag in COURSE_FLAGS:
        assert flag in proc.stdout, f"{flag} missing from --help"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_every_flag_passes_through_real_torchrun(tmp_path):
    """torchrun parses its own flags first; none of ours may be mistaken for one of its."""
    places = {"TB": tmp_path / "tb", "OUT": tmp_path / "out", "CK": tmp_path / "ck"}
    args = [str(places.get(a, a)) for a in ALL_FLAGS]
    dry = run_trainer([*args, "--dry-run"], nproc=2, timeout=120)
    assert dry.returncode == 0, dry.stderr[-2000:]
    config = json.loads(dry.stdout.strip().splitlines()[-1])
    assert config["world_size"] == 2 and config["config"]["accum_steps"] == 2
    assert config["config"]["clip_grad_norm"] == 1.0 and config["config"]["scale_lr"]
    # and the same flags really train: outputs and TensorBoard events appear
    run = run_trainer(args, nproc=2, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["lr"] == pytest.approx(0.1 * 2 * 2)
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tb").iterdir())
    assert sorted(p.name for p in (tmp_path / "ck").iterdir())[-1] == "ckpt-00000002.pt"


@pytest.mark.timeout(120)
def test_outputs_have_the_documented_fields(trainer):
    # --log-every 1: a record per step (the default, 10, records steps 10, 20, ... and the last)
    proc, out = trainer(
        "run", ["--train-size", "96", "--test-size", "20", "--batch-size", "16", "--log-every", "1"]
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "single process" in proc.stderr  # said once on start
    summary = json.loads((out / "summary.json").read_text())
    for key in ("final_loss", "accuracy", "steps", "world_size", "samples_per_s", "seconds"):
        assert key in summary, key
    assert summary["steps"] == 6 and summary["world_size"] == 1
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 7))
    for key in ("step", "epoch", "loss", "lr", "samples_per_s"):
        assert key in records[0]
    import torch

    state = torch.load(out / "model.pt", weights_only=True)
    assert "net.1.weight" in state  # a plain state dict, no "module." prefix


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_fault_flags_reach_the_trainer_through_torchrun(tmp_path):
    """The fault flags pass torchrun's parser and take effect: rank 0 fails at step 2."""
    flags = ["--fail-at-step", "2", "--fault", "raise", "--fail-rank", "0", "--sync-bn"]
    flags += ["--train-size", "64", "--test-size", "8", "--batch-size", "8"]
    proc = run_trainer([*flags, "--out", str(tmp_path / "out")], nproc=2, timeout=120)
    assert proc.returncode != 0
    assert "[rank 0] injected fault at step 2" in proc.stderr
    assert "unrecognized arguments" not in proc.stderr


@pytest.mark.timeout(120)
def test_make_lab_starts_jupyterlab_as_root_too(tmp_path):
    """``make lab`` as root (the usual case in a container) says so and passes
    ``--allow-root``; Jupyter refuses to start without it. The server answers, then stops."""
    import os
    import signal
    import subprocess
    import time
    import urllib.request

    from ddp_lab.dist import free_port

    port = free_port()
    args = f"--no-browser --ip=127.0.0.1 --port={port} --ServerApp.token=t"
    env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"))
    proc = subprocess.Popen(
        ["make", "--no-print-directory", "-C", str(REPO), "lab", f"JUPYTER_ARGS={args}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        deadline, answered = time.monotonic() + 90, False
        while time.monotonic() < deadline and proc.poll() is None and not answered:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status?token=t", timeout=5)
                answered = True
            except OSError:
                time.sleep(0.5)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        out = proc.communicate(timeout=30)[0]
    assert answered, out
    assert ("--allow-root" in out) == (os.geteuid() == 0), out
    assert "Running as root is not recommended" not in out, out
