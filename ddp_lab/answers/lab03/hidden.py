"""What the grader adds to lab 3's kit judges: exact comparisons and precise diagnoses.

- ex2: which typical run the ranks' reads or weights are (a sampler with seed 0, a rank
  that trained alone on its shard, gradients summed instead of averaged);
- ex4 and ex5: which typical gradient came back (the sum over the ranks: never divided, or
  divided before the all-reduce had arrived; the rank's own: never waited for);
- ex6: which typical warm-up a wrong length is (the ratio floored or rounded, one step too
  many, the accumulation left out, the samples of one process).

(ex1 and ex3 have none: torch's ``DistributedSampler`` and the count on the whole set are
exact oracles already, and the kit's diagnoses are properties.)
"""

from __future__ import annotations

import math

import torch

from ddp_lab.answers import Hidden
from ddp_lab.answers.lab03.references import expected_warmup_steps, shuffled_shards
from ddp_lab.checks.failure import max_abs_diff
from ddp_lab.checks.lab03 import ex2_ddp_train as ex2
from ddp_lab.checks.lab03 import ex4_my_ddp as ex4
from ddp_lab.checks.lab03 import ex5_bucketed_ddp as ex5
from ddp_lab.checks.lab03 import ex6_warmup_steps as ex6
from ddp_lab.checks.lab03 import own_ddp
from ddp_lab.checks.lab03.common import (
    RecordingDataset,
    run_outputs,
    same_state,
    sgd_on_batches,
    state,
    tiny_net,
)

# --- exercise 2 -----------------------------------------------------------------------------


