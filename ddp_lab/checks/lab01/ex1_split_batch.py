"""Exercise 1, ``split_batch(x, y, n)``: cut a batch into ``n`` shards, sizes within one.

The judge checks properties only (no split is computed here): ``n`` pairs ``(x_k, y_k)``
that keep every dimension but the first, as many inputs as targets in each shard, every
sample exactly once and in order (the shards concatenated give back ``x`` and ``y``),
sizes that differ by at most one, and the larger shards first (the first ``B % n`` take one
sample more, so empty shards come last, as the notebook's examples fix). The fixed case
set, random values inside: one shard (``n = 1``), two shards of an odd batch, three shards
with a remainder, ``n`` = 4 to 7 with a remainder of 2 .. n - 2 (giving it all to one
shard, or ``torch.chunk``, is then unbalanced), a batch that divides evenly, ``n + 1``
samples into ``n`` shards (``torch.chunk`` gives fewer than ``n``), and more shards than
samples (some replicas get no data: empty shards of shape ``(0, ...)``, which must be the
last ones); image-shaped float32 inputs and float64 feature vectors. Every case but the
first and the even one has a remainder, so a split that puts the extra samples anywhere
but in the first shards fails in every run.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ddp_lab.checks.contract import Exercise
from ddp_lab.checks.failure import CheckFailed, require
from ddp_lab.checks.values import kind, plain, randint


def _case(gen: torch.Generator, batch: int, n: int, image: bool = False) -> dict:
    if image:  # (B, C, H, W) float32, like a batch of pictures
        x = torch.randn(batch, 3, 2, 2, generator=gen)
    else:
        x = torch.randn(batch, randint(gen, 1, 4), generator=gen, dtype=torch.float64)
    return {"x": x, "y": torch.randint(0, 10, (batch,), generator=gen), "n": n}


def make_inputs(gen: torch.Generator) -> dict:
    """Seven batches: one shard, two, three with a remainder, many with a remainder of
    2 .. n - 2, an even split, ``n + 1`` into ``n``, and more shards than samples."""
    # A remainder of 2 .. n - 2: with a remainder of 1, giving it all to the last shard is
    # balanced too, and with n - 1, torch.chunk's n - 1 shards of ceil(B / n) plus a smaller
    # one are; either mistake would then pass this batch.
    n = randint(gen, 4, 7)
    uneven = n * randint(gen, 1, 5) + randint(gen, 2, n - 2)
    n2 = randint(gen, 3, 6)
    n3 = randint(gen, 3, 8)
    few = randint(gen, 1, 3)
    return {
        "batches": [
            _case(gen, randint(gen, 2, 9), 1),
            _case(gen, 2 * randint(gen, 1, 5) + 1, 2, image=True),
            _case(gen, 3 * randint(gen, 1, 4) + randint(gen, 1, 2), 3),
            _case(gen, uneven, n, image=True),
            _case(gen, n2 * randint(gen, 2, 5), n2),
            _case(gen, n3 + 1, n3),
            _case(gen, few, few + randint(gen, 1, 3), image=True),
        ]
    }


def visible_inputs(gen: torch.Generator) -> dict:
    """10 into 4, 8 into 4, 6 into 4, 7 into 1 and 2 into 3."""
    cases = ((10, 4), (8, 4), (6, 4), (7, 1), (2, 3))
    return {"batches": [_case(gen, b, n) for b, n in cases]}


def run(ns: dict, inputs: dict, workdir: Path | None) -> dict:
    """Call the student's ``split_batch`` on every batch."""
    fn = ns["split_batch"]
    return {
        "results": [plain(fn(b["x"].clone(), b["y"].clone(), b["n"])) for b in inputs["batches"]]
    }


def _chunk_sizes(batch: int, n: int) -> list[int]:
    """The sizes ``torch.chunk`` makes (a typical mistake: ceil(B / n) each, maybe < n)."""
    return [len(c) for c in torch.chunk(torch.arange(batch), n)]


