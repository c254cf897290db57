"""Exact distributed evaluation: N processes report the single-process accuracy and loss.

``ddp_lab.data.evaluate`` reads through ``DistributedSampler(shuffle=False, drop_last=False)``
and masks the padding repeats out by their position; these tests prove that every sample
still counts exactly once, with real gloo groups and, cheaply, rank by rank in one process.
"""

from __future__ import annotations

import pytest
import torch
from _dist_workers import evaluate_worker
from _harness import spawn_gloo
from torch.utils.data import TensorDataset

from ddp_lab import data as data_mod
from ddp_lab.data import SyntheticCIFAR, evaluate
from ddp_lab.dist import DistEnv
from ddp_lab.models import build_model

SIZE = 101  # divisible by neither 2 nor 3: DistributedSampler would pad with duplicates


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
def test_distributed_evaluation_equals_single_process(tmp_path, world_size):
    torch.manual_seed(0)
    single = evaluate(build_model("mlp"), SyntheticCIFAR(SIZE, "test"), DistEnv(), 16)
    assert single["samples"] == SIZE
    # an untrained model's accuracy: some but not all right, so counting errors show up
    assert 0 < single["accuracy"] < 1
    spawn_gloo(evaluate_worker, world_size, str(tmp_path), SIZE, "mlp")
    for rank in range(world_size):
        got = torch.load(tmp_path / f"eval-{rank}.pt", weights_only=True)
        assert got["samples"] == SIZE, "a sample was counted twice or not at all"
        assert got["accuracy"] == pytest.approx(single["accuracy"], abs=1e-12)
        assert got["loss"] == pytest.approx(single["loss"], rel=1e-6)


def _labelled(size: int) -> TensorDataset:
    """Inputs whose predicted class is known: sample i is right exactly when i % 3 == 0, and
    its loss grows with i, so a sample counted twice or left out changes every sum."""
    x = torch.arange(size, dtype=torch.float32).unsqueeze(1)
    y = torch.where(torch.arange(size) % 3 == 0, 0, 1)
    return TensorDataset(x, y)


class _FirstClass(torch.nn.Module):
    """Always predicts class 0, more confidently for larger inputs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x / 10, torch.zeros_like(x)], dim=1)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [1, 2, 7, 11, 101])
@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("batch_size", [1, 4])
def test_the_ranks_sums_add_up_to_every_sample_exactly_once(
    monkeypatch, size, world_size, batch_size
):
    """Rank by rank in one process, the sums each rank hands to the all-reduce (hits, real
    samples, summed loss) add up to one process's, also when a rank reads only padding."""
    data, model = _labelled(size), _FirstClass()
    whole = evaluate(model, data, DistEnv(), batch_size)
    assert whole["samples"] == size
    assert whole["accuracy"] == pytest.approx(len(range(0, size, 3)) / size, abs=1e-12)
    handed: list[torch.Tensor] = []

    def record(values, env):
        handed.append(torch.as_tensor(values, dtype=torch.float64).clone())
        return torch.ones(4, dtype=torch.float64)  # any nonzero sums: the ranks' are recorded

    monkeypatch.setattr(data_mod, "all_reduce_sum", record)
    for rank in range(world_size):
        evaluate(model, data, DistEnv(rank=rank, world_size=world_size), batch_size)
    hits, samples, predictions, loss = torch.stack(handed).sum(0).tolist()
    counts = [int(h[1]) for h in handed]
    assert samples == size, f"the ranks counted {counts} samples of {size}"
    assert predictions == size  # one class per sample
    assert max(counts) - min(counts) <= 1
    assert hits == pytest.approx(whole["accuracy"] * size, abs=1e-9)
    assert loss == pytest.approx(whole["loss"] * size, rel=1e-6)


class _Tokens(torch.nn.Module):
    """Next-token logits of shape (batch, seq, 5): token t predicts (t + 1) % 5 with a margin
    that grows along the sequence."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        steps = torch.arange(x.shape[1], dtype=torch.float32).view(1, -1, 1)
        return torch.nn.functional.one_hot((x + 1) % 5, 5).float() * (steps + 0.5)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_sequences_count_every_predicted_token_once(monkeypatch, world_size):
    """A sample of T tokens holds T predictions: accuracy and loss are means over all the
    tokens of all the samples (not over samples), also when ranks read padding."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 5, (7, 4), generator=g)
    y = torch.where(torch.rand(7, 4, generator=g) < 0.6, (x + 1) % 5, x)  # 60 % predictable
    logits = _Tokens()(x)
    want_acc = (logits.argmax(-1) == y).double().mean().item()
    want_loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).item()
    handed: list[torch.Tensor] = []

    def record(values, env):
        handed.append(torch.as_tensor(values, dtype=torch.float64).clone())
        return torch.stack(handed).sum(0) if len(handed) == world_size else values

    monkeypatch.setattr(data_mod, "all_reduce_sum", record)
    for rank in range(world_size):
        got = evaluate(_Tokens(), TensorDataset(x, y), DistEnv(rank, 0, world_size), 2)
    assert got["samples"] == 7
    assert got["accuracy"] == pytest.approx(want_acc, abs=1e-12)
    assert got["loss"] == pytest.approx(want_loss, rel=1e-6)
