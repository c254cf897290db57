"""Exercise 1: ``shard_indices(n, rank, world_size, epoch, seed)``, DistributedSampler's
sharding rule written by hand.

Oracle: torch's own ``DistributedSampler(shuffle=True, seed=seed, drop_last=True)`` after
``set_epoch(epoch)``, asked for every rank, in two epochs and with two seeds. When the
student's shards differ from it, property diagnoses name the broken rule (indices out of
range, unequal or padded shards, overlapping ranks, calls that are not reproducible, no
shuffle, no new order per epoch, a seed that changes nothing).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils.data import DistributedSampler

from ddp_lab.checks.contract import Exercise
from ddp_lab.checks.failure import CheckFailed
from ddp_lab.checks.values import first, randint

#: What each case asks every rank for: ``(key, epoch, seed offset)``.
CALLS = (("epoch0", 0, 0), ("again", 0, 0), ("epoch1", 1, 0), ("other_seed", 0, 1))


def _cases(gen: torch.Generator) -> list[dict]:
    cases = []
    for world in (2, 3, 4):
        n = randint(gen, 25, 99)
        n += n % world == 0 and world < 4  # lengths not divisible by 2 and 3
        cases.append({"n": n, "world_size": world, "seed": randint(gen, 1, 10**6 - 1)})
    return cases


def make_inputs(gen: torch.Generator) -> dict:
    """World sizes 2, 3 and 4, lengths not divisible by 2 and 3, random seeds."""
    return {"cases": _cases(gen)}


def visible_inputs(gen: torch.Generator) -> dict:
    """Three small hand-picked cases (one length divisible by the world size)."""
    return {
        "cases": [
            {"n": 23, "world_size": 2, "seed": 0},
            {"n": 50, "world_size": 3, "seed": 7},
            {"n": 48, "world_size": 4, "seed": 11},
        ]
    }


def as_indices(value) -> torch.Tensor:
    """The student's return value as a flat int64 tensor.

    Raises:
        TypeError: not a flat list of ints.
    """
    try:
        out = torch.as_tensor(list(value) if not isinstance(value, torch.Tensor) else value)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(
            f"shard_indices must return a list of ints, got {type(value).__name__}"
        ) from None
    if out.dtype.is_floating_point or out.dim() != 1:
        raise TypeError("shard_indices must return a flat list of ints")
    return out.long()


def calls(fn: Callable, case: dict) -> dict:
    """Every rank's indices for each of :data:`CALLS`."""
    n, w, seed = case["n"], case["world_size"], case["seed"]
    return {
        key: [as_indices(fn(n, r, w, epoch, seed + offset)) for r in range(w)]
        for key, epoch, offset in CALLS
    }


def run(ns: dict, inputs: dict, workdir: Path) -> dict:
    """Call the student's ``shard_indices`` for every rank of every case."""
    return {"cases": [calls(ns["shard_indices"], case) for case in inputs["cases"]]}


def sampler_shards(n: int, world_size: int, epoch: int, seed: int) -> list[list[int]]:
    """What torch's ``DistributedSampler`` gives each rank (the oracle)."""
    out = []
    for rank in range(world_size):
        sampler = DistributedSampler(
            range(n), num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=True
        )
        sampler.set_epoch(epoch)
        out.append(list(sampler))
    return out


def _property_problem(case: dict, got: dict) -> str | None:
    """Which property of a sharding rule the student's shards break, or None."""
    n, w = case["n"], case["world_size"]
    where = f"n = {n}, world_size = {w}"
    shards = [s.tolist() for s in got["epoch0"]]
    k = n // w
    for r, s in enumerate(shards):
        if any(not 0 <= i < n for i in s):
            return f"{where}: rank {r} got indices outside range({n}): {first(s)}"
        if len(s) != k:
            more = " (padded? drop the last n % world_size samples instead)" if len(s) > k else ""
            return (
                f"{where}: rank {r} got {len(s)} indices; every rank must get exactly n // "
                f"world_size = {k}{more}"
            )
        if len(set(s)) != len(s):
            return f"{where}: rank {r} reads a sample twice: {first(s)}"
    seen: dict[int, int] = {}
    for r, s in enumerate(shards):
        for i in s:
            if i in seen:
                return (
                    f"{where}: ranks {seen[i]} and {r} both read sample {i}. Every rank must cut "
                    "the *same* permutation: draw it from torch.Generator().manual_seed(seed + "
                    "epoch), not from the global random generator"
                )
            seen[i] = r
    if [s.tolist() for s in got["again"]] != shards:
        return (
            f"{where}: two calls with the same arguments gave different indices: ranks compute "
            "their shards on their own, so the permutation must come from a seeded generator"
        )
    everything = [i for s in zip(*shards, strict=True) for i in s]
    if everything == sorted(everything) or all(s == sorted(s) for s in shards):
        return f"{where}: the samples are not shuffled (rank 0 reads {first(shards[0])})"
    if [s.tolist() for s in got["epoch1"]] == shards:
        return (
            f"{where}: epoch 1 reads exactly what epoch 0 read: seed the permutation with "
            "seed + epoch (that is what sampler.set_epoch(epoch) does)"
        )
    if [s.tolist() for s in got["other_seed"]] == shards:
        return f"{where}: another seed gave the same shards: seed the generator with seed + epoch"
    return None


def problem(case: dict, got: dict) -> str | None:
    """What is wrong with one case of ``shard_indices`` on every rank, or None."""
    n, w, seed = case["n"], case["world_size"], case["seed"]
    wanted = {key: sampler_shards(n, w, epoch, seed + offset) for key, epoch, offset in CALLS}
    if all([s.tolist() for s in got[key]] == wanted[key] for key in wanted):
        return None
    if why := _property_problem(case, got):
        return why
    key = next(k for k in wanted if [s.tolist() for s in got[k]] != wanted[k])
    epoch, offset = next((e, o) for k, e, o in CALLS if k == key)
    r = next(r for r in range(w) if got[key][r].tolist() != wanted[key][r])
    return (
        f"n = {n}, world_size = {w}, epoch {epoch}, seed {seed + offset}: rank {r} reads "
        f"{first(got[key][r].tolist())}, but DistributedSampler(shuffle=True, seed=seed, "
        f"drop_last=True) gives it {first(wanted[key][r])}: cut the permutation of "
        "torch.Generator().manual_seed(seed + epoch) to a multiple of world_size and deal it "
        "out round-robin (rank r takes positions r, r + world_size, ...)"
    )


def judge(inputs: dict, outputs: dict) -> str:
    """Every case equals ``DistributedSampler``'s shards; else the broken property."""
    for case, got in zip(inputs["cases"], outputs["cases"], strict=True):
        if why := problem(case, got):
            raise CheckFailed(why)
    sizes = ", ".join(f"{c['n']} samples on {c['world_size']}" for c in inputs["cases"])
    return (
        f"the shards of DistributedSampler(shuffle=True, drop_last=True) in two epochs and for "
        f"two seeds: disjoint, equal, shuffled, reproducible, new every epoch ({sizes} ranks)"
    )


EXERCISE = Exercise(
    "test_ex1_shard_indices",
    ("ex1_shard_indices",),
    "shards: disjoint, equal, reshuffled every epoch",
    make_inputs,
    judge,
    run=run,
    timeout=30,
    visible_inputs=visible_inputs,
)
