"""Exercise 3: ``evaluate(model, dataset, batch_size)`` in ``evaluate.py``, on every rank.

The model is an ``nn.Linear`` (float64 or float32) and the labels are drawn so that about
half of its predictions are right. One torchrun job of 3 ranks runs four evaluations: on a
group of ranks 0 and 1 (which the student's code sees as its whole world; rank 2 waits) a
data set of odd length and one of a single sample (rank 1 has nothing to score), then on
all 3 ranks one whose length is not divisible by 3 and one of two samples (rank 2 has
nothing). Oracle: the correct predictions counted on the whole set in one go (``argmax`` of
``x @ W.T + b`` against ``y``). Properties: every sample is scored exactly once over all
ranks (each rank's reads are recorded), the ranks' parts differ in size by at most one, and
every rank returns the same ``correct``, ``total`` and ``accuracy = correct / total``, as
the docstring's ``int``, ``int`` and ``float`` (not tensors).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

from ddp_lab.checks import guards
from ddp_lab.checks.contract import Exercise
from ddp_lab.checks.failure import CheckFailed
from ddp_lab.checks.lab03.common import RecordingDataset, per_run, run_outputs
from ddp_lab.checks.values import first, number, randint

FILE = "evaluate.py"
#: Runtime modules the file may not use: the exercise is to write this part.
FORBID_MODULES = ("ddp_lab.data", "ddp_lab.dist")


def case(gen: torch.Generator, ranks: int, n: int | None = None, dtype=torch.float64) -> dict:
    """A linear classifier and a data set of ``n`` samples (default: ``ranks * k + t``,
    ``0 < t < ranks``) on which about half of its predictions are right."""
    d, c = randint(gen, 3, 6), randint(gen, 3, 5)
    if n is None:
        n = ranks * randint(gen, 8, 16) + randint(gen, 1, ranks - 1)  # not divisible
    weight = torch.randn(c, d, generator=gen, dtype=torch.float64)
    bias = torch.randn(c, generator=gen, dtype=torch.float64)
    x = torch.randn(n, d, generator=gen, dtype=torch.float64)
    pred = (x @ weight.T + bias).argmax(1)
    right = torch.rand(n, generator=gen) < 0.5
    wrong = (pred + torch.randint(1, c, (n,), generator=gen)) % c
    return {
        "ranks": ranks,
        "weight": weight.to(dtype),
        "bias": bias.to(dtype),
        "x": x.to(dtype),
        "y": torch.where(right, pred, wrong),
        "batch_size": randint(gen, 4, 9),
    }


def make_inputs(gen: torch.Generator) -> dict:
    """One job of 3 ranks: an odd length and one sample on 2 ranks, a length not divisible by
    3 and two samples on 3 ranks (float32 and float64)."""
    runs = [
        case(gen, 2, dtype=torch.float32),
        case(gen, 2, n=1),
        case(gen, 3),
        case(gen, 3, n=2, dtype=torch.float32),
    ]
    return {"cases": [{"world_size": 3, "runs": runs}]}


def visible_inputs(gen: torch.Generator) -> dict:
    """One job of 2 ranks: an odd length, then one sample."""
    return {"cases": [{"world_size": 2, "runs": [case(gen, 2), case(gen, 2, n=1)]}]}


def _one_run(mod: dict, run: dict, rank: int, ranks: int) -> dict:
    model = nn.Linear(run["weight"].shape[1], run["weight"].shape[0]).to(run["weight"].dtype)
    model.load_state_dict({"weight": run["weight"], "bias": run["bias"]})
    data = RecordingDataset(run["x"], run["y"])
    got = mod["evaluate"](model, data, batch_size=run["batch_size"])
    if not isinstance(got, dict):
        raise TypeError(f"evaluate must return a dict, got {type(got).__name__}")
    kinds = [type(got.get(k)).__name__ for k in ("correct", "total", "accuracy")]
    return {
        "correct": number(got.get("correct")),
        "total": number(got.get("total")),
        "accuracy": number(got.get("accuracy")),
        "kinds": ",".join(kinds),
        "reads": torch.tensor(data.reads, dtype=torch.long),
    }


def run_rank(ns: dict, inputs: dict, case: dict, rank: int, world: int) -> list:
    """Call the student's ``evaluate`` on this rank, once per run it takes part in; record
    which samples it read."""
    if Path(FILE).is_file():
        guards.refuse_mentions({FILE: Path(FILE).read_text()}, FORBID_MODULES)
    mod = guards.load_student_file(FILE)
    return per_run(case, rank, world, lambda run, r, n: _one_run(mod, run, r, n))


def _fmt(result) -> str:
    c, t, a = result
    return f"(correct {c:g}, total {t:g}, accuracy {a:.4f})"


def problem(case: dict, outs: list[dict]) -> str | None:
    """What is wrong with ``evaluate`` on every rank, or None."""
    w, n = case["ranks"], len(case["y"])
    if len(outs) != w or any(o is None for o in outs):
        return f"expected the results of {w} ranks, got {len(outs)}"
    where = f"{n} samples on {w} ranks"
    pred = (case["x"].double() @ case["weight"].double().T + case["bias"].double()).argmax(1)
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
    kinds = [str(o.get("kinds", "int,int,float")) for o in outs]
    if any(k != "int,int,float" for k in kinds):
        return (
            f"{where}: evaluate returned correct, total and accuracy as "
            f"{kinds[0].replace(',', ', ')}; the docstring promises int, int and float "
            "(.item() or int() of a tensor; a float32 tensor also rounds the accuracy)"
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
    said = []
    for job, ranks in zip(inputs["cases"], outputs["cases"], strict=True):
        if len(ranks) != job["world_size"]:
            raise CheckFailed(
                f"expected the results of {job['world_size']} ranks, got {len(ranks)}"
            )
        for run, outs in run_outputs(job, ranks):
            if why := problem(run, outs):
                raise CheckFailed(why)
            said.append(f"{len(run['y'])} on {run['ranks']}")
    return (
        f"every sample scored exactly once, the exact count and accuracy on every rank "
        f"({', '.join(said)} ranks, ranks with nothing to score among them)"
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
    visible_inputs=visible_inputs,
    files=(FILE,),
)
