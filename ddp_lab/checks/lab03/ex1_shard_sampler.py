"""Exercise 1: ``MySampler(n, rank, world_size, shuffle, seed, drop_last)``, torch's
``DistributedSampler`` written by hand: the shard of every rank, epoch after epoch.

Oracle: torch's own ``DistributedSampler`` with the same arguments, asked for every rank.
Each case builds one sampler per rank and reads it in epoch 0 (before any ``set_epoch``),
then after ``set_epoch(1)``, ``set_epoch(2)`` and a second pass over epoch 2 (which must
repeat itself); ``len(sampler)`` is asked too. Case set (every run, random values inside):
2, 3 and 4 ranks; lengths not divisible by the world size, with padding (``drop_last=False``)
and without (``True``); one sample on 3 ranks (padding repeats it on every rank; dropping
leaves every rank without data); a length that divides evenly; ``shuffle=False``. When the
shards differ from the oracle, property diagnoses name the broken rule.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils.data import DistributedSampler

from ddp_lab.checks.contract import Exercise
from ddp_lab.checks.failure import CheckFailed
from ddp_lab.checks.values import first, randint

#: What is read from every rank's sampler, in this order: ``(key, epoch or None)``;
#: ``None``: read without calling ``set_epoch`` (a fresh sampler is in epoch 0).
READS = (("fresh", None), ("epoch1", 1), ("epoch2", 2), ("again", 2))


def _n(gen: torch.Generator, world: int, remainder: bool) -> int:
    """A length of 11 to 60 samples, not divisible by ``world`` (or divisible)."""
    k = randint(gen, 11, 60) // world
    return world * k + (randint(gen, 1, world - 1) if remainder else 0)


def make_inputs(gen: torch.Generator) -> dict:
    """Seven cases (see the module docstring), each with its own random seed."""
    specs = [  # (world, n, shuffle, drop_last)
        (3, _n(gen, 3, True), True, True),
        (2, _n(gen, 2, True), True, False),
        (3, _n(gen, 3, True), True, False),
        (4, _n(gen, 4, True), True, True),
        (3, 1, True, False),
        (3, 1, True, True),
        (2, _n(gen, 2, False), False, False),
        (3, _n(gen, 3, True), False, True),
    ]
    return {
        "cases": [
            {"n": n, "world_size": w, "shuffle": s, "drop_last": d, "seed": randint(gen, 1, 10**6)}
            for w, n, s, d in specs
        ]
    }


def visible_inputs(gen: torch.Generator) -> dict:
    """Four small hand-picked cases."""
    return {
        "cases": [
            {"n": 23, "world_size": 2, "shuffle": True, "drop_last": False, "seed": 3},
            {"n": 23, "world_size": 3, "shuffle": True, "drop_last": True, "seed": 7},
            {"n": 1, "world_size": 3, "shuffle": True, "drop_last": False, "seed": 0},
            {"n": 10, "world_size": 4, "shuffle": False, "drop_last": False, "seed": 0},
        ]
    }


def as_indices(value) -> list[int]:
    """The student's indices as a list of ints.

    Raises:
        TypeError: not an iterable of ints.
    """
    try:
        out = torch.as_tensor(list(value), dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(
            f"iterating the sampler must give ints, got {type(value).__name__}"
        ) from None
    if out.dim() != 1 or bool((out != out.round()).any()):
        raise TypeError("iterating the sampler must give ints (sample indices)")
    return [int(v) for v in out.tolist()]


def reads(cls: Callable, case: dict) -> dict:
    """Every rank's ``len`` and indices for each of :data:`READS`."""
    n, w = case["n"], case["world_size"]
    samplers = [
        cls(
            n,
            r,
            w,
            shuffle=case["shuffle"],
            seed=case["seed"],
            drop_last=case["drop_last"],
        )
        for r in range(w)
    ]
    out: dict = {"len": [int(len(s)) for s in samplers]}
    for key, epoch in READS:
        if epoch is not None:
            for s in samplers:
                s.set_epoch(epoch)
        out[key] = [as_indices(iter(s)) for s in samplers]
    return out


def run(ns: dict, inputs: dict, workdir: Path) -> dict:
    """Build the student's ``MySampler`` on every rank of every case; read it."""
    return {"cases": [reads(ns["MySampler"], case) for case in inputs["cases"]]}


def sampler_shards(case: dict, epoch: int) -> list[list[int]]:
    """What torch's ``DistributedSampler`` gives each rank in ``epoch`` (the oracle)."""
    out = []
    for rank in range(case["world_size"]):
        sampler = DistributedSampler(
            range(case["n"]),
            num_replicas=case["world_size"],
            rank=rank,
            shuffle=case["shuffle"],
            seed=case["seed"],
            drop_last=case["drop_last"],
        )
        sampler.set_epoch(epoch)
        out.append(list(sampler))
    return out


def where(case: dict) -> str:
    """``"n = 23, world_size = 3, shuffle=True, drop_last=False"``."""
    return (
        f"n = {case['n']}, world_size = {case['world_size']}, shuffle={case['shuffle']}, "
        f"drop_last={case['drop_last']}"
    )