def _reads_with(case: dict, seed_of_epoch) -> list[list[int]]:
    """What each rank reads when its sampler's seed in ``epoch`` is ``seed_of_epoch(epoch)``."""
    n, w, b = len(case["y"]), case["ranks"], case["batch_size"]
    out: list[list[int]] = [[] for _ in range(w)]
    for epoch in range(case["epochs"]):
        shards = shuffled_shards(n, w, 0, seed_of_epoch(epoch))
        for r in range(w):
            out[r] += shards[r][: len(shards[r]) // b * b]
    return out


def _alone(case: dict, rank: int) -> dict:
    """Rank ``rank``'s weights when it trains alone on its shards (no gradient averaging)."""
    n, w, b, seed = len(case["y"]), case["ranks"], case["batch_size"], case["seed"]
    batches = []
    for epoch in range(case["epochs"]):
        shard = shuffled_shards(n, w, epoch, seed)[rank]
        batches += [shard[k : k + b] for k in range(0, len(shard) - b + 1, b)]
    model = tiny_net(case["dims"], case["init"])
    return state(sgd_on_batches(model, RecordingDataset(case["x"], case["y"]), batches, case["lr"]))


def _train_case_explain(case: dict, outs: list[dict]) -> str | None:
    if len(outs) != case["ranks"] or ex2.setup_problem(outs, case["ranks"]):
        return None
    at = ex2.where(case)
    reads = [o["reads"].tolist() for o in outs]
    if reads != ex2.expected_reads(case):
        hints = [
            (
                lambda e: e,
                "the samples follow seed 0, not `seed`: pass seed=seed to DistributedSampler",
            ),
            (
                lambda e: 0,
                "the samples follow seed 0, not `seed`, and repeat every epoch: pass seed=seed "
                "to DistributedSampler and call sampler.set_epoch(epoch)",
            ),
        ]
        for seed_of_epoch, hint in hints:
            if reads == _reads_with(case, seed_of_epoch):
                return f"{at}: {hint}"
        return None
    w, b = case["ranks"], case["batch_size"]
    expected = ex2.single_process(case)
    bad = [r for r, o in enumerate(outs) if not same_state(o["final"], expected)]
    if not bad:
        return None
    r = bad[0]
    said = (
        f"{at}: rank {r}'s final weights differ from one process trained on batches of {w} x "
        f"{b} = {w * b} samples (max abs difference "
        f"{max_abs_diff(outs[r]['final'], expected):.3g}): "
    )
    if same_state(outs[r]["final"], _alone(case, r)):
        return said + (
            f"rank {r} trained alone on its shard: wrap the model in DistributedDataParallel so "
            "that the gradients are averaged"
        )
    if same_state(outs[r]["final"], ex2.single_process(case, lr_factor=w)):
        return said + "the gradients were summed, not averaged, over the ranks"
    return None


def _train_explain(inputs: dict, outputs: dict) -> str | None:
    for job, ranks in zip(inputs["cases"], outputs["cases"], strict=True):
        if len(ranks) != job["world_size"]:
            return None
        for run, outs in run_outputs(job, [o["runs"] for o in ranks]):
            if ex2.problem(run, outs):
                return _train_case_explain(run, outs)
    return None


# --- exercises 4 and 5 ------------------------------------------------------------------------


def _own_gradient(run: dict, rank: int) -> dict:
    """Rank ``rank``'s gradient of its own first batch at rank 0's weights (no all-reduce)."""
    model = own_ddp.own_net(run["dims"], run["inits"][0])
    loss = torch.nn.functional.cross_entropy(model(run["xs"][rank][0]), run["ys"][rank][0])
    loss.backward()
    return {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.requires_grad}


def _gradient_explain(run: dict, outs: list[dict]) -> str | None:
    """Which typical gradient a rank holds after the first ``finish()``."""
    w, at = run["ranks"], own_ddp.where(run)
    atol, rtol = own_ddp.tolerances(run)
    mean = own_ddp.big_batch_gradient(run)
    for r, o in enumerate(outs):
        g = o["grads0"]
        if same_state(g, mean, atol, rtol):
            continue
        if same_state(g, {k: v * w for k, v in mean.items()}, atol, rtol):
            return (
                f"{at}: after finish(), rank {r} holds the SUM of the ranks' gradients: divide "
                "by the world size after work.wait() (a division before the wait is lost: the "
                "sum overwrites the tensor when it arrives)"
            )
        own = _own_gradient(run, r)
        if any(same_state(g, {k: v / f for k, v in own.items()}, atol, rtol) for f in (1, w)):
            return (
                f"{at}: after finish(), rank {r} holds its own gradient (perhaps divided by the "
                "world size): the sum arrives in the tensor only when you wait for it "
                "(work.wait() in finish())"
            )
        return None
    return None


def _own_ddp_explain(module):
    def explain(inputs: dict, outputs: dict) -> str | None:
        for job, ranks in zip(inputs["cases"], outputs["cases"], strict=True):
            if len(ranks) != job["world_size"]:
                return None
            for run, outs in run_outputs(job, ranks):
                why = module.problem(run, outs)
                if not why:
                    continue
                if "is not the average over the ranks" not in why:
                    return None  # the kit's diagnosis is precise already
                return _gradient_explain(run, outs)
        return None

    return explain


# --- exercise 6 -----------------------------------------------------------------------------


def _warmup_alternatives(call: dict) -> list[tuple[int, str]]:
    """``(value, diagnosis)`` of the typical wrong warm-ups of one call."""
    b, w, k = call["batch_size"], call["world_size"], call["accum_steps"]
    base, samples = call["base_batch"], call["warmup_samples"]
    glob = b * w * k

    def steady(rule) -> int:
        return rule(glob / base) if glob > base else 0

    data = -(-samples // glob)
    return [
        (
            max(steady(math.floor), data),
            "you floor the ratio k = global batch / base_batch; with N < k steps one step "
            "rises by k / N > 1 times base_lr: round up (the ceiling of k)",
        ),
        (
            max(steady(round), data),
            "you round the ratio k = global batch / base_batch; below k steps one step rises "
            "by more than base_lr: round up (the ceiling of k)",
        ),
        (
            max(glob // base + 1 if glob > base else 0, data),
            "k + 1 steps where k = global batch / base_batch is an integer: k steps already "
            "rise by exactly base_lr each",
        ),
        (
            max(-(-(b * w) // base) if b * w > base else 0, -(-samples // (b * w))),
            "your global batch leaves out accum_steps: the global batch counts the accumulated "
            "micro-batches too (batch_size x world_size x accum_steps)",
        ),
        (
            max(steady(math.ceil), -(-samples // (b * k))),
            "your warm-up counts the samples of one process; a step sees the samples of every "
            "process (the global batch)",
        ),
    ]


def _warmup_explain(inputs: dict, outputs: dict) -> str | None:
    """The typical mistake whose values match the student's on every call (so that no draw
    makes two mistakes look alike), said on the first wrong call."""
    results = outputs.get("results")
    calls = inputs["calls"]
    if not isinstance(results, list) or len(results) != len(calls):
        return None
    got = [r.get("value") if isinstance(r, dict) else None for r in results]
    if not all(isinstance(g, int) for g in got):
        return None  # not an int: the kit says so
    wrong = [i for i, (c, r) in enumerate(zip(calls, results, strict=True)) if ex6.problem(c, r)]
    if not wrong:
        return None
    tables = [_warmup_alternatives(c) for c in calls]
    for j, (_, hint) in enumerate(tables[0]):
        if all(tables[i][j][0] == got[i] for i in range(len(calls))):
            first = wrong[0]
            want = expected_warmup_steps(**calls[first])
            return f"{ex6.said(calls[first], got[first])}, expected {want}: {hint}"
    return None


HIDDEN = {
    "test_ex2_ddp_train": Hidden(explain=_train_explain),
    "test_ex4_my_ddp": Hidden(explain=_own_ddp_explain(ex4)),
    "test_ex5_bucketed_ddp": Hidden(explain=_own_ddp_explain(ex5)),
    "test_ex6_warmup_steps": Hidden(explain=_warmup_explain),
}
