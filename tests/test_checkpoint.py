"""Checkpoints: checksummed, written atomically, the previous one used when the newest is
corrupt, pruned with the best kept, and a data order that resumes mid-epoch at any world
size without reading a sample twice or skipping one."""

from __future__ import annotations

import os

import pytest
import torch
from _trainer_helpers import bit_identical, run, summary, weights
from torch.utils.data import DistributedSampler

from ddp_lab import checkpoint as ck


def test_checksum_catches_truncation_and_damage():
    data = ck.encode({"step": 7, "w": torch.arange(1000.0)})
    assert ck.decode(data)["step"] == 7
    with pytest.raises(ck.CorruptCheckpoint, match="checksum"):
        ck.decode(data[: len(data) // 2])
    damaged = bytearray(data)
    damaged[-10] ^= 0xFF
    with pytest.raises(ck.CorruptCheckpoint, match="checksum"):
        ck.decode(bytes(damaged))
    with pytest.raises(ck.CorruptCheckpoint, match="header"):
        ck.decode(b"not a checkpoint")


def test_a_failed_write_overwrites_nothing(tmp_path, monkeypatch):
    path = tmp_path / "ckpt-00000004.pt"
    ck.write_atomic(b"the good one", str(path))

    def disk_full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(OSError, match="No space"):
        ck.write_atomic(b"half of a new one", str(path))
    assert path.read_bytes() == b"the good one"
    assert os.listdir(tmp_path) == [path.name]  # no temporary file left behind


def test_newest_corrupt_checkpoint_falls_back_to_the_previous(tmp_path):
    for step in (3, 6, 9):
        ck.write_atomic(ck.encode({"step": step}), str(tmp_path / ck.checkpoint_name(step)))
    newest = tmp_path / ck.checkpoint_name(9)
    newest.write_bytes(newest.read_bytes()[:-20])  # truncated
    lines = []
    path, bad = ck.newest_valid(str(tmp_path), report=lines.append)
    assert os.path.basename(path) == "ckpt-00000006.pt" and bad == [str(newest)]
    assert len(lines) == 1 and "ckpt-00000009.pt is corrupt" in lines[0]
    assert "using ckpt-00000006.pt" in lines[0]


def test_prune_keeps_the_newest_and_the_best(tmp_path):
    for step in range(1, 7):
        (tmp_path / ck.checkpoint_name(step)).write_bytes(b"x")
    best = str(tmp_path / ck.checkpoint_name(2))
    ck.prune(str(tmp_path), keep_last=2, keep={best})
    assert sorted(os.listdir(tmp_path)) == [ck.checkpoint_name(s) for s in (2, 5, 6)]


@pytest.mark.parametrize("size,world", [(22, 3), (20, 2), (7, 4), (10, 1)])
def test_resumable_sampler_equals_distributed_sampler(size, world):
    data = list(range(size))
    for epoch in (0, 3):
        for rank in range(world):
            ref = DistributedSampler(data, world, rank, shuffle=True, seed=5, drop_last=True)
            ref.set_epoch(epoch)
            ours = ck.ResumableSampler(size, world, rank, seed=5)
            ours.set_epoch(epoch)
            assert list(ours) == list(ref) and len(ours) == len(ref)


@pytest.mark.parametrize("old,new", [(2, 1), (2, 3), (3, 2), (4, 4)])
def test_resume_at_another_world_size_reads_the_rest_of_the_epoch_once(old, new):
    """After k steps of global batch G on `old` ranks, the `new` ranks read exactly the
    positions k*G.. of the epoch's order (less a tail of fewer than `new` samples)."""
    size, batch, seed, epoch, k = 101, 4, 1, 2, 3
    consumed = []
    for rank in range(old):
        s = ck.ResumableSampler(size, old, rank, seed)
        s.set_epoch(epoch)
        consumed += list(s)[: k * batch]
    order = ck.ResumableSampler.order(size, seed, epoch)
    assert sorted(consumed) == sorted(order[: k * batch * old])  # a prefix of the order
    rest = []
    for rank in range(new):
        s = ck.ResumableSampler(size, new, rank, seed)
        s.set_epoch(epoch, start=k * batch * old)
        rest += list(s)
    assert not set(rest) & set(consumed), "a sample read twice"
    assert len(rest) == len(set(rest))
    left = order[k * batch * old :]
    assert sorted(rest) == sorted(left[: len(left) // new * new]), "a sample skipped"


SMALL = ["--model", "mlp", "--train-size", "256", "--test-size", "40", "--batch-size", "16"]


@pytest.mark.timeout(180)
def test_trainer_resumes_from_the_previous_checkpoint_when_the_newest_is_truncated(tmp_path):
    ckpts = tmp_path / "ck"
    first, left = run(
        [*SMALL, "--max-steps", "12", "--ckpt-dir", str(ckpts), "--ckpt-every", "4"], tmp_path / "a"
    )
    assert first.returncode == 0, first.stderr[-2000:]
    assert sorted(os.listdir(ckpts)) == [ck.checkpoint_name(s) for s in (4, 8, 12)]
    newest = ckpts / ck.checkpoint_name(12)
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 3])
    resumed, left2 = run(
        [*SMALL, "--max-steps", "16", "--ckpt-dir", str(ckpts), "--resume", "--log-every", "4"],
        tmp_path / "b",
    )
    clean, left3 = run([*SMALL, "--max-steps", "16"], tmp_path / "clean")
    assert resumed.returncode == 0 and clean.returncode == 0, resumed.stderr[-2000:]
    notes = [line for line in resumed.stderr.splitlines() if "corrupt" in line]
    assert len(notes) == 1 and "ckpt-00000012.pt" in notes[0] and "ckpt-00000008.pt" in notes[0]
    assert summary(tmp_path / "b")["resumed_from"] == 8
    assert bit_identical(weights(tmp_path / "b"), weights(tmp_path / "clean"))
    assert not (left or left2 or left3)


@pytest.mark.timeout(120)
def test_resume_refuses_a_checkpoint_of_another_model(tmp_path):
    ckpts = tmp_path / "ck"
    first, _ = run(
        [*SMALL, "--max-steps", "4", "--ckpt-dir", str(ckpts), "--ckpt-every", "4"], tmp_path / "a"
    )
    assert first.returncode == 0, first.stderr[-2000:]
    other, _ = run([*SMALL, "--model", "cnn", "--ckpt-dir", str(ckpts), "--resume"], tmp_path / "b")
    errors = [line for line in other.stderr.splitlines() if "error:" in line]
    assert other.returncode == 2 and len(errors) == 1, other.stderr[-2000:]
    assert "--model mlp (now cnn)" in errors[0] and "--ckpt-dir" in errors[0]
    assert "Traceback" not in other.stderr
    assert os.listdir(ckpts) == [ck.checkpoint_name(4)]  # nothing saved is lost
