"""What the grader adds to lab 1's kit judges: exact comparisons and diagnoses.

- ex1: the balanced sizes of the batch a wrong split failed on;
- ex2: which typical combination came back (the plain average or the sum of the shard
  gradients, this step's gradient added to the stale one, steps taken shard after shard,
  the plain average of the shard losses), with the weights ``B_k / B`` of the case;
- ex4: a variance that leaves out the spread of the shard means (the count-weighted mean of
  the shard variances);
- ex5: every call compared with the exact cost model, and which term is missing, counted
  twice, half-right, or modelled as one copy per device.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ddp_lab.answers import Hidden
from ddp_lab.answers.lab01.references import (
    shard_gradients,
    shard_sizes,
    step_time_terms,
    within_shard_variance,
)
from ddp_lab.checks.failure import CheckFailed
from ddp_lab.checks.lab01 import ex1_split_batch as ex1
from ddp_lab.checks.lab01 import ex2_data_parallel_step as ex2
from ddp_lab.checks.lab01 import ex4_combine_shard_stats as ex4
from ddp_lab.checks.lab01 import ex5_dataparallel_step_time as ex5
from ddp_lab.checks.lab01.common import TOLERANCE, close, model_of, param_names
from ddp_lab.checks.values import number

# --- exercise 1 ---------------------------------------------------------------------------


def _split_explain(inputs: dict, outputs: dict) -> str | None:
    """The kit's message for the first wrong batch, with that batch's balanced sizes."""
    results = outputs.get("results")
    if not isinstance(results, list) or len(results) != len(inputs["batches"]):
        return None
    for b, shards in zip(inputs["batches"], results, strict=True):
        try:
            ex1.check_batch(b["x"], b["y"], b["n"], shards)
        except CheckFailed as err:
            batch, n = b["x"].shape[0], b["n"]
            return f"{err} (e.g. sizes {shard_sizes(batch, n)} for {batch} into {n})"
    return None


# --- exercise 2 ---------------------------------------------------------------------------


def _first_wrong(inputs: dict, outputs: dict) -> tuple[dict, dict] | None:
    got = outputs.get("cases")
    if not isinstance(got, list) or len(got) != len(inputs["cases"]):
        return None
    for case, result in zip(inputs["cases"], got, strict=True):
        try:
            ex2._check_case(case, result)
        except CheckFailed:
            return case, result
        except Exception:  # noqa: BLE001 - malformed outputs: the kit's message stands
            return None
    return None


def _sequential_state(case: dict, weight) -> dict[str, torch.Tensor]:
    """The weights after stepping shard after shard (each replica copied from the weights
    the previous shard's step left), each step scaled by ``weight(B_k)``."""
    model = model_of(case, "float64")
    for x, y in zip(case["xs"], case["ys"], strict=True):
        if len(y) == 0:
            continue
        loss = F.cross_entropy(model(x.double()), y)
        grads = torch.autograd.grad(loss, list(model.parameters()))
        with torch.no_grad():
            for p, g in zip(model.parameters(), grads, strict=True):
                p -= case["lr"] * weight(len(y)) * g
    return {k: v.detach() for k, v in model.state_dict().items()}


def _step_explain(inputs: dict, outputs: dict) -> str | None:
    """Name the typical wrong combinations on the first case that fails."""
    found = _first_wrong(inputs, outputs)
    if found is None:
        return None
    case, got = found
    what, dtype = ex2.describe(case), case["dtype"]
    sizes = ex2.sizes_of(case)
    total = sum(sizes)
    weights = ", ".join(f"{s}/{total}" for s in sizes if s)
    model = model_of(case, "float64")
    xs = [x.double() for x in case["xs"]]
    per_shard = shard_gradients(model, list(zip(xs, case["ys"], strict=True)), F.cross_entropy)
    stale = [case["stale"][n].double() for n in param_names(case)]
    got_grads = got.get("grads") if isinstance(got.get("grads"), list) else []

    def same(candidate) -> bool:
        return len(got_grads) == len(candidate) and all(
            close(g, e, dtype) for g, e in zip(got_grads, candidate, strict=True)
        )

    count = len(per_shard)
    loss, grads, after = ex2.oracle(case)
    state = got.get("state") if isinstance(got.get("state"), dict) else {}
    grads_ok = same(grads)
    state_ok = set(state) == set(after) and all(close(state[k], after[k], dtype) for k in after)
    if not grads_ok:
        stacked = list(zip(*(g for _, _, g in per_shard), strict=True))
        if count > 1 and same([sum(gs) / count for gs in stacked]):
            return (
                f"{what}: you returned the plain average of the shard gradients. With unequal "
                "shards that is not the whole batch's gradient: a sample in a small shard "
                "counts more than one in a big shard. Weight shard k by B_k / B (here "
                f"{weights})"
            )
        if count > 1 and same([sum(gs) for gs in stacked]):
            return (
                f"{what}: you returned the sum of the shard gradients; weight shard k by "
                f"B_k / B (here {weights}) so that the weights add up to 1"
            )
        if same(stale):
            return (
                f"{what}: your .grad still holds the gradient the model arrived with (the "
                "previous step's). Leave this step's combined gradient in each parameter's "
                ".grad, as DDP does"
            )
        if same([g + s for g, s in zip(grads, stale, strict=True)]):
            return (
                f"{what}: your .grad is this step's gradient plus the one the model arrived "
                "with (the previous step's: backward() and += add to .grad). Replace .grad by "
                "this step's combined gradient, or zero it first"
            )
    if not state_ok and count > 1:
        for weight in (lambda b: b / total, lambda b: 1 / count, lambda b: 1.0):
            moved = _sequential_state(case, weight)
            if set(state) == set(moved) and all(close(state[k], moved[k], dtype) for k in moved):
                return (
                    f"{what}: you stepped after each shard, so every replica after the first "
                    "started from weights the previous shard had already moved. In a "
                    "data-parallel step the replicas all start from the same weights: "
                    "combine the gradients first, then take one step"
                )
    value = number(got.get("loss"))
    plain_loss = sum(shard_loss for _, shard_loss, _ in per_shard) / max(1, count)
    atol, rtol = TOLERANCE[dtype]
    loss_ok = abs(value - loss) <= atol + rtol * abs(loss)
    if grads_ok and state_ok and not loss_ok and count > 1:
        if abs(value - plain_loss) <= atol + rtol * abs(plain_loss):
            return (
                f"{what}: you returned the plain average of the replicas' losses; the mean "
                f"loss over all {total} samples weights shard k by B_k / B (here {weights})"
            )
    return None


# --- exercise 4 ---------------------------------------------------------------------------


def _stats_explain(inputs: dict, outputs: dict) -> str | None:
    """A right mean with the count-weighted mean of the shard variances as the variance."""
    got = outputs.get("cases")
    if not isinstance(got, list) or len(got) != len(inputs["cases"]):
        return None
    for case, result in zip(inputs["cases"], got, strict=True):
        mean, var = ex4.truth(case)
        if not isinstance(result, dict):
            return None
        got_mean, got_var = result.get("mean"), result.get("var")
        if ex4.within(got_mean, mean, ex4.mean_tolerance(case)) and ex4.within(
            got_var, var, ex4.var_tolerance(case)
        ):
            continue
        if not ex4.within(got_mean, mean, ex4.mean_tolerance(case)):
            return None  # the kit's message on the mean stands
        if float(case["ref"].abs().max()) >= 1e3:
            return None  # far from 0: the kit names the rounding
        inside = within_shard_variance(case["variances"].double(), case["counts"])
        if ex4.within(got_var, inside, ex4.var_tolerance(case)):
            return (
                f"{ex4.describe(case)}: your variance averages the shard variances and leaves "
                "out how far the shard means lie from the batch mean: the squared distance "
                "of a sample to the batch mean is its distance to its shard's mean plus the "
                "distance of that mean to the batch mean"
            )
        return None
    return None


# --- exercise 5 ---------------------------------------------------------------------------

_TERM_HINTS = {
    "compute": "the compute term compute_s / n",
    "replicate": (
        "one of the two chain transfers of a step: the weights go out (replicate, "
        "broadcast_coalesced) and the gradients come back (reduce_add_coalesced)"
    ),
    "reduce": (
        "one of the two chain transfers of a step: the weights go out (replicate, "
        "broadcast_coalesced) and the gradients come back (reduce_add_coalesced)"
    ),
    "scatter": "the scatter term (n - 1) / n * batch_bytes / bandwidth",
    "gather": (
        "the output term 2 (n - 1) / n * output_bytes / bandwidth (outputs in, and their "
        "gradients out again in backward)"
    ),
    "python": "the Python term n * host_s (the GIL serialises the n threads' launches)",
}


def _alternatives(n: int, kw: dict, terms: dict[str, float]) -> list[tuple[float, str]]:
    """``(time, diagnosis)`` of the classic wrong models of one call."""
    p, c, bw = kw["param_bytes"], kw["chunk_bytes"], kw["bandwidth"]
    expected = sum(terms.values())
    pipe = terms["replicate"]
    return [
        (
            expected - 2 * pipe + 2 * (n - 1) * p / bw,
            "your model sends one full copy per device, one after another ((n - 1) * "
            "param_bytes / bandwidth each way). nn.DataParallel replicates with "
            "broadcast_coalesced and reduces with reduce_add_coalesced, NCCL collectives "
            "that pipeline chunks along the chain: about param_bytes / bandwidth whatever n",
        ),
        (
            expected - 2 * pipe + 2 * p / bw,
            "your pipeline ends when the last chunk leaves device 0; it still has n - 2 "
            "links to go (the pipeline's fill): add (n - 2) chunks' time",
        ),
        (
            expected - 2 * pipe + 2 * (p + (n - 2) * c) / bw,
            "a model smaller than one chunk travels as one chunk of param_bytes, not "
            "chunk_bytes: each of its n - 1 links takes param_bytes / bandwidth",
        ),
        (
            expected - terms["python"] * (n - 1) / n,
            "the Python term counts one launch (host_s); the n threads launch one after "
            "another under the GIL: n * host_s",
        ),
        (
            expected - terms["gather"] / 2,
            "the output term counts the outputs once; their gradients go out again in "
            "backward: 2 (n - 1) / n * output_bytes / bandwidth",
        ),
    ]


def _diagnose_time(got: float, n: int, kw: dict, terms: dict[str, float]) -> str | None:
    expected = sum(terms.values())
    for value, hint in _alternatives(n, kw, terms):
        if not math.isclose(value, expected, rel_tol=1e-9) and math.isclose(
            got, value, rel_tol=1e-9
        ):
            return hint
    for name, value in terms.items():
        if value > 1e-8 * expected and math.isclose(got, expected - value, rel_tol=1e-9):
            return f"your time leaves out {_TERM_HINTS[name]}"
        if value > 1e-8 * expected and math.isclose(got, expected + value, rel_tol=1e-9):
            return f"your time counts one term twice: {_TERM_HINTS[name]}"
    return None


def _time_problem(inputs: dict, outputs: dict) -> str | None:
    """A call whose time differs from the exact model: the first one whose difference names
    a typical mistake, else the first one."""
    got_all = outputs.get("times")
    if not isinstance(got_all, list) or len(got_all) != len(inputs["cases"]):
        return None
    wrong = []
    for case, got in zip(inputs["cases"], got_all, strict=True):
        t = number(got)
        if math.isnan(t):
            return None  # not a number: the kit's message stands
        terms = step_time_terms(case["n"], **case["kwargs"])
        expected = sum(terms.values())
        if not math.isclose(t, expected, rel_tol=1e-9, abs_tol=1e-15):
            parts = ", ".join(f"{k} {v:.4g}" for k, v in terms.items())
            said = f"{ex5.call(case)}: expected {expected:.6g} s ({parts}), got {t:.6g} s"
            hint = _diagnose_time(t, case["n"], case["kwargs"], terms)
            if hint:
                return f"{said}; {hint}"
            wrong.append(said)
    return wrong[0] if wrong else None


def _time_check(inputs: dict, outputs: dict) -> None:
    if problem := _time_problem(inputs, outputs):
        raise CheckFailed(problem)


HIDDEN = {
    "test_ex1_split_batch": Hidden(explain=_split_explain),
    "test_ex2_data_parallel_step": Hidden(explain=_step_explain),
    "test_ex4_combine_shard_stats": Hidden(explain=_stats_explain),
    "test_ex5_dataparallel_step_time": Hidden(check=_time_check, explain=_time_problem),
}
