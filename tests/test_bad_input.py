"""Bad input: one clear line naming the fix, a non-zero exit, no traceback, nothing lost."""

from __future__ import annotations

import pytest
import torch
from _harness import run_trainer

from ddp_lab import dist as ddp_dist
from ddp_lab.errors import UsageError


def _assert_clear_failure(proc, *needles: str) -> str:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, proc.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


CASES = {
    "unknown flag": (["--epoch", "1"], {}, ["unrecognized arguments: --epoch"]),
    "bad choice": (["--model", "vgg"], {}, ["--model", "vgg"]),
    "negative batch": (["--batch-size", "-4"], {}, ["--batch-size", "positive"]),
    "half-set torchrun env": (
        [],
        {"RANK": "0", "WORLD_SIZE": "2"},
        ["LOCAL_RANK", "MASTER_ADDR", "torchrun"],
    ),
    "nccl without GPU": (["--backend", "nccl"], {}, ["nccl", "--backend gloo"]),
    "zero log interval": (["--log-every", "0"], {}, ["--log-every", "positive"]),
    "negative warm-up": (["--warmup-steps", "-1"], {}, ["--warmup-steps", ">= 0"]),
    "negative grad-norm warning": (["--grad-norm-warn", "-1"], {}, ["--grad-norm-warn", "0: off"]),
    "cifar10 offline and missing": (
        ["--dataset", "cifar10", "--data-dir", "{tmp}/nothing"],
        {},
        ["--dataset synthetic", "--data-dir"],
    ),
    "resume without a folder": (["--resume"], {}, ["--resume needs --ckpt-dir"]),
    "no checkpoint kept": (
        ["--ckpt-dir", "{tmp}/ck", "--keep-last", "0"],
        {},
        ["--keep-last", "positive"],
    ),
    "negative rollback drop": (
        ["--ckpt-dir", "{tmp}/ck", "--rollback-drop", "-5"],
        {},
        ["--rollback-drop", "positive"],
    ),
    "failing rank out of range": (["--fail-rank", "3"], {}, ["--fail-rank 3", "0 .. 0"]),
    "hang on one process": (
        ["--fail-at-step", "2", "--fault", "hang"],
        {},
        ["--fault hang needs 2 or more processes", "torchrun"],
    ),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_gives_one_clear_line(case, tmp_path):
    if case == "nccl without GPU" and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    args, env, needles = CASES[case]
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.pt").write_bytes(b"an earlier run's weights")
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    proc = run_trainer(
        [*args, "--out", str(out), "--train-size", "64", "--test-size", "8"], env=env, timeout=60
    )
    _assert_clear_failure(proc, *needles)
    assert (out / "model.pt").read_bytes() == b"an earlier run's weights"


def test_more_local_processes_than_gpus_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(UsageError, match="--nproc_per_node=2"):
        ddp_dist.resolve_backend("auto", local_world_size=4)
    assert ddp_dist.resolve_backend("auto", local_world_size=2) == "nccl"
    assert ddp_dist.resolve_backend("gloo", local_world_size=4) == "gloo"


def test_torchrun_env_parsing():
    assert ddp_dist.torchrun_env({}) is None
    full = {
        "RANK": "1",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "x",
        "MASTER_PORT": "1",
    }
    assert ddp_dist.torchrun_env(full)["world_size"] == 2
    with pytest.raises(UsageError, match="inconsistent"):
        ddp_dist.torchrun_env({**full, "RANK": "2"})
    with pytest.raises(UsageError, match="integers"):
        ddp_dist.torchrun_env({**full, "MASTER_PORT": "abc"})
