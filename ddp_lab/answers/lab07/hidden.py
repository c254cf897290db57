"""What the grader adds to lab 7's kit judges: exact comparisons and named diagnoses.

- ex1: the bytes compared with the reference's formula; a wrong answer matched against
  typical formulas (stage 2 without sharded gradients, ``N // world_size`` chunks, one
  moment instead of two, the stages' order backwards, negative bytes past the end, numbers
  that are not whole);
- ex2: wrong parameters matched against twins of AdamW run in this process: the ranks'
  updates averaged by an all-reduce (each moves ``1/N`` of the way), gradients summed
  instead of averaged, a zero gradient for a parameter without one (AdamW moves it), no
  clipping, each chunk clipped by its own norm, a tail of the flat
  vector that never changes;
- ex3: wrong gradients matched against the loss not divided by the number of
  micro-batches and the gradient of one micro-batch alone;
- ex4: wrong results matched against the row layer's bias added on every rank, its forward
  without the all-reduce, its backward with one, and the column layer's backward without
  one;
- ex5: in ``hidden_transformer.py``.
"""

from __future__ import annotations

import math

import torch

from ddp_lab.answers import Hidden
from ddp_lab.answers.lab07 import references as ref
from ddp_lab.answers.lab07.hidden_transformer import (
    activations_check,
    activations_explain,
)
from ddp_lab.checks.failure import CheckFailed, is_close
from ddp_lab.checks.lab07 import ex1_memory as ex1
from ddp_lab.checks.lab07 import ex2_zero as ex2
from ddp_lab.checks.lab07 import ex3_pipeline as ex3
from ddp_lab.checks.lab07 import ex4_tensor_parallel as ex4
from ddp_lab.checks.values import number

# --- exercise 1 ---------------------------------------------------------------------------


def _memory_check(inputs: dict, outputs: dict) -> None:
    for case, got in zip(inputs["cases"], outputs["results"], strict=True):
        m = case["model"]
        want = ref.memory_per_rank(ex1.numels(m), m["bytes"], case["world"], case["stage"])
        if ex1.case_problem(case, got, want):
            raise CheckFailed(f"memory_per_rank for {ex1.describe(case)} differs from the formula")


def _variant(case: dict, chunk, sharded_from: dict, moments: int = 2, clamp: bool = True):
    n = sum(ex1.numels(case["model"]))
    b = case["model"]["bytes"]
    out = []
    for r in range(case["world"]):
        mine = chunk(n, case["world"], r)
        mine = max(0, mine) if clamp else mine
        count = {part: mine if case["stage"] >= sharded_from[part] else n for part in ex1.KEYS}
        count["optimizer"] *= moments
        out.append({k: v * b for k, v in count.items()})
    return out


