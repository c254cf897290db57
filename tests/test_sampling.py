"""Sharding rules: disjoint shards, set_epoch reshuffles, loaders leave the global RNG alone."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from ddp_lab.data import make_train_loader
from ddp_lab.dist import DistEnv

N = 101  # divisible by neither 2 nor 3


def _dataset(n: int = N) -> TensorDataset:
    return TensorDataset(torch.arange(n))


def _shards(world_size: int, epoch: int, n: int = N) -> list[list[int]]:
    shards = []
    for rank in range(world_size):
        _, sampler = make_train_loader(
            _dataset(n), 4, DistEnv(rank=rank, world_size=world_size), seed=7
        )
        sampler.set_epoch(epoch)
        shards.append(list(sampler))
    return shards


@pytest.mark.timeout(30)
@pytest.mark.parametrize("world_size", [2, 3])
def test_train_shards_are_disjoint_equal_and_cover_all_but_the_remainder(world_size):
    shards = _shards(world_size, epoch=0)
    flat = [i for s in shards for i in s]
    assert len(set(flat)) == len(flat), "a sample is read by two ranks"
    assert {len(s) for s in shards} == {N // world_size}, "ranks run different step counts"
    assert len(flat) == N - N % world_size
    assert set(flat) <= set(range(N))


@pytest.mark.timeout(30)
def test_distributed_sampler_without_drop_last_pads_with_duplicates():
    """Why evaluation masks the padding out (tests/test_evaluate.py proves that every sample
    counts once): DistributedSampler repeats samples to pad."""
    from torch.utils.data import DistributedSampler

    flat = [
        i
        for r in range(3)
        for i in DistributedSampler(_dataset(), num_replicas=3, rank=r, shuffle=False)
    ]
    assert len(flat) == 102 and len(set(flat)) == N


@pytest.mark.timeout(30)
@pytest.mark.parametrize("world_size", [2, 3])
def test_set_epoch_changes_the_order_and_its_absence_repeats_it(world_size):
    e0, e0_again, e1 = _shards(world_size, 0), _shards(world_size, 0), _shards(world_size, 1)
    assert e0 == e0_again, "same epoch, different order: not reproducible"
    assert e0 != e1, "set_epoch(1) did not reshuffle"
    # Without set_epoch, iterating twice gives the same order: the classic bug.
    _, sampler = make_train_loader(_dataset(), 4, DistEnv(rank=0, world_size=world_size), seed=7)
    assert list(sampler) == list(sampler)


@pytest.mark.timeout(30)
def test_iterating_the_loader_does_not_touch_the_global_rng():
    loader, _ = make_train_loader(_dataset(), 4, DistEnv(), seed=7)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    for _ in loader:
        pass
    assert torch.equal(before, torch.get_rng_state())


@pytest.mark.timeout(30)
def test_loader_refuses_a_batch_larger_than_the_shard():
    from ddp_lab.errors import UsageError

    with pytest.raises(UsageError, match="--batch-size"):
        make_train_loader(_dataset(10), 8, DistEnv(rank=0, world_size=2))
