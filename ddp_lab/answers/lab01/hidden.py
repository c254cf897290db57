"""What the grader adds to lab 1's kit judges: exact comparisons and diagnoses.

- ex1: the balanced sizes of the batch a wrong split failed on;
- ex3: which typical combination of the shard gradients came back (the plain average, the
  sum), with the weights ``B_k / B`` of the case;
- ex4: a variance that leaves out the spread of the shard means (the count-weighted mean of
  the shard variances);
- ex5: every case compared with the exact cost model, and which term is missing, counted
  twice or half-right.
"""

from __future__ import annotations

import math

import torch

from ddp_lab.answers import Hidden
from ddp_lab.answers.lab01.references import (
    reference_average_gradients,
    shard_sizes,
    step_time_terms,
    within_shard_variance,
)
from ddp_lab.checks.failure import CheckFailed, all_close, is_close
from ddp_lab.checks.lab01 import ex1_split_batch as ex1
from ddp_lab.checks.lab01 import ex3_data_parallel_gradients as ex3
from ddp_lab.checks.lab01 import ex4_combine_shard_stats as ex4
from ddp_lab.checks.lab01 import ex5_dataparallel_step_time as ex5
from ddp_lab.checks.lab01.common import ATOL, RTOL
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


# --- exercise 3 ---------------------------------------------------------------------------


def _gradients_explain(inputs: dict, outputs: dict) -> str | None:
    """Name the plain average and the sum of the shard gradients."""
    got = outputs.get("grads")
    model = ex3.model_of(inputs)
    shards = list(zip(inputs["xs"], inputs["ys"], strict=True))
    per_shard = [ex3.full_batch_gradients(model, xk, yk) for xk, yk in shards]
    sizes = [int(x.shape[0]) for x in inputs["xs"]]
    weights = ", ".join(f"{s}/{sum(sizes)}" for s in sizes)
    what = ex3.describe(inputs)
    if all_close(got, reference_average_gradients(per_shard), ATOL, RTOL):
        return (
            f"{what}: you returned the plain average of the shard gradients. With unequal "
            f"shards that is not the full-batch gradient: weight shard k by B_k / B "
            f"(here {weights})"
        )
    summed = [torch.stack(g).sum(0) for g in zip(*per_shard, strict=True)]
    if all_close(got, summed, ATOL, RTOL):
        return (
            f"{what}: you returned the sum of the shard gradients; weight shard k by B_k / B "
            f"(here {weights}) so that the weights add up to 1"
        )
    return None


# --- exercise 4 ---------------------------------------------------------------------------


def _stats_explain(inputs: dict, outputs: dict) -> str | None:
    """A right mean with the count-weighted mean of the shard variances as the variance."""
    got_mean, got_var = outputs.get("mean"), outputs.get("var")
    samples = inputs["samples"]
    if not is_close(got_mean, samples.mean(0), ATOL, RTOL):
        return None  # the kit's message on the mean stands
    within = within_shard_variance(inputs["variances"], inputs["counts"])
    if is_close(got_var, within, ATOL, RTOL):
        return (
            f"{ex4.describe(inputs)}: your variance averages the shard variances and leaves "
            "out how far the shard means lie from the batch mean; add "
            "sum_k B_k (mean_k - mean)^2 / B"
        )
    return None


# --- exercise 5 ---------------------------------------------------------------------------

_TERM_HINTS = {
    "compute": "the compute term compute_s / n",
    "replicate": (
        "a parameter transfer, (n - 1) * param_bytes / bandwidth: nn.DataParallel copies the "
        "weights to every device again at every step (replicate), and the gradients come "
        "back to device 0 (reduce); count both"
    ),
    "scatter": "the scatter term (n - 1) / n * batch_bytes / bandwidth",
    "gather": (
        "the output term 2 (n - 1) / n * output_bytes / bandwidth (outputs in, and their "
        "gradients out again in backward)"
    ),
    "python": "the Python term n * host_s (the GIL serialises the n threads' launches)",
}


def _diagnose_time(got: float, n: int, terms: dict[str, float]) -> str | None:
    expected = sum(terms.values())
    partial = {  # the classic half-right terms: what is missing, and why it is wrong
        "python": (
            terms["python"] * (n - 1) / n,
            "the Python term counts one launch (host_s); the n threads launch one after "
            "another under the GIL: n * host_s",
        ),
        "gather": (
            terms["gather"] / 2,
            "the output term counts the outputs once; their gradients go out again in "
            "backward: 2 (n - 1) / n * output_bytes / bandwidth",
        ),
    }
    for delta, hint in partial.values():
        if delta > 1e-8 * expected and math.isclose(got, expected - delta, rel_tol=1e-9):
            return hint
    for name, value in terms.items():
        key = "replicate" if name == "reduce" else name
        if value > 1e-8 * expected and math.isclose(got, expected - value, rel_tol=1e-9):
            return f"your time leaves out {_TERM_HINTS[key]}"
        if value > 1e-8 * expected and math.isclose(got, expected + value, rel_tol=1e-9):
            return f"your time counts one term twice: {_TERM_HINTS[key]}"
    return None


def _time_problem(inputs: dict, outputs: dict) -> str | None:
    """A case whose time differs from the exact model: the first one whose difference names
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
            hint = _diagnose_time(t, case["n"], terms)
            if hint:
                return f"{said}; {hint}"
            wrong.append(said)
    return wrong[0] if wrong else None


def _time_check(inputs: dict, outputs: dict) -> None:
    if problem := _time_problem(inputs, outputs):
        raise CheckFailed(problem)


HIDDEN = {
    "test_ex1_split_batch": Hidden(explain=_split_explain),
    "test_ex3_data_parallel_gradients": Hidden(explain=_gradients_explain),
    "test_ex4_combine_shard_stats": Hidden(explain=_stats_explain),
    "test_ex5_dataparallel_step_time": Hidden(check=_time_check, explain=_time_problem),
}
