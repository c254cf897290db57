"""What the grader adds to lab 4's kit judges: diagnoses of the typical mistakes, and the
reference pieces exercise 3 builds on.

The kit's judges compare with the global batch (``torch.var_mean``, autograd through
``F.batch_norm``) and are exact already; what they cannot say without computing the
mistakes themselves is *which* mistake a wrong answer is. Each diagnosis below fires only on
a wrong answer (``full_judge`` calls ``explain`` after a failed judge), and looks at every
run of the case set, not only the first one that failed:

- exercise 1: the ranks' means and variances averaged; the variance within the ranks only
  (the spread between their means forgotten); the unbiased variance; a sum of squares that
  loses the variance far from 0 (right near 0, wrong far from it: one all-reduce of
  ``[count, sum, sum of squares]`` is one); this rank's count; no collective at all. Right
  numbers with the wrong traffic (an all-gather, a slot per rank, calls that grow with the
  ranks) are said by the kit's judge, which records every collective: it needs no
  reference;
- exercise 2: this rank's sums where the global ones belong; this rank's count; the
  variance's path (the ``x_hat`` term) or the weight left out;
- exercise 3: ``running_var`` tracked with the biased variance; running statistics rebound
  instead of updated in place; momentum applied the wrong way round.

Exercise 3's ``sync_bn.py`` imports ``sync_stats.py`` and ``sync_grad.py`` (the student's
exercises 1 and 2): the grader writes the reference versions into its folder, so a mistake
there costs points once.
"""

from __future__ import annotations

import torch

from ddp_lab.answers import Hidden
from ddp_lab.answers.lab04 import references as ref
from ddp_lab.checks.failure import CheckFailed, is_close
from ddp_lab.checks.lab04 import ex1_sync_mean_var as ex1
from ddp_lab.checks.lab04 import ex2_sync_input_grad as ex2
from ddp_lab.checks.lab04.common import global_count, runs_of, var_mean
from ddp_lab.checks.values import number


def _near(got, want: torch.Tensor, tol: float) -> bool:
    return is_close(got, want.to(torch.float64), atol=tol, rtol=1e-6)


# --- exercise 1 ---------------------------------------------------------------------------


def stats_near_answers(run: dict) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The ``(mean, var)`` of each typical mistake on one run (float64)."""
    stats = [ref.local_stats(x.double()) for x in run["xs"]]
    full = [(n, m, v) for n, m, v in stats if n]
    counts = [n for n, _, _ in full]
    means = torch.stack([m for _, m, _ in full])
    variances = torch.stack([v for _, _, v in full])
    var, mean = var_mean(torch.cat(run["xs"]))
    n = global_count(run["xs"])
    w = torch.tensor(counts, dtype=torch.float64).reshape(-1, 1) / n
    return {
        "averaged": (means.mean(0), variances.mean(0)),
        "within": (mean, (w * variances).sum(0)),
        "unbiased": (mean, var * n / max(n - 1, 1)),
    }


_STATS_SAY = {
    "averaged": "you averaged the ranks' means or variances; that is wrong when ranks hold "
    "different numbers of samples (a rank without samples has none at all) or data that "
    "differ: weigh each rank by its count",
    "within": "your variance is the ranks' own variances, weighted, but misses the spread "
    "between the ranks' means: write the global variance around the GLOBAL mean, "
    "(x - m) = (x - m_k) + (m_k - m), and sum the square over each rank's slice",
    "unbiased": "you returned the unbiased variance (divided by n - 1); BatchNorm normalises "
    "with the biased one, divided by n",
}


def _explain_stats(inputs: dict, outputs: dict) -> str | None:
    runs = list(ex1.stats_runs(inputs, outputs))
    if not all(_well_formed(run, got) for run, got in runs):
        return None  # the kit's judge says what is malformed
    for name, say in _STATS_SAY.items():
        for run, got in runs:
            tol_mean, tol_var = ex1.tolerances(run)
            near = stats_near_answers(run)[name]
            var, mean = var_mean(torch.cat(run["xs"]))
            if _near(near[1], var, tol_var) and _near(near[0], mean, tol_mean):
                continue  # this run cannot tell the mistake from the right answer
            for rank, (m, v, _) in enumerate(got):
                if _near(v, near[1], tol_var) and _near(m, near[0], tol_mean):
                    return f"sync_mean_var on rank {rank} (run of {run['ranks']} ranks): {say}"
    for run, got in runs:
        if _own_statistics(run, got):
            return (
                f"sync_mean_var on {run['ranks']} ranks: every rank returned the statistics "
                "of its own slice; the global batch's need the other ranks' numbers: "
                "all-reduces of per-channel sums that every rank calls"
            )
    for run, got in runs:
        count = global_count(run["xs"])
        for rank, (_, _, n) in enumerate(got):
            own = float(run["xs"][rank][:, 0].numel())
            if number(n) == own != count:
                return (
                    f"sync_mean_var on rank {rank}: you returned this rank's count ({own:g}); "
                    f"the global batch holds {count:g} values per channel (all ranks together)"
                )
    return _explain_far(runs)


def _well_formed(run: dict, got: list) -> bool:
    """Every rank returned ``(mean, var, count)`` with one value per channel."""
    shape = (run["channels"],)
    return all(
        isinstance(r, list)
        and len(r) == 3
        and all(isinstance(t, torch.Tensor) and tuple(t.shape) == shape for t in r[:2])
        for r in got
    )


def _own_statistics(run: dict, got: list) -> bool:
    """True when every non-empty rank returned its own slice's mean and variance (and the
    run has ranks whose statistics differ from the global ones)."""
    tol_mean, tol_var = ex1.tolerances(run)
    var, mean = var_mean(torch.cat(run["xs"]))
    seen = False
    for x, result in zip(run["xs"], got, strict=True):
        if not len(x):
            continue
        own_var, own_mean = var_mean(x)
        if _near(own_var, var, tol_var) and _near(own_mean, mean, tol_mean):
            continue
        if not _near(result[1], own_var, tol_var) or not _near(result[0], own_mean, tol_mean):
            return False
        seen = True
    return seen


def _only_variance_wrong(run: dict, got: list) -> bool:
    """Every rank's count and mean are right (the variance is what failed)."""
    tol_mean, _ = ex1.tolerances(run)
    _, mean = var_mean(torch.cat(run["xs"]))
    count = global_count(run["xs"])
    return all(number(n) == count and _near(m, mean, tol_mean) for m, _, n in got)