def _ceil_chunk(n: int, w: int, r: int) -> int:
    c = -(-n // w)
    return min(c, n - r * c)


_STAGES = {"optimizer": 1, "grads": 2, "params": 3}
_MEMORY_TWINS = [
    (
        lambda c: _variant(c, _ceil_chunk, {**_STAGES, "grads": 3}),
        "stage 2 shards the gradients too (each rank keeps and reduces only its chunk of "
        "them): your stage 2 keeps every gradient",
    ),
    (
        lambda c: _variant(c, lambda n, w, r: n // w, _STAGES),
        "your chunks hold N // world_size numbers each, so the last N % world_size numbers "
        "are on no rank: chunks of ceil(N / world_size), the last ranks holding what is left",
    ),
    (
        lambda c: _variant(c, _ceil_chunk, _STAGES, moments=1),
        "AdamW keeps two tensors per parameter (exp_avg and exp_avg_sq), each of the "
        "parameter's size: the optimizer state is twice the parameters' bytes",
    ),
    (
        lambda c: _variant(c, _ceil_chunk, {"params": 1, "grads": 2, "optimizer": 3}),
        "stage 1 shards only the optimizer state, stage 2 the gradients too, stage 3 the "
        "parameters too: your stages go the other way round",
    ),
    (
        lambda c: _variant(c, _ceil_chunk, _STAGES, clamp=False),
        "a rank whose chunk starts past the end of the flat vector owns nothing: 0 bytes, "
        "not a negative number",
    ),
]


def _memory_explain(inputs: dict, outputs: dict) -> str | None:
    results = outputs.get("results")
    if not isinstance(results, list) or len(results) != len(inputs["cases"]):
        return None
    for case, got in zip(inputs["cases"], results, strict=True):
        if not ex1.case_problem(case, got, ex1.oracle(case)):
            continue
        what = f"memory_per_rank for {ex1.describe(case)}"
        values = (
            [number(row.get(k)) for row in got if isinstance(row, dict) for k in ex1.KEYS]
            if isinstance(got, list)
            else []
        )
        if any(v == v and v != math.floor(v) for v in values):
            return (
                f"{what}: bytes are whole numbers; a rank holds ceil(N / world_size) numbers "
                "(or fewer), not N / world_size"
            )
        for twin, why in _MEMORY_TWINS:
            if not ex1.case_problem(case, got, twin(case)):
                return f"{what}: {why}"
        return None
    return None


# --- exercise 2 ---------------------------------------------------------------------------


def _chunks(spec: dict) -> list[tuple[int, int]]:
    n = sum(math.prod(s) for s in spec["shapes"])
    c = -(-n // spec["ranks"])
    return [(min(r * c, n), min((r + 1) * c, n)) for r in range(spec["ranks"])]


def _mean_grads(spec: dict, s: int) -> list[torch.Tensor | None]:
    return ex2.mean_grads(spec, s)


def _zero_for_none(spec: dict):
    """Every parameter without a gradient given a zero one (AdamW then moves it)."""

    def grads_of(s: int) -> list[torch.Tensor]:
        return [
            torch.zeros_like(t) if g is None else g
            for g, t in zip(_mean_grads(spec, s), spec["init"], strict=True)
        ]

    return grads_of


def _averaged_updates(spec: dict) -> list[list[torch.Tensor]]:
    """Every rank's copy averaged by an all-reduce after each step, in which only the owner's
    chunk was updated: each step moves 1/N of the way. Two twins: the owner's chunk goes on
    from its own (fully updated) copy, or from the averaged parameters."""
    n = spec["ranks"]
    own = [torch.cat([t.reshape(-1) for t in spec["init"]])]
    for full in ex2.oracle(spec):  # the owner's copy follows AdamW itself
        own.append(((n - 1) * own[-1] + full) / n)
    params = [torch.nn.Parameter(t.clone()) for t in spec["init"]]
    opt = torch.optim.AdamW(
        params,
        lr=spec["lr"],
        betas=tuple(spec["betas"]),
        eps=spec["eps"],
        weight_decay=spec["weight_decay"],
    )
    restarted = []
    for s in range(len(spec["grads"])):
        before = [p.detach().clone() for p in params]
        for p, g in zip(params, _mean_grads(spec, s), strict=True):
            p.grad = g
        if spec["max_norm"] is not None:
            torch.nn.utils.clip_grad_norm_(params, spec["max_norm"])
        opt.step()
        with torch.no_grad():
            for p, b in zip(params, before, strict=True):
                p.copy_(b + (p - b) / n)
        restarted.append(ex2.flat(params))
    return [own[1:], restarted]


def _chunk_clipped(spec: dict):
    """Each rank's chunk of the averaged gradient clipped by the chunk's own norm."""

    def grads_of(s: int) -> list[torch.Tensor]:
        mean = _mean_grads(spec, s)
        flat = torch.cat(
            [
                (torch.zeros_like(t) if g is None else g).reshape(-1)
                for g, t in zip(mean, spec["init"], strict=True)
            ]
        )
        for lo, hi in _chunks(spec):
            coef = spec["max_norm"] / (float(flat[lo:hi].double().norm()) + 1e-6)
            flat[lo:hi] *= min(1.0, coef)
        out, i = [], 0
        for g, t in zip(mean, spec["init"], strict=True):
            out.append(None if g is None else flat[i : i + t.numel()].view_as(t).clone())
            i += t.numel()
        return out

    return grads_of


def _near(got_steps, want_steps, tol: float) -> bool:
    return len(got_steps) == len(want_steps) and all(
        isinstance(g, torch.Tensor) and is_close(g, w, tol, 0.0)
        for g, w in zip(got_steps, want_steps, strict=True)
    )


def _zero_explain(inputs: dict, outputs: dict) -> str | None:
    for case, ranks in zip(inputs["cases"], outputs.get("cases", []), strict=False):
        for r, spec in enumerate(case["runs"]):
            outs = [rank_out[r] if len(rank_out) > r else None for rank_out in ranks]
            outs = outs[: spec["ranks"]]
            if not ex2.params_problem(spec, outs):
                continue
            if not all(isinstance(o, dict) and isinstance(o.get("params"), list) for o in outs):
                return None
            what = ex2.run_text(spec)
            tol = ex2.ATOL[spec["dtype"]]
            no_clip = {**spec, "max_norm": None}
            summed = [
                [
                    torch.stack(g).sum(0) if ex2.has_grad(spec, k, s) else None
                    for k, g in enumerate(zip(*step, strict=True))
                ]
                for s, step in enumerate(spec["grads"])
            ]
            averaged = (
                "each rank's parameters moved 1/N of the way: an all-reduce averaged the "
                "ranks' copies, in which only the owner's chunk was updated; gather the "
                "chunks instead (all_gather of equal-sized, padded chunks)"
            )
            twins = [(twin, averaged) for twin in _averaged_updates(spec)] + [
                (
                    ex2.oracle(spec, summed.__getitem__),
                    "you summed the ranks' gradients: average them (divide by the number of "
                    "ranks in the group); AdamW is nearly blind to the scale, but eps and "
                    "clipping are not",
                ),
            ]
            if spec["frozen"] or spec["skips"]:
                twins.append(
                    (
                        ex2.oracle(spec, _zero_for_none(spec)),
                        "a parameter without a gradient (.grad None: frozen, or unused in a "
                        "step) was given a zero gradient, so AdamW moved it (weight decay, and "
                        "the momentum of earlier steps); torch.optim.AdamW skips such a "
                        "parameter: no update, no decay, its step count unchanged",
                    )
                )
            if spec["max_norm"] is not None:
                twins += [
                    (
                        ex2.oracle(no_clip),
                        f"the gradients were not clipped: their global norm is above "
                        f"max_norm {spec['max_norm']:.3g} at some steps",
                    ),
                    (
                        ex2.oracle(no_clip, _chunk_clipped(spec)),
                        "each rank clipped its chunk by the norm of its own chunk: clipping "
                        "needs the norm of the whole averaged gradient (all-reduce the chunks' "
                        "sums of squares, as lab 5's global_grad_norm)",
                    ),
                ]
            for want, why in twins:
                if all(_near(o["params"], want, tol) for o in outs):
                    return f"{what}: {why}"
            n = sum(math.prod(s) for s in spec["shapes"])
            tail = n % spec["ranks"]
            init = torch.cat([t.reshape(-1) for t in spec["init"]])
            if tail and all(
                isinstance(p, torch.Tensor)
                and p.shape == init.shape
                and torch.equal(p[n - tail :], init[n - tail :])
                for o in outs
                for p in o["params"]
            ):
                return (
                    f"{what}: the last {tail} numbers of the flat vector never changed: chunks "
                    f"of N // {spec['ranks']} numbers leave them on no rank; use "
                    "ceil(N / world_size), the last chunk shorter (or empty)"
                )
            return None
    return None


# --- exercise 3 ---------------------------------------------------------------------------


def _stage_grads(spec: dict, want: dict, rank: int) -> list[torch.Tensor]:
    return [g for i in ex3.stage_layers(spec, rank) for g in want["grads"][i]]


def _pipeline_explain(inputs: dict, outputs: dict) -> str | None:
    for case, ranks in zip(inputs["cases"], outputs.get("cases", []), strict=False):
        for r, spec in enumerate(case["runs"]):
            members = [rank_out[r] for rank_out in ranks[: spec["stages"]]]
            if not ex3.run_problem(spec, members):
                continue
            m = spec["micro"]
            atol, rtol = ex3.TOL[spec["dtype"]]
            for s, step in enumerate(spec["steps"]):
                want = ex3.oracle(spec, step)
                got = [
                    o[s]["grads"] if isinstance(o, list) and len(o) > s else None for o in members
                ]
                if any(not isinstance(g, list) or None in g for g in got):
                    return None

                def same(scale: float, want=want, got=got, spec=spec, tol=(atol, rtol)) -> bool:
                    return all(
                        is_close(a, b * scale, *tol)
                        for rank in range(spec["stages"])
                        for a, b in zip(got[rank], _stage_grads(spec, want, rank), strict=True)
                    )

                if same(1.0):
                    continue
                what = f"{ex3.run_text(spec)}, step {s + 1}"
                if m > 1 and same(float(m)):
                    return (
                        f"{what}: your gradients are {m} times too large: the batch's loss is "
                        f"the mean over the micro-batches: divide each micro-batch's loss by "
                        f"{m} before its backward"
                    )
                for k in range(m):
                    one = {"xs": step["xs"][k : k + 1], "ys": step["ys"][k : k + 1]}
                    alone = ex3.oracle(spec, one)
                    for scale in (1.0, 1.0 / m):
                        if same(scale, alone):
                            return (
                                f"{what}: your gradients are those of only one micro-batch "
                                f"(number {k}): backward passes add into .grad, so do not "
                                "zero the gradients between micro-batches"
                            )
                return None
    return None


# --- exercise 4 ---------------------------------------------------------------------------


def _tp_explain(inputs: dict, outputs: dict) -> str | None:
    for case, ranks in zip(inputs["cases"], outputs.get("cases", []), strict=False):
        for s, spec in enumerate(case["subs"]):
            want = ex4.oracle(spec)
            members = [r[s] if len(r) > s else None for r in ranks[: spec["ranks"]]]
            bad = [
                (rank, got)
                for rank, got in enumerate(members)
                if ex4.rank_problem(spec, rank, got, want)
            ]
            if not bad:
                continue
            rank, got = bad[0]
            if not isinstance(got, dict):
                return None
            atol, rtol = ex4.TOL[spec["dtype"]]
            n = spec["ranks"]
            what = f"{ex4.case_text(spec)}, rank {rank}"
            last = spec["fc2" if spec["kind"] == "mlp" else "fc1"]
            if spec["kind"] in ("row", "mlp") and last["bias"] is not None:
                if is_close(got["y"], want["y"] + (n - 1) * last["bias"], atol, rtol):
                    return (
                        f"{what}: the output holds the bias {n} times: you added the bias on "
                        "every rank before the all-reduce; add it once, after"
                    )
            if spec["kind"] == "row":
                idx = ex4.owned(spec["x"].shape[-1], rank, n)
                x_r = spec["x"][..., idx]
                partial = x_r @ spec["fc1"]["weight"][:, idx].t()
                for b in (0, spec["fc1"]["bias"]):
                    if is_close(got["y"], partial + (0 if b is None else b), atol, rtol):
                        return (
                            f"{what}: each rank returned its partial sum x_r W_r^T: the row "
                            "layer's output is the sum over the ranks (all-reduce in forward)"
                        )
                xg = want["x_grad"][..., idx]
                if is_close(got["x_grad"], n * xg, atol, rtol):
                    return (
                        f"{what}: the input's gradient is {n} times too large: the backward "
                        "of the forward all-reduce is the identity (every rank already holds "
                        "the full output's gradient), so it must not all-reduce again"
                    )
            if spec["kind"] in ("column", "mlp"):
                idx = ex4.owned(spec["fc1"]["weight"].shape[0], rank, n)
                if spec["kind"] == "column":
                    gy = spec["grad_out"][..., idx]
                    local = gy @ spec["fc1"]["weight"][idx]
                    if is_close(got["x_grad"], local, atol, rtol):
                        return (
                            f"{what}: the input's gradient is only this rank's part "
                            "(from its output features): every rank's output depends on the "
                            "whole input, so all-reduce the input's gradient in the backward "
                            "pass (identity forward, all-reduce backward)"
                        )
            return None
    return None


HIDDEN = {
    "test_ex1_memory": Hidden(check=_memory_check, explain=_memory_explain),
    "test_ex2_zero": Hidden(explain=_zero_explain),
    "test_ex3_pipeline": Hidden(explain=_pipeline_explain),
    "test_ex4_tensor_parallel": Hidden(explain=_tp_explain),
    "test_ex5_activations": Hidden(check=activations_check, explain=activations_explain),
}
