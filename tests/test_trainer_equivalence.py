"""The trainer's central proofs: distributed runs equal their single-process equivalents.

DDP with N processes x batch b averages N shard gradients of a mean loss, which is the
gradient of one process on the union batch of N*b samples. With the same seed, the
DistributedSampler's permutation is the same for any world size and rank r reads every
N-th index of it, so step k of the N processes covers exactly the samples of step k of the
single big-batch process. The weights must therefore agree to float rounding.
"""

from __future__ import annotations

import json

import pytest
import torch

from ddp_lab.models import build_model

COMMON = [
    "--model",
    "mlp",
    "--dataset",
    "synthetic",
    "--train-size",
    "320",
    "--test-size",
    "50",
    "--lr",
    "0.05",
    "--seed",
    "3",
]


def _load(out):
    return torch.load(out / "model.pt", weights_only=True)


def max_abs_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def _ok(proc):
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("nproc,per_proc", [(2, 16), (3, 8)])
def test_ddp_matches_single_process_big_batch(trainer, nproc, per_proc):
    # 2 epochs: set_epoch must reshuffle identically for both runs.
    big, out_big = trainer("big", [*COMMON, "--epochs", "2", "--batch-size", str(nproc * per_proc)])
    ddp, out_ddp = trainer(
        "ddp", [*COMMON, "--epochs", "2", "--batch-size", str(per_proc)], nproc=nproc
    )
    _ok(big)
    _ok(ddp)
    s_big = json.loads((out_big / "summary.json").read_text())
    s_ddp = json.loads((out_ddp / "summary.json").read_text())
    assert s_ddp["world_size"] == nproc and s_big["world_size"] == 1
    assert s_ddp["steps"] == s_big["steps"] >= 8
    diff = max_abs_diff(_load(out_big), _load(out_ddp))
    print(f"DDP {nproc}x{per_proc} vs 1x{nproc * per_proc}: max abs diff {diff:.3g}")
    assert diff <= 1e-5
    # The run really trained (a broken all-reduce that leaves weights alone would pass above
    # only if both did nothing): weights moved away from the initial ones.
    torch.manual_seed(3)
    start = build_model("mlp").state_dict()
    assert max_abs_diff(start, _load(out_ddp)) > 1e-2


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ddp_without_gradient_averaging_would_differ(trainer):
    """Sensitivity: the same comparison with a 1x16 run (no averaging partner) differs."""
    small, out_small = trainer("small", [*COMMON, "--batch-size", "16"])
    big, out_big = trainer("big", [*COMMON, "--batch-size", "32"])
    _ok(small)
    _ok(big)
    assert max_abs_diff(_load(out_small), _load(out_big)) > 1e-3


@pytest.mark.timeout(120)
def test_accumulation_matches_big_batch(trainer):
    """k micro-batches with loss / k and one optimizer step equal one batch k times larger."""
    big, out_big = trainer("big", [*COMMON, "--batch-size", "32"])
    acc, out_acc = trainer("acc", [*COMMON, "--batch-size", "8", "--accum-steps", "4"])
    _ok(big)
    _ok(acc)
    assert json.loads((out_acc / "summary.json").read_text())["steps"] == 10
    assert max_abs_diff(_load(out_big), _load(out_acc)) <= 1e-5


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ddp_with_accumulation_matches_big_batch(trainer):
    big, out_big = trainer("big", [*COMMON, "--batch-size", "32"])
    ddp, out_ddp = trainer("ddp", [*COMMON, "--batch-size", "8", "--accum-steps", "2"], nproc=2)
    _ok(big)
    _ok(ddp)
    assert max_abs_diff(_load(out_big), _load(out_ddp)) <= 1e-5


@pytest.mark.timeout(120)
def test_same_seed_gives_bit_identical_model(trainer):
    a, out_a = trainer("a", [*COMMON, "--model", "cnn", "--max-steps", "4"])
    b, out_b = trainer("b", [*COMMON, "--model", "cnn", "--max-steps", "4"])
    c, out_c = trainer("c", [*COMMON, "--model", "cnn", "--max-steps", "4", "--seed", "4"])
    for p in (a, b, c):
        _ok(p)
    sa, sb, sc = _load(out_a), _load(out_b), _load(out_c)
    assert all(torch.equal(sa[k], sb[k]) for k in sa), "same seed, different weights"
    assert not all(torch.equal(sa[k], sc[k]) for k in sa), "the seed changes nothing"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_same_seed_gives_bit_identical_model_under_torchrun(trainer):
    a, out_a = trainer("a", [*COMMON, "--batch-size", "16", "--max-steps", "8"], nproc=2)
    b, out_b = trainer("b", [*COMMON, "--batch-size", "16", "--max-steps", "8"], nproc=2)
    _ok(a)
    _ok(b)
    sa, sb = _load(out_a), _load(out_b)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sync_bn_ddp_matches_global_batchnorm(trainer):
    """With --sync-bn, 2 x 16 equals 1 x 32 (weights AND BatchNorm buffers); without, not."""
    args = [*COMMON, "--model", "cnn", "--max-steps", "8", "--lr", "0.1"]
    big, out_big = trainer("big", [*args, "--batch-size", "32"])
    sync, out_sync = trainer("sync", [*args, "--batch-size", "16", "--sync-bn"], nproc=2)
    plain, out_plain = trainer("plain", [*args, "--batch-size", "16"], nproc=2)
    for p in (big, sync, plain):
        _ok(p)
    ref, with_sync, without = _load(out_big), _load(out_sync), _load(out_plain)
    buffers = [k for k in ref if "running_" in k]
    assert buffers
    d_sync = max_abs_diff(ref, with_sync)
    d_sync_buf = max(max_abs_diff({k: ref[k]}, {k: with_sync[k]}) for k in buffers)
    d_plain = max_abs_diff(ref, without)
    print(
        f"sync-bn 2x16 vs 1x32: {d_sync:.3g} (buffers {d_sync_buf:.3g}); "
        f"without sync-bn: {d_plain:.3g}"
    )
    assert d_sync <= 1e-4
    assert d_plain > 1e-2
