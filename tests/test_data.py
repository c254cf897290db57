"""Data sets: the synthetic set is seeded and learnable, CIFAR-10 loads from its files."""

from __future__ import annotations

import hashlib
import json
import pickle

import numpy as np
import pytest
import torch

from ddp_lab import data as data_mod
from ddp_lab.data import (
    CIFAR10_FOLDER,
    SyntheticCIFAR,
    choose_dataset,
    cifar10_present,
    load_cifar10,
)
from ddp_lab.errors import UsageError


def write_cifar_fixture(root, per_batch: int = 8, seed: int = 0):
    """A tiny ``cifar-10-batches-py`` folder in the real format.

    The real files are Python 2 pickles of dicts with str keys ("data": N x 3072 uint8
    rows, channel-major; "labels": ints); protocol 2 with str keys reads back the same way.
    """
    rng = np.random.default_rng(seed)
    folder = root / CIFAR10_FOLDER
    folder.mkdir(parents=True)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for name in names:
        batch = {
            "batch_label": name,
            "labels": rng.integers(0, 10, per_batch).tolist(),
            "data": rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8),
            "filenames": [f"{name}_{i}.png" for i in range(per_batch)],
        }
        with open(folder / name, "wb") as f:
            pickle.dump(batch, f, protocol=2)
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump(
            {
                "label_names": [
                    "airplane",
                    "automobile",
                    "bird",
                    "cat",
                    "deer",
                    "dog",
                    "frog",
                    "horse",
                    "ship",
                    "truck",
                ]
            },
            f,
        )
    return folder


@pytest.mark.timeout(30)
def test_synthetic_set_is_seeded_and_cifar_shaped():
    a, b, c = SyntheticCIFAR(20, seed=1), SyntheticCIFAR(20, seed=1), SyntheticCIFAR(20, seed=2)
    xa, ya = a[5]
    assert xa.shape == (3, 32, 32) and xa.dtype == torch.float32 and 0 <= ya < 10
    assert torch.equal(xa, b[5][0]) and ya == b[5][1]
    assert not torch.equal(xa, c[5][0])
    assert not torch.equal(a[5][0], SyntheticCIFAR(20, "test", seed=1)[5][0])


@pytest.mark.timeout(60)
def test_synthetic_set_held_in_memory_has_the_bytes_generated_on_access(monkeypatch):
    """A set up to MEMORY_BYTES is generated when built (the trainer's loader then reads it as
    fast as a TensorDataset); its bytes are those generated per sample on access, and the
    same as before it was held (the digest of the first 64 training samples, seed 0)."""
    held = SyntheticCIFAR(300, "test", seed=4)
    monkeypatch.setattr(data_mod, "MEMORY_BYTES", 0)
    lazy = SyntheticCIFAR(300, "test", seed=4)
    assert held._images is not None and lazy._images is None
    for i in (0, 1, 150, 299):
        assert torch.equal(held[i][0], lazy[i][0]) and held[i][1] == lazy[i][1]
    x, _ = held[7]
    x.add_(1.0)  # a transform that works in place changes its copy, not the set
    assert torch.equal(held[7][0], lazy[7][0])
    monkeypatch.undo()
    digest = hashlib.sha256()
    for x, y in (SyntheticCIFAR(64)[i] for i in range(64)):
        digest.update(x.numpy().tobytes() + bytes([y]))
    assert digest.hexdigest()[:16] == "e5260ac01ac75b38"


@pytest.mark.timeout(120)
def test_synthetic_set_is_learnable_in_one_epoch(trainer):
    proc, out = trainer("learn", ["--model", "mlp", "--train-size", "4000", "--epochs", "1"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["accuracy"] > 0.5, summary["accuracy"]  # chance is 0.1


@pytest.mark.timeout(60)
def test_cifar10_loader_reads_the_batches_format(tmp_path):
    folder = write_cifar_fixture(tmp_path)
    assert cifar10_present(str(tmp_path))
    train, test = load_cifar10(str(tmp_path), train=True), load_cifar10(str(tmp_path), False)
    assert len(train) == 40 and len(test) == 8
    x, y = test[3]
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32
    with open(folder / "test_batch", "rb") as f:
        raw = pickle.load(f, encoding="latin1")
    assert y == raw["labels"][3]
    # normalised: the red channel of pixel (0, 0) is (byte / 255 - mean) / std
    expected = (raw["data"][3][0] / 255 - 0.4914) / 0.2470
    assert x[0, 0, 0].item() == pytest.approx(expected, abs=1e-5)


@pytest.mark.timeout(120)
def test_trainer_trains_on_cifar10_files(trainer, tmp_path):
    write_cifar_fixture(tmp_path / "data", per_batch=16)
    proc, out = trainer(
        "cifar",
        [
            "--dataset",
            "cifar10",
            "--data-dir",
            str(tmp_path / "data"),
            "--batch-size",
            "8",
            "--model",
            "cnn",
        ],
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 10 and summary["evals"][-1]["samples"] == 16


@pytest.mark.timeout(60)
def test_corrupt_cifar10_file_is_a_clear_error(tmp_path):
    folder = write_cifar_fixture(tmp_path)
    (folder / "data_batch_3").write_bytes(b"not a pickle")
    with pytest.raises(UsageError, match="corrupt"):
        load_cifar10(str(tmp_path), train=True)


@pytest.mark.timeout(60)
def test_choose_dataset_says_which_and_why(tmp_path):
    write_cifar_fixture(tmp_path / "with")
    assert choose_dataset(str(tmp_path / "with"))[0] == "cifar10"
    name, reason = choose_dataset(str(tmp_path / "without"), allow_download=False)
    assert name == "synthetic" and "not in" in reason
