"""What the grader adds to lab 3's kit judges: exact comparisons and precise diagnoses.

- ex2: which typical run the ranks' reads or weights are (a sampler with seed 0, a rank
  that trained alone on its shard, gradients summed instead of averaged);
- ex4: which typical gradient came back (the sum over the ranks, the rank's own);
- ex5: every call compared with the exact formulas, and which typical rule a wrong
  ``scaled_lr`` follows (the square-root rule, a factor left out, the ratio upside down).

(ex1 and ex3 have none: torch's ``DistributedSampler`` and the count on the whole set are
exact oracles already, and the kit's diagnoses are properties.)
"""

from __future__ import annotations

import math

import torch

from ddp_lab.answers import Hidden
from ddp_lab.answers.lab03.references import (
    expected_scaled_lr,
    expected_warmup_lr,
    shuffled_shards,
)
from ddp_lab.checks.failure import CheckFailed, max_abs_diff
from ddp_lab.checks.lab03 import ex2_ddp_train as ex2
from ddp_lab.checks.lab03 import ex4_my_ddp as ex4
from ddp_lab.checks.lab03 import ex5_scaled_lr as ex5
from ddp_lab.checks.lab03.common import (
    RecordingDataset,
    same_state,
    sgd_on_batches,
    state,
    tiny_net,
)

# --- exercise 2 -----------------------------------------------------------------------------


def _reads_with(case: dict, seed_of_epoch) -> list[list[int]]:
    """What each rank reads when its sampler's seed in ``epoch`` is ``seed_of_epoch(epoch)``."""
    n, w, b = len(case["y"]), case["world_size"], case["batch_size"]
    out: list[list[int]] = [[] for _ in range(w)]
    for epoch in range(case["epochs"]):
        shards = shuffled_shards(n, w, 0, seed_of_epoch(epoch))
        for r in range(w):
            out[r] += shards[r][: len(shards[r]) // b * b]
    return out


def _alone(case: dict, rank: int) -> dict:
    """Rank ``rank``'s weights when it trains alone on its shards (no gradient averaging)."""
    n, w, b, seed = len(case["y"]), case["world_size"], case["batch_size"], case["seed"]
    batches = []
    for epoch in range(case["epochs"]):
        shard = shuffled_shards(n, w, epoch, seed)[rank]
        batches += [shard[k : k + b] for k in range(0, len(shard) - b + 1, b)]
    model = tiny_net(case["dims"], case["init"])
    return state(sgd_on_batches(model, RecordingDataset(case["x"], case["y"]), batches, case["lr"]))


def _train_case_explain(case: dict, outs: list[dict]) -> str | None:
    if len(outs) != case["world_size"] or ex2.setup_problem(outs, case["world_size"]):
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
    w, b = case["world_size"], case["batch_size"]
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
    for case, outs in zip(inputs["cases"], outputs["cases"], strict=True):
        if ex2.problem(case, outs):
            return _train_case_explain(case, outs)
    return None


# --- exercise 4 -----------------------------------------------------------------------------


def _own_gradient(case: dict, rank: int) -> dict:
    """Rank ``rank``'s gradient of its own first batch at rank 0's weights (no all-reduce)."""
    model = tiny_net(case["dims"], case["inits"][0])
    loss = torch.nn.functional.cross_entropy(model(case["xs"][rank][0]), case["ys"][rank][0])
    loss.backward()
    return {k: p.grad.detach().clone() for k, p in model.named_parameters()}


def _myddp_explain(inputs: dict, outputs: dict) -> str | None:
    for case, outs in zip(inputs["cases"], outputs["cases"], strict=True):
        why = ex4.problem(case, outs)
        if not why:
            continue
        if "after the first backward" not in why:
            return None  # the kit's diagnosis is precise already
        w, at = case["world_size"], ex4.where(case)
        mean = ex4.big_batch_gradient(case)
        for r, o in enumerate(outs):
            g = o["grads0"]
            if same_state(g, mean):
                continue
            if same_state(g, {k: v * w for k, v in mean.items()}):
                return (
                    f"{at}: after backward, rank {r} holds the SUM of the ranks' gradients: "
                    "divide by the world size"
                )
            if same_state(g, _own_gradient(case, r)):
                return (
                    f"{at}: after backward, rank {r} holds its own gradient: all-reduce every "
                    "gradient in a hook (param.register_post_accumulate_grad_hook) and divide "
                    "by the world size"
                )
            return None
        return None
    return None


# --- exercise 5 -----------------------------------------------------------------------------


def _scaled_hint(setup: list, got) -> str | None:
    """Which typical rule a wrong ``scaled_lr`` value follows (None: it is right)."""
    base_lr, base_batch, b, w, k = setup
    want = expected_scaled_lr(*setup)
    if ex5.close(got, want):
        return None
    ratio = b * w * k / base_batch
    hints = [
        (
            base_lr * math.sqrt(ratio),
            "that is the square-root rule; the linear rule multiplies by the ratio of global "
            "batches itself",
        ),
        (base_lr, "the learning rate must grow with the global batch"),
        (base_lr * b / base_batch * k, "the global batch counts every process: times world_size"),
        (
            base_lr * b * w / base_batch,
            "the global batch also counts the accumulated micro-batches: times accum_steps",
        ),
        (base_lr / ratio, "the ratio is upside down: a larger batch gets a larger rate"),
        (base_lr * w, "scale by the global batch over base_batch, not by world_size alone"),
    ]
    hint = next(
        (h for v, h in hints if ex5.close(got, v)),
        "lr = base_lr * (batch_size * world_size * accum_steps) / base_batch",
    )
    return f"{ex5.said_scaled(tuple(setup), got)}, expected {want:.6g}: {hint}"


def _lr_explain(inputs: dict, outputs: dict) -> str | None:
    for setup, got in zip(inputs["scaled"], outputs["scaled"], strict=True):
        if isinstance(got[0], float) and (hint := _scaled_hint(setup, got[0])):
            return hint
    return None  # warmup_lr: the kit's property says what is wrong


def _lr_check(inputs: dict, outputs: dict) -> None:
    for setup, got in zip(inputs["scaled"], outputs["scaled"], strict=True):
        for args, value in zip(ex5.scaled_calls(setup), got, strict=True):
            want = expected_scaled_lr(*args)
            if not ex5.close(value, want):
                raise CheckFailed(f"{ex5.said_scaled(args, value)}, expected {want:.6g}")
    for ramp, got in zip(inputs["warmup"], outputs["warmup"], strict=True):
        for step, value in zip(ex5.warmup_steps_probed(ramp), got, strict=True):
            want = expected_warmup_lr(step, ramp[0], ramp[1], ramp[2])
            if not ex5.close(value, float(want)):
                raise CheckFailed(
                    f"warmup_lr(step={step}, base_lr={ramp[0]:.4g}, peak_lr={ramp[1]:.4g}, "
                    f"warmup_steps={ramp[2]}) = {value}, expected {want:.6g}: base_lr at step 0, "
                    "a straight line up to peak_lr at step warmup_steps, peak_lr from then on"
                )


HIDDEN = {
    "test_ex2_ddp_train": Hidden(explain=_train_explain),
    "test_ex4_my_ddp": Hidden(explain=_myddp_explain),
    "test_ex5_scaled_lr": Hidden(check=_lr_check, explain=_lr_explain),
}
