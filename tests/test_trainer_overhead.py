"""The trainer's step costs what a plain loop costs: records every --log-every steps only.

Between two records the loss stays on the device (no ``.item()``, no all-reduce of the loss)
and the gradient norm is not computed unless clipping needs it. None of this may change
the weights: every --log-every gives the same model.pt bit for bit.
"""

from __future__ import annotations

import json

import pytest
import torch

from ddp_lab import monitor
from ddp_lab import train as trainer_mod
from ddp_lab.dist import DistEnv

COMMON = [
    "--model",
    "mlp",
    "--train-size",
    "320",
    "--test-size",
    "40",
    "--batch-size",
    "16",
    "--seed",
    "3",
]


def _records(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _weights(out) -> dict:
    return torch.load(out / "model.pt", weights_only=True)


@pytest.mark.timeout(120)
def test_log_every_changes_records_not_weights(trainer):
    """--log-every 1, 7 and the default 10 give bit-identical weights; a record's loss is the
    mean of the per-step losses since the previous record; the last step is always recorded."""
    runs = {}
    for every in ("1", "7", None):
        flags = [*COMMON, "--epochs", "2", "--momentum", "0.5"]
        flags += ["--log-every", every] if every else []
        proc, out = trainer(f"every{every}", flags)
        assert proc.returncode == 0, proc.stderr[-2000:]
        runs[every] = out
    w1 = _weights(runs["1"])
    for every in ("7", None):
        w = _weights(runs[every])
        assert all(torch.equal(w1[k], w[k]) for k in w1), f"--log-every {every} changed weights"
    per_step = {r["step"]: r["loss"] for r in _records(runs["1"])}
    assert sorted(per_step) == list(range(1, 41))
    for every, steps in (("7", [7, 14, 21, 28, 35, 40]), (None, [10, 20, 30, 40])):
        records = _records(runs[every])
        assert [r["step"] for r in records] == steps
        previous = 0
        for r in records:
            window = [per_step[s] for s in range(previous + 1, r["step"] + 1)]
            assert r["loss"] == pytest.approx(sum(window) / len(window), rel=1e-6)
            assert r["grad_norm"] > 0 and r["samples_per_s"] > 0
            previous = r["step"]
    summary = json.loads((runs[None] / "summary.json").read_text())
    assert summary["log_every"] == 10
    assert summary["eval_seconds"] > 0 and summary["train_seconds"] > 0
    assert summary["seconds"] >= summary["train_seconds"] + summary["eval_seconds"]


@pytest.mark.timeout(120)
def test_no_host_read_or_loss_reduction_between_records(monkeypatch, tmp_path):
    """In-process run of 20 steps at --log-every 10: the loss is reduced twice, and the
    tensors are read on the host only at those two records (evaluation stubbed out)."""
    reductions, reads = [], []
    real_reduce = monitor.all_reduce_sum
    real_reads = {name: getattr(torch.Tensor, name) for name in ("item", "__float__", "tolist")}

    def count_reduce(values, env):
        reductions.append(1)
        return real_reduce(values, env)

    def count(real):
        def wrapper(self):
            reads.append(1)
            return real(self)

        return wrapper

    def fake_evaluate(model, dataset, env):
        return {"accuracy": 0.5, "loss": 1.0, "samples": len(dataset)}

    monkeypatch.setattr(monitor, "all_reduce_sum", count_reduce)
    monkeypatch.setattr(trainer_mod.data_mod, "evaluate", fake_evaluate)
    cfg = trainer_mod.parse_args([*COMMON, "--no-progress", "--out", str(tmp_path / "out")])
    for name, real in real_reads.items():
        monkeypatch.setattr(torch.Tensor, name, count(real))
    summary = trainer_mod.train(cfg, DistEnv())
    monkeypatch.undo()
    assert summary["steps"] == 20
    assert len(reductions) == 2, f"{len(reductions)} loss reductions for 2 records"
    # per record: the reduced loss, and one small tensor (grad norm, its max, skipped steps);
    # per epoch: the DataLoader draws its base seed, the sampler lists the epoch's order;
    # before the first step: each synthetic set (train, test) lists its labels once;
    # after the last step: the summary's page faults per step (the most of any rank)
    assert len(reads) <= 2 * 2 + 2 + 2 + 1, f"{len(reads)} host reads for 2 records and 1 epoch"
