"""What the grader adds to lab 3's kit judges: exact comparisons and precise diagnoses.

- ex2: which typical run the ranks' reads or weights are (a sampler with seed 0, a rank
  that trained alone on its shard, gradients summed instead of averaged);
- ex4 and ex5: which typical gradient came back (the sum over the ranks: never divided, or
  divided before the all-reduce had arrived; the rank's own: never waited for);
- ex6: every call compared with the exact formula, and which typical rule a wrong value
  follows (the square-root rule, a factor left out, the ratio upside down).

(ex1 and ex3 have none: torch's ``DistributedSampler`` and the count on the whole set are
exact oracles already, and the kit's diagnoses are properties.)
"""

from __future__ import annotations

import math

import torch

from ddp_lab.answers import Hidden
from ddp_lab.answers.lab03.references import expected_lr_at, shuffled_shards
from ddp_lab.checks.failure import CheckFailed, max_abs_diff
from ddp_lab.checks.lab03 import ex2_ddp_train as ex2
from ddp_lab.checks.lab03 import ex4_my_ddp as ex4
from ddp_lab.checks.lab03 import ex5_bucketed_ddp as ex5
from ddp_lab.checks.lab03 import ex6_lr_at as ex6
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


def _scaled_hint(call: dict, got) -> str | None:
    """Which typical rule a wrong ``lr_at`` value after the warm-up follows (None: right)."""
    want = expected_lr_at(**call)
    if ex6.close(got, want):
        return None
    base_lr, b, w, k = call["base_lr"], call["batch_size"], call["world_size"], call["accum_steps"]
    ratio = b * w * k / call["base_batch"]
    hints = [
        (
            base_lr * math.sqrt(ratio),
            "that is the square-root rule; the linear rule multiplies by the ratio of global "
            "batches itself",
        ),
        (base_lr, "the learning rate must grow with the global batch"),
        (
            base_lr * b * k / call["base_batch"],
            "the global batch counts every process: times world_size",
        ),
        (
            base_lr * b * w / call["base_batch"],
            "the global batch also counts the accumulated micro-batches: times accum_steps",
        ),
        (base_lr / ratio, "the ratio is upside down: a larger batch gets a larger rate"),
        (base_lr * w, "scale by the global batch over base_batch, not by world_size alone"),
    ]
    hint = next(
        (h for v, h in hints if ex6.close(got, v)),
        "after the warm-up, lr = base_lr * (batch_size * world_size * accum_steps) / base_batch",
    )
    return f"{ex6.said(call, got)}, expected {want:.6g}: {hint}"


def _lr_explain(inputs: dict, outputs: dict) -> str | None:
    for setup, got in zip(inputs["setups"], outputs["scaled"], strict=True):
        call = ex6.scaled_calls(setup)[0]
        if not ex6.close(got[5], got[0]):
            return None  # a rate that keeps changing: the kit says so
        if isinstance(got[0], float) and (hint := _scaled_hint(call, got[0])):
            return hint
    return None  # the warm-up: the kit's comparison with the trainer says what is wrong


def _lr_check(inputs: dict, outputs: dict) -> None:
    for setup, scaled, warm in zip(
        inputs["setups"], outputs["scaled"], outputs["warmup"], strict=True
    ):
        calls = ex6.scaled_calls(setup) + ex6.warmup_calls(setup)
        for call, value in zip(calls, scaled + warm, strict=True):
            want = expected_lr_at(**call)
            if not ex6.close(value, float(want)):
                raise CheckFailed(
                    f"{ex6.said(call, value)}, expected {want:.6g}: the scaled rate "
                    "base_lr * global batch / base_batch, times step / warmup_steps during the "
                    "warm-up"
                )


HIDDEN = {
    "test_ex2_ddp_train": Hidden(explain=_train_explain),
    "test_ex4_my_ddp": Hidden(explain=_own_ddp_explain(ex4)),
    "test_ex5_bucketed_ddp": Hidden(explain=_own_ddp_explain(ex5)),
    "test_ex6_lr_at": Hidden(check=_lr_check, explain=_lr_explain),
}
