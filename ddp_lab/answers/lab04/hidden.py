"""What the grader adds to lab 4's kit judges: diagnoses of the typical mistakes, and the
reference pieces exercise 4 builds on.

The kit's judges compare with the global batch (``torch.var_mean``, autograd through
``F.batch_norm``) and are exact already; what they cannot say without computing the
mistakes themselves is *which* mistake a wrong answer is:

- exercise 2: the ranks' means and variances averaged (right only for equal shards);
- exercise 3: this rank's ``sum(dy)`` and ``sum(dy * x_hat)`` where the global ones belong
  (the reference formula without its all-reduce);
- exercise 4: ``running_var`` tracked with the biased variance.

Exercise 4's ``sync_bn.py`` imports ``sync_stats.py`` and ``sync_grad.py`` (the student's
exercises 2 and 3): the grader writes the reference versions into its folder, so a mistake
there costs points once.
"""

from __future__ import annotations

import inspect

import torch

from ddp_lab.answers import Hidden
from ddp_lab.answers.lab04 import references as ref
from ddp_lab.checks.failure import is_close
from ddp_lab.checks.lab04.common import var_mean

_FILE_HEAD = "import torch\nimport torch.distributed as dist\n\n\n"


def averaged_per_rank(xs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The classic mistake: the plain average of the (non-empty) ranks' means and variances."""
    pairs = [var_mean(x) for x in xs if len(x)]
    var = torch.stack([v for v, _ in pairs]).mean(0)
    mean = torch.stack([m for _, m in pairs]).mean(0)
    return mean, var


def _explain_stats(inputs: dict, outputs: dict) -> str | None:
    for case, got in zip(inputs["cases"], outputs["cases"], strict=True):
        wrong_mean, wrong_var = averaged_per_rank(case["xs"])
        for rank, result in enumerate(got):
            if not isinstance(result, list) or len(result) != 3:
                return None
            m, v, _ = result
            if is_close(m, wrong_mean, 1e-9) or is_close(v, wrong_var, 1e-9):
                return (
                    f"sync_mean_var on rank {rank}: you averaged the ranks' means or "
                    "variances; that is wrong when ranks hold different numbers of samples "
                    "(or data that differ). All-reduce the sums and the count, then divide."
                )
    return None


def local_input_grad(dy, x_hat, invstd, weight, count) -> torch.Tensor:
    """The mistake of exercise 3: the reference formula with this rank's gradient sums."""
    return ref.batchnorm_input_grad(
        dy, x_hat, invstd, weight, *ref.local_grad_sums(dy, x_hat), count
    )


def _explain_grad(inputs: dict, outputs: dict) -> str | None:
    for case, got in zip(inputs["cases"], outputs["cases"], strict=True):
        for rank, dx in enumerate(got):
            dy, x_hat = case["dys"][rank], case["x_hats"][rank]
            args = (dy, x_hat, case["invstd"], case["weight"])
            local_n = dy.numel() / case["weight"].numel()
            if any(
                is_close(dx, local_input_grad(*args, n), 1e-9) for n in (case["count"], local_n)
            ):
                return (
                    f"sync_input_grad on rank {rank}: you used this rank's sum(dy) and "
                    "sum(dy * x_hat); every sample of the global batch moves the mean and the "
                    "variance, so both sums must be all-reduced over the ranks"
                )
    return None


def biased_running_var(case: dict) -> torch.Tensor:
    """``running_var`` after the case's steps, tracked with the biased global variance."""
    r = case["running_var"].clone()
    for xs in case["xs"]:
        var, _ = var_mean(torch.cat(xs))
        r = (1 - case["momentum"]) * r + case["momentum"] * var
    return r


def _explain_function(inputs: dict, outputs: dict) -> str | None:
    for case, got in zip(inputs["cases"], outputs["cases"], strict=True):
        wrong = biased_running_var(case)
        for rank, out in enumerate(got):
            if isinstance(out, dict) and is_close(out.get("running_var"), wrong, 1e-9):
                return (
                    f"rank {rank}: running_var was updated with the biased variance; "
                    "BatchNorm normalises with the biased one but tracks the UNBIASED one, "
                    "var * n / (n - 1) with n the global count (momentum "
                    f"{case['momentum']})"
                )
    return None


def reference_pieces() -> dict[str, str]:
    """The files exercise 4 imports, as the reference solutions of exercises 2 and 3."""
    return {
        "sync_stats.py": _FILE_HEAD + inspect.getsource(ref.sync_mean_var),
        "sync_grad.py": _FILE_HEAD + inspect.getsource(ref.sync_input_grad),
    }


HIDDEN = {
    "test_ex2_sync_mean_var": Hidden(explain=_explain_stats),
    "test_ex3_sync_input_grad": Hidden(explain=_explain_grad),
    "test_ex4_sync_bn_function": Hidden(explain=_explain_function, files=reference_pieces),
}