def _explain_far(runs: list) -> str | None:
    """Right near 0 but wrong far from it: a sum of squares that loses the variance."""
    verdicts = []
    for run, got in runs:
        try:
            ex1.check_run(run, got)
            verdicts.append((run, True))
        except CheckFailed:
            verdicts.append((run, False))
    near_ok = all(ok for run, ok in verdicts if not run["far"])
    far_bad = [run for run, ok in verdicts if run["far"] and not ok]
    got_of = {id(run): got for run, got in runs}
    if not all(_only_variance_wrong(run, got_of[id(run)]) for run in far_bad):
        return None
    if near_ok and far_bad:
        run = far_bad[0]
        return (
            f"your statistics are right near 0 but not for {run['dtype']} data near "
            f"{ex1.FAR[run['dtype']]:g} ({run['ranks']} ranks): a sum of squares, "
            "E[x^2] - mean^2, subtracts two large numbers and loses the variance to rounding"
            + (
                " (accumulating in float64 only moves the problem further out)"
                if run["dtype"] == "float64"
                else ""
            )
            + "; sum squared deviations from a mean instead (the global one, which a first "
            "all-reduce gives every rank), never squares of the raw values"
        )
    return None


# --- exercise 2 ---------------------------------------------------------------------------


def grad_near_answers(run: dict, rank: int) -> dict[str, torch.Tensor]:
    """Each typical mistake's gradient on one rank of one run (float64)."""
    d = [t.double() for t in run["dys"]]
    h = [t.double() for t in run["x_hats"]]
    invstd, weight, count = run["invstd"].double(), run["weight"].double(), run["count"]
    local = ref.grad_sums(d[rank], h[rank])
    both = [ref.grad_sums(a, b) for a, b in zip(d, h, strict=True)]
    total = (sum(s for s, _ in both), sum(s for _, s in both))
    own = d[rank][:, 0].numel()
    view = (1, -1, *([1] * (d[rank].dim() - 2)))
    return {
        "local sums": ref.input_grad(d[rank], h[rank], invstd, weight, *local, count),
        "local count": ref.input_grad(d[rank], h[rank], invstd, weight, *total, max(own, 1)),
        "no x_hat term": (weight * invstd).reshape(view)
        * (d[rank] - (total[0] / count).reshape(view)),
        "no weight": ref.input_grad(
            d[rank], h[rank], invstd, torch.ones_like(weight), *total, count
        ),
    }


