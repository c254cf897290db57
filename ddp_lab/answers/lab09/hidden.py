"""What the grader adds to lab 9's kit judges: exact comparisons and named diagnoses.

- ex1: the bytes compared with the reference; a wrong answer matched against typical rules
  (ZeRO's flat vector instead of each parameter's rows, ``tensor_split``'s rows instead of
  ``torch.chunk``'s, a parameter cut by numbers instead of rows, rows rounded down, every
  rank given the padded ``ceil(d0 / n)`` rows, gradients kept whole, one moment instead of
  two, the step counters counted);
- ex2: an optimizer that never moved the weights (built before ``fully_shard`` replaced the
  parameters), blocks kept gathered between their forward and their backward
  (``reshard_after_forward=False``: ZeRO-2's traffic);
- ex3: a block right in every number but with 4 all-reduces in its backward pass is told
  that q, k and v each reduce their input's gradient on their own;
- ex4: tensor groups that stride (the tensor dimension first) are told that
  ``init_device_mesh`` lays ranks out row by row.
"""

from __future__ import annotations

import math

from ddp_lab.answers import Hidden
from ddp_lab.answers.lab09 import references as ref
from ddp_lab.checks.failure import CheckFailed
from ddp_lab.checks.lab09 import ex1_fsdp_bytes as ex1
from ddp_lab.checks.lab09 import ex2_fsdp as ex2
from ddp_lab.checks.lab09 import ex3_dtensor_block as ex3
from ddp_lab.checks.lab09 import ex4_mesh as ex4
from ddp_lab.checks.values import number

# --- exercise 1 ---------------------------------------------------------------------------


def _fsdp_check(inputs: dict, outputs: dict) -> None:
    for case, got in zip(inputs["cases"], outputs["results"], strict=True):
        m = case["model"]
        want = ref.fsdp_bytes([tuple(s) for s in m["shapes"]], m["bytes"], case["world"])
        if ex1.case_problem(case, got, want):
            raise CheckFailed(f"fsdp_bytes for {ex1.describe(case)} differs from the reference")


def _rows_chunk(d0: int, n: int, r: int) -> int:
    c = math.ceil(d0 / n)
    return max(0, min(c, d0 - r * c))


def _rows_split(d0: int, n: int, r: int) -> int:
    return d0 // n + (r < d0 % n)


def _rule(shapes, e, n, *, rows=_rows_chunk, grads=True, moments=2, step=0, flat=False):
    out = []
    for r in range(n):
        if flat:
            total = sum(math.prod(s) for s in shapes)
            mine = _rows_chunk(total, n, r) * e
        else:
            mine = sum(rows(s[0], n, r) * math.prod(s[1:]) * e for s in shapes)
        whole = sum(math.prod(s) for s in shapes) * e
        out.append(
            {
                "params": mine,
                "grads": mine if grads else whole,
                "optimizer": moments * mine + step * 4 * len(shapes),
            }
        )
    return out


def _by_numbers(shapes, e, n):
    out = []
    for r in range(n):
        mine = sum(_rows_chunk(math.prod(s), n, r) * e for s in shapes)
        out.append({"params": mine, "grads": mine, "optimizer": 2 * mine})
    return out