def _length_problem(case: dict, got: dict) -> str | None:
    n, w, at = case["n"], case["world_size"], where(case)
    k = n // w if case["drop_last"] else math.ceil(n / w)
    for r, shard in enumerate(got["fresh"]):
        if any(not 0 <= i < n for i in shard):
            return f"{at}: rank {r} read indices outside range({n}): {first(shard)}"
        if len(shard) != k:
            if case["drop_last"]:
                rule = f"drop_last=True: every rank reads n // world_size = {k} samples"
            else:
                rule = (
                    f"drop_last=False: every rank reads ceil(n / world_size) = {k} samples, "
                    "the shortfall padded with samples from the start of the epoch's order"
                )
            return f"{at}: rank {r} read {len(shard)} samples; {rule}"
        if got["len"][r] != len(shard):
            return f"{at}: len(sampler) is {got['len'][r]} on rank {r}, but it yields {len(shard)}"
    return None


def _overlap_problem(case: dict, got: dict) -> str | None:
    """Two ranks reading one sample in a read where the data would go round, or None.

    Every read is searched, not only the first: ranks that draw their own orders miss each
    other in one read now and then (one time in a hundred for 10 samples on 3 ranks), in all
    four about once in 10^8.
    """
    for key, _ in READS:
        shards, seen = got[key], {}
        if sum(len(s) for s in shards) > case["n"]:
            continue
        for r, shard in enumerate(shards):
            for i in shard:
                if i in seen:
                    return (
                        f"{where(case)}: ranks {seen[i]} and {r} both read sample {i}, though "
                        "there is enough data for every rank: every rank must cut the *same* "
                        "order, drawn from a torch.Generator seeded with seed + epoch, not "
                        "from the global random generator"
                    )
                seen[i] = r
    return None


def _property_problem(case: dict, got: dict) -> str | None:
    """Which property of a sharding rule the student's shards break, or None."""
    n, at = case["n"], where(case)
    if why := _length_problem(case, got):
        return why
    if why := _overlap_problem(case, got):
        return why
    shards = got["fresh"]
    seen = {i for shard in shards for i in shard}
    total = sum(len(s) for s in shards)
    if total >= n and len(seen) < n:
        missing = sorted(set(range(n)) - seen)
        return f"{at}: nobody read samples {first(missing)} (padding must not replace them)"
    if got["again"] != got["epoch2"]:
        return (
            f"{at}: two passes over epoch 2 gave different indices: the order must come from a "
            "generator seeded with seed + epoch, drawn afresh in every __iter__"
        )
    order = [i for step in zip(*shards, strict=False) for i in step]
    if case["shuffle"] and n > 2 and order == sorted(order):
        return f"{at}: the samples are not shuffled (rank 0 reads {first(shards[0])})"
    head = min(n, total)
    if not case["shuffle"] and order[:head] != list(range(head)):
        return (
            f"{at}: with shuffle=False the ranks take turns along 0, 1, 2, ..., but rank 0 "
            f"reads {first(shards[0])}"
        )
    if case["shuffle"] and n > 2 and got["epoch1"] == got["fresh"]:
        return (
            f"{at}: epoch 1 reads exactly what epoch 0 read: set_epoch(epoch) must change "
            "the order (seed the generator with seed + epoch)"
        )
    return None


def problem(case: dict, got: dict) -> str | None:
    """What is wrong with one case on every rank, or None."""
    wanted = {
        "fresh": sampler_shards(case, 0),
        "epoch1": sampler_shards(case, 1),
        "epoch2": sampler_shards(case, 2),
    }
    wanted["again"] = wanted["epoch2"]
    lengths = [len(s) for s in wanted["fresh"]]
    if got["len"] == lengths and all(got[key] == wanted[key] for key in wanted):
        return None
    if why := _property_problem(case, got):
        return why
    key = next(k for k in wanted if got[k] != wanted[k])
    epoch = {"fresh": 0, "epoch1": 1, "epoch2": 2, "again": 2}[key]
    r = next(r for r in range(case["world_size"]) if got[key][r] != wanted[key][r])
    return (
        f"{where(case)}, seed {case['seed']}, epoch {epoch}: rank {r} reads "
        f"{first(got[key][r])}, but DistributedSampler gives it {first(wanted[key][r])}: the "
        "ranks share one order of the epoch (a permutation from torch.Generator()."
        "manual_seed(seed + epoch), or range(n) without shuffle), made a multiple of "
        "world_size, and take turns along it (rank r: positions r, r + world_size, ...)"
    )


def judge(inputs: dict, outputs: dict) -> str:
    """Every case equals ``DistributedSampler``'s shards; else the broken property."""
    for case, got in zip(inputs["cases"], outputs["cases"], strict=True):
        if why := problem(case, got):
            raise CheckFailed(why)
    worlds = sorted({c["world_size"] for c in inputs["cases"]})
    return (
        f"the shards of DistributedSampler on {', '.join(map(str, worlds))} ranks, in three "
        f"epochs, with and without shuffle, padding and drop_last ({len(inputs['cases'])} "
        "cases, one sample on 3 ranks among them)"
    )


EXERCISE = Exercise(
    "test_ex1_shard_sampler",
    ("ex1_shard_sampler",),
    "a DistributedSampler by hand: shards, padding, epochs",
    make_inputs,
    judge,
    run=run,
    timeout=30,
    visible_inputs=visible_inputs,
)
