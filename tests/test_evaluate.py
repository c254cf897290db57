"""Exact distributed evaluation: N processes report the single-process accuracy and loss."""

from __future__ import annotations

import pytest
import torch
from _dist_workers import evaluate_worker
from _harness import spawn_gloo

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