_FSDP_TWINS = [
    (
        lambda s, e, n: _rule(s, e, n, flat=True),
        "that is ZeRO's flat vector cut into chunks (lab 7); FSDP2 cuts each parameter on "
        "its own, along dimension 0",
    ),
    (
        lambda s, e, n: _rule(s, e, n, rows=_rows_split),
        "that is torch.tensor_split's rule (the first d0 % n ranks one row more); FSDP2 cuts "
        "like torch.chunk: ceil(d0 / n) rows a rank, the last ranks what is left",
    ),
    (
        _by_numbers,
        "each parameter cut into ceil(numel / n) numbers; FSDP2 cuts it into whole rows "
        "(dimension 0), so a rank holds rows x the other dimensions",
    ),
    (
        lambda s, e, n: _rule(s, e, n, rows=lambda d0, n, r: d0 // n),
        "rows rounded down: the d0 % n rows left over are held by no rank in your count",
    ),
    (
        lambda s, e, n: _rule(s, e, n, rows=lambda d0, n, r: math.ceil(d0 / n)),
        "every rank counted with ceil(d0 / n) rows: that is the padded size FSDP2 allocates, "
        "but a rank's part (to_local()) holds only its own rows, fewer or none on the last "
        "ranks",
    ),
    (
        lambda s, e, n: _rule(s, e, n, grads=False),
        "FSDP2 reduce-scatters the gradients: each rank keeps its rows of them, not the whole",
    ),
    (
        lambda s, e, n: _rule(s, e, n, moments=1),
        "AdamW keeps two moments per parameter (exp_avg and exp_avg_sq), each of the "
        "parameter's size",
    ),
    (
        lambda s, e, n: _rule(s, e, n, step=1),
        "the step counters are left out (the docstring says so)",
    ),
]


def _same(got, want: list[dict]) -> bool:
    try:
        return all(number(row[k]) == w[k] for row, w in zip(got, want, strict=True) for k in w)
    except (TypeError, KeyError, ValueError):
        return False


def _fsdp_explain(inputs: dict, outputs: dict) -> str | None:
    """The twin that gives the student's bytes in every case (several twins can agree on a
    case: a model whose every parameter divides evenly), named on the first wrong case."""
    cases, results = inputs["cases"], outputs.get("results") or []
    if len(results) != len(cases):
        return None
    wrong = next(
        (
            c
            for c, got in zip(cases, results, strict=True)
            if ex1.case_problem(c, got, ex1.oracle(c))
        ),
        None,
    )
    if wrong is None:
        return None
    for twin, why in _FSDP_TWINS:
        if all(
            _same(
                got, twin([tuple(s) for s in c["model"]["shapes"]], c["model"]["bytes"], c["world"])
            )
            for c, got in zip(cases, results, strict=True)
        ):
            return f"fsdp_bytes for {ex1.describe(wrong)}: {why}"
    return None


# --- exercise 2 ---------------------------------------------------------------------------


def _shard_explain(inputs: dict, outputs: dict) -> str | None:
    for case, ranks in zip(inputs["cases"], outputs.get("cases") or [], strict=False):
        want = ex2.oracle(case)
        for rank, got in enumerate(ranks):
            why = ex2.rank_problem(case, rank, got, want)
            if not why:
                continue
            layers = case["cfg"]["layers"]
            if got.get("collectives", {}).get("all_gather") == layers + 1:
                return (
                    f"{why}: each block was gathered once, for its forward pass, and kept "
                    "whole until its backward (reshard_after_forward=False): ZeRO-2's memory, "
                    "every block whole at the end of the forward; ZeRO-3 frees it and gathers "
                    "it again"
                )
            if got.get("bytes", {}).get("optimizer") == 0:
                return (
                    f"{why}: the optimizer holds no state, so it never updated the model's "
                    "parameters: fully_shard replaces every parameter with a new DTensor one, "
                    "and an optimizer built before it holds the old ones"
                )
            return None
    return None


# --- exercise 3 ---------------------------------------------------------------------------


def _dtensor_explain(inputs: dict, outputs: dict) -> str | None:
    for case, ranks in zip(inputs["cases"], outputs.get("cases") or [], strict=False):
        want = ex3.oracle(case)
        for rank, got in enumerate(ranks):
            why = ex3.rank_problem(case, rank, got, want)
            if why and "backward pass should call" in why and got["backward"] == {"all_reduce": 4}:
                return (
                    f"{why}: q, k and v each bring their input's gradient back to a whole with "
                    "their own all-reduce, three where one would do: the three layers read the "
                    "same input, so their partial gradients can be added first and reduced once"
                )
            if why:
                return None
    return None


# --- exercise 4 ---------------------------------------------------------------------------


def _mesh_explain(inputs: dict, outputs: dict) -> str | None:
    for case, ranks in zip(inputs["cases"], outputs.get("cases") or [], strict=False):
        want = ex4.oracle(case)
        for rank, got in enumerate(ranks):
            why = ex4.rank_problem(case, rank, got, want)
            if not why:
                continue
            if "group should be" in why:
                return (
                    f"{why}: the tensor dimension must come last: init_device_mesh lays the ranks "
                    "out row by row (torch.arange(world).view(shape)), so only the last "
                    "dimension's groups are neighbouring ranks"
                )
            return None
    return None


HIDDEN = {
    "test_ex1_fsdp_bytes": Hidden(check=_fsdp_check, explain=_fsdp_explain),
    "test_ex2_fsdp": Hidden(explain=_shard_explain),
    "test_ex3_dtensor_block": Hidden(explain=_dtensor_explain),
    "test_ex4_mesh": Hidden(explain=_mesh_explain),
}