def check_batch(x: torch.Tensor, y: torch.Tensor, n: int, shards) -> list[int]:
    """Check one batch's shards; return their sizes.

    Raises:
        CheckFailed: the first property that does not hold, in the student's terms.
    """
    batch = x.shape[0]
    case = f"split_batch(x, y, n={n}) with a batch of {batch}"
    if not isinstance(shards, list):
        raise CheckFailed(f"{case}: expected a list of {n} (x_k, y_k) pairs, got {kind(shards)}")
    for k, pair in enumerate(shards):
        if not (isinstance(pair, list) and len(pair) == 2):
            raise CheckFailed(f"{case}: shard {k} should be a pair (x_k, y_k), got {kind(pair)}")
        xk, yk = pair
        for name, t, full in (("x", xk, x), ("y", yk, y)):
            if not isinstance(t, torch.Tensor):
                raise CheckFailed(f"{case}: {name}_{k} should be a tensor, got {kind(t)}")
            require(
                t.dim() == full.dim() and t.shape[1:] == full.shape[1:],
                f"{case}: {name}_{k} has shape {tuple(t.shape)}; a shard keeps every dimension "
                f"of {name} but the first ({tuple(full.shape)} -> (B_k, "
                f"{', '.join(map(str, full.shape[1:]))}))",
            )
        require(
            xk.shape[0] == yk.shape[0],
            f"{case}: shard {k} has {xk.shape[0]} inputs but {yk.shape[0]} targets",
        )
    sizes = [int(p[0].shape[0]) for p in shards]
    chunked = _chunk_sizes(batch, n)
    require(
        sizes != chunked or batch < n or (len(sizes) == n and max(sizes) - min(sizes) <= 1),
        f"{case}: your shards have the sizes torch.chunk makes, {sizes}: chunks of "
        f"ceil(B / n) = {chunked[0]} leave the last shard short (or missing). Sizes must "
        "differ by at most one",
    )
    require(
        len(sizes) == n,
        f"{case}: expected {n} shards (one per replica), got {len(sizes)}"
        + (
            f"; with more replicas than samples, {n - batch} replicas get an empty shard "
            f"(x[{batch}:{batch}] has shape (0, ...))"
            if n > batch
            else ""
        ),
    )
    total = sum(sizes)
    remainder = (
        f" {batch} is not a multiple of {n}: the remainder {batch % n} must go into some shards"
        if batch % n
        else ""
    )
    require(
        total >= batch,
        f"{case}: your shards (sizes {sizes}) hold {total} of the {batch} samples, so "
        f"{batch - total} are lost.{remainder}",
    )
    require(
        total == batch,
        f"{case}: your shards (sizes {sizes}) hold {total} samples, more than the batch: "
        "some samples are in two shards",
    )
    require(
        max(sizes) - min(sizes) <= 1,
        f"{case}: shard sizes {sizes} differ by more than one; spread the remainder "
        f"{batch % n} over {batch % n} shards, one extra sample each",
    )
    extra = batch % n
    require(
        all(sizes[k] >= sizes[k + 1] for k in range(len(sizes) - 1)),
        f"{case}: shard sizes {sizes}; the first {extra} shard(s) take one sample more and "
        "the others follow, so any empty shards are the last ones (10 into 4 gives "
        "[3, 3, 2, 2], 2 into 3 gives [1, 1, 0])",
    )
    for name, full, index in (("x", x, 0), ("y", y, 1)):
        joined = torch.cat([p[index] for p in shards])
        require(
            joined.dtype == full.dtype and torch.equal(joined, full),
            f"{case}: the {name}_k, concatenated in order, do not give back {name}: every "
            "sample must land in exactly one shard, in its original order, unchanged",
        )
    return sizes


def judge(inputs: dict, outputs: dict) -> str:
    """Every batch: the properties of :func:`check_batch`."""
    results = outputs["results"]
    require(
        isinstance(results, list) and len(results) == len(inputs["batches"]),
        "expected one result per batch",
    )
    seen = []
    for b, shards in zip(inputs["batches"], results, strict=True):
        sizes = check_batch(b["x"], b["y"], b["n"], shards)
        seen.append(f"{b['x'].shape[0]} into {sizes}")
    return "every sample in exactly one shard, sizes within one, larger first: " + "; ".join(seen)


EXERCISE = Exercise(
    "test_ex1_split_batch",
    ("ex1_split_batch",),
    "split a batch into balanced shards",
    make_inputs,
    judge,
    run=run,
    visible_inputs=visible_inputs,
)