_GRAD_SAY = {
    "local sums": "you used this rank's sum(dy) and sum(dy * x_hat); every sample of the "
    "global batch moves the mean and the variance, so both sums must be all-reduced over "
    "the ranks",
    "local count": "the sums are global but you divided them by this rank's count; divide by "
    "the global count the forward computed",
    "no x_hat term": "you differentiated through the mean only: the variance depends on x "
    "too, which adds the term x_hat * sum(dy * x_hat) / n",
    "no weight": "the weight (gamma) is missing: y = weight * x_hat + bias, so dL/dx_hat is "
    "weight * dy",
}


def _explain_grad(inputs: dict, outputs: dict) -> str | None:
    for name, say in _GRAD_SAY.items():
        for run, got in runs_of(inputs, outputs):
            atol, rtol = ex2.TOL[run["dtype"]]
            right = ex2.autograd_input_grads(run["xs"], run["dys"], run["weight"])
            for rank, dx in enumerate(got):
                if not isinstance(dx, torch.Tensor) or not dx.numel():
                    continue
                near = grad_near_answers(run, rank)[name]
                scale = float(near.abs().max()) or 1.0
                if is_close(near, right[rank], atol * scale, rtol):
                    continue  # this rank cannot tell the mistake from the right answer
                if is_close(dx, near, atol * scale, rtol):
                    return f"sync_input_grad on rank {rank} ({run['ranks']} ranks): {say}"
    return None


# --- exercise 3 ---------------------------------------------------------------------------


def running_near_answers(run: dict) -> dict[str, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The running statistics after every step of each typical mistake (float64)."""
    out: dict[str, list] = {k: [] for k in ("biased", "not in place", "momentum swapped")}
    m = run["momentum"]
    start = (run["running_mean"].double(), run["running_var"].double())
    rm = {k: start[0].clone() for k in out}
    rv = {k: start[1].clone() for k in out}
    for xs in run["xs"]:
        var, mean = var_mean(torch.cat(xs))
        n = global_count(xs)
        unbiased = var * n / (n - 1)
        rm["biased"] = (1 - m) * rm["biased"] + m * mean
        rv["biased"] = (1 - m) * rv["biased"] + m * var
        rm["momentum swapped"] = m * rm["momentum swapped"] + (1 - m) * mean
        rv["momentum swapped"] = m * rv["momentum swapped"] + (1 - m) * unbiased
        for k in out:
            out[k].append((rm[k].clone(), rv[k].clone()))
    return out


_FUNCTION_SAY = {
    "biased": "running_var was updated with the biased variance; BatchNorm normalises with the "
    "biased one but tracks the UNBIASED one, var * n / (n - 1) with n the global count",
    "not in place": "running_mean and running_var never change: the Function must update the "
    "buffers it was given IN PLACE (mul_, add_, copy_), not bind new tensors to the names",
    "momentum swapped": "the momentum is applied the wrong way round: the new statistic gets "
    "weight momentum, r = (1 - momentum) * r + momentum * stat",
}


def _explain_function(inputs: dict, outputs: dict) -> str | None:
    for name, say in _FUNCTION_SAY.items():
        for run, got in runs_of(inputs, outputs):
            near = running_near_answers(run)[name]
            tol = 1e-4 if run["dtype"] == "float32" else 1e-9
            for rank, out in enumerate(got):
                if not isinstance(out, dict) or len(out.get("rv") or []) != len(near):
                    continue
                if all(
                    _near(out["rm"][s], near[s][0], tol) and _near(out["rv"][s], near[s][1], tol)
                    for s in range(len(near))
                ):
                    return f"rank {rank} ({run['ranks']} ranks, momentum {run['momentum']}): {say}"
    return None


def reference_pieces() -> dict[str, str]:
    """The files exercise 3 imports, as the reference solutions of exercises 1 and 2."""
    return {"sync_stats.py": ref.STATS_SOURCE, "sync_grad.py": ref.GRAD_SOURCE}


HIDDEN = {
    "test_ex1_sync_mean_var": Hidden(explain=_explain_stats),
    "test_ex2_sync_input_grad": Hidden(explain=_explain_grad),
    "test_ex3_sync_bn_function": Hidden(explain=_explain_function, files=reference_pieces),
}
