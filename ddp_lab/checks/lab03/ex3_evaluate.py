"""Exercise 3: ``evaluate(model, dataset, batch_size)`` in ``evaluate.py``, on every rank.

The model is a float64 ``nn.Linear`` and the labels are drawn so that about half of its
predictions are right; the length is not divisible by the world size. Oracle: the correct
predictions counted on the whole set in one go (``argmax`` of ``x @ W.T + b`` against
``y``). Properties: every sample is scored exactly once over all ranks (each rank's reads
are recorded), the ranks' parts differ in size by at most one, and every rank returns the
same ``correct``, ``total`` and ``accuracy = correct / total``.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

from ddp_lab.checks import guards
from ddp_lab.checks.contract import Exercise
from ddp_lab.checks.failure import CheckFailed
from ddp_lab.checks.lab03.common import RecordingDataset
from ddp_lab.checks.values import first, number, randint

FILE = "evaluate.py"
#: Runtime modules the file may not use: the exercise is to write this part.
FORBID_MODULES = ("ddp_lab.data", "ddp_lab.dist")


def case(gen: torch.Generator, world: int) -> dict:
    """A linear classifier and a data set of ``world * k + t`` samples (``0 < t < world``)
    on which about half of its predictions are right."""
    d, c = randint(gen, 3, 6), randint(gen, 3, 5)
    k = randint(gen, 12, 24)
    n = world * k + randint(gen, 1, world - 1)  # not divisible by world
    weight = torch.randn(c, d, generator=gen, dtype=torch.float64)
    bias = torch.randn(c, generator=gen, dtype=torch.float64)
    x = torch.randn(n, d, generator=gen, dtype=torch.float64)
    pred = (x @ weight.T + bias).argmax(1)
    right = torch.rand(n, generator=gen) < 0.5
    wrong = (pred + torch.randint(1, c, (n,), generator=gen)) % c
    return {
        "world_size": world,
        "weight": weight,
        "bias": bias,
        "x": x,
        "y": torch.where(right, pred, wrong),
        "batch_size": randint(gen, 4, 9),
    }


def make_inputs(gen: torch.Generator) -> dict:
    """One job on 2 ranks (shards of unequal size)."""
    return {"cases": [case(gen, 2)]}


def run_rank(ns: dict, inputs: dict, case: dict, rank: int, world: int) -> dict:
    """Call the student's ``evaluate`` on this rank; record which samples it read."""
    if Path(FILE).is_file():
        guards.refuse_mentions({FILE: Path(FILE).read_text()}, FORBID_MODULES)
    mod = guards.load_student_file(FILE)
    model = nn.Linear(case["weight"].shape[1], case["weight"].shape[0]).double()
    model.load_state_dict({"weight": case["weight"], "bias": case["bias"]})
    data = RecordingDataset(case["x"], case["y"])
    got = mod["evaluate"](model, data, batch_size=case["batch_size"])
    if not isinstance(got, dict):
        raise TypeError(f"evaluate must return a dict, got {type(got).__name__}")
    return {
        "correct": number(got.get("correct")),
        "total": number(got.get("total")),
        "accuracy": number(got.get("accuracy")),
        "reads": torch.tensor(data.reads, dtype=torch.long),
    }


def _fmt(result) -> str:
    c, t, a = result
    return f"(correct {c:g}, total {t:g}, accuracy {a:.4f})"


def problem(case: dict, outs: list[dict]) -> str | None:
    """What is wrong with ``evaluate`` on every rank, or None."""
    w, n = case["world_size"], len(case["y"])
    if len(outs) != w:
        return f"expected the results of {w} ranks, got {len(outs)}"
    where = f"{n} samples on {w} ranks"
    pred = (case["x"] @ case["weight"].T + case["bias"]).argmax(1)
    correct = int((pred == case["y"]).sum())
    reads = [o["reads"].tolist() for o in outs]
    owner: dict[int, int] = {}
    for r, rr in enumerate(reads):
        for i in rr:
            if i in owner:
                who = "rank " + str(r) + (" twice" if owner[i] == r else f" and rank {owner[i]}")
                pad = (
                    " DistributedSampler pads the shards with repeated samples: split the indices"
                    " yourself (range(rank, n, world_size))"
                    if all(len(x) == math.ceil(n / w) for x in reads)
                    else ""
                )
                return f"{where}: sample {i} was scored by {who}.{pad}"
            owner[i] = r
    missing = sorted(set(range(n)) - set(owner))
    if missing:
        return f"{where}: samples {first(missing)} were never scored"
    sizes = [len(x) for x in reads]
    if max(sizes) - min(sizes) > 1:
        return (
            f"{where}: the ranks scored {sizes} samples: split the data set evenly, every rank "
            "scores its own part"
        )
    results = [(o["correct"], o["total"], o["accuracy"]) for o in outs]
    for r in range(1, w):
        if results[r] != results[0]:
            return (
                f"{where}: rank {r} returned {_fmt(results[r])} but rank 0 {_fmt(results[0])}: "
                "sum the counts over the ranks (dist.all_reduce) so that every rank knows the "
                "result"
            )
    got_correct, got_total, got_acc = results[0]
    if got_total != n:
        shard = " (one rank's shard: all_reduce the counts)" if got_total in sizes else ""
        return f"{where}: total = {got_total:g}, expected {n}{shard}"
    if got_correct != correct:
        return f"{where}: correct = {got_correct:g}, expected {correct}"
    if not math.isclose(got_acc, correct / n, rel_tol=1e-12, abs_tol=1e-12):
        return (
            f"{where}: accuracy = {got_acc:.6f}, expected correct / total = {correct / n:.6f}. "
            "The mean of the ranks' accuracies weighs every shard the same, but the shards "
            "differ in size: divide the summed counts"
        )
    return None


def judge(inputs: dict, outputs: dict) -> str:
    """Every sample scored once; the exact count and accuracy on every rank."""
    for c, outs in zip(inputs["cases"], outputs["cases"], strict=True):
        if why := problem(c, outs):
            raise CheckFailed(why)
    c = inputs["cases"][0]
    n, w = len(c["y"]), c["world_size"]
    return (
        f"every one of {n} samples scored exactly once on {w} ranks (parts of "
        f"{', '.join(str(len(o['reads'])) for o in outputs['cases'][0])}); the exact count and "
        "accuracy on every rank"
    )


EXERCISE = Exercise(
    "test_ex3_evaluate",
    ("ex3_evaluate",),
    "exact distributed evaluation",
    make_inputs,
    judge,
    run_rank=run_rank,
    forbid_modules=FORBID_MODULES,
    timeout=60,
    files=(FILE,),
)
