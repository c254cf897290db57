"""Exercise 4: ``ColumnParallelLinear`` and ``RowParallelLinear`` in ``tp.py``: one
``nn.Linear`` split over the ranks of a group.

- ``ColumnParallelLinear(linear, group)``: rank ``r`` keeps the output features
  ``torch.tensor_split(torch.arange(out_features), n)[r]`` (rows of the weight, entries of
  the bias); its forward takes the full input and returns those output features; the
  input's gradient is the full one on every rank (an all-reduce in the backward pass);
- ``RowParallelLinear(linear, group)``: rank ``r`` keeps the input features
  ``torch.tensor_split(torch.arange(in_features), n)[r]`` (columns of the weight) and the
  whole bias; its forward takes those input features and returns the full output on every
  rank (an all-reduce in the forward pass), the bias added once.

The checker composes the MLP block ``Column(fc1) -> GELU -> Row(fc2)`` from them. The
oracle is ``nn.Linear`` (and the unsplit MLP) with autograd on the full tensors: outputs,
the input's gradient, the weight and bias shards and their gradients must equal the
matching parts (float64 to 1e-10, float32 to 1e-5). The checker also counts the
collectives each forward and each backward pass calls: the column layer none forward and
one all-reduce backward, the row layer one all-reduce forward and none backward, the MLP
block one all-reduce each way.

Case set, in one torchrun job of 3 ranks: over all 3 ranks, a column layer (float32, output
features not divisible by 3), a row layer (float64, 3-D input of shape (batch, tokens,
features), input features not divisible by 3) and the MLP block (float64, 3-D input, hidden
width not divisible by 3); over a group of ranks 0 and 1: a column layer without bias
(float64), a row layer (float32), a row layer without bias (float32, 3-D input), the MLP
block (float32, odd hidden width). The bias-less cases fail a layer that assumes a bias
(``+ self.bias`` with ``self.bias`` None raises, and the rank's error says that the layer
has none); the biased ones fail a row layer that adds its bias on every rank.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.nn.functional as F

from ddp_lab.checks import guards
from ddp_lab.checks.contract import Exercise
from ddp_lab.checks.failure import CheckFailed, is_close
from ddp_lab.checks.lab07.common import (
    BUILT_INS,
    DTYPES,
    TP_FILE,
    WATCHDOG_S,
    counted_collectives,
    groups_for,
    randn,
    release,
)
from ddp_lab.checks.values import kind, randint

TOL = {"float32": (1e-5, 1e-5), "float64": (1e-10, 1e-10)}
#: The collectives each kind of case must call: (forward, backward).
EXPECTED_CALLS = {
    "column": ({}, {"all_reduce": 1}),
    "row": ({"all_reduce": 1}, {}),
    "mlp": ({"all_reduce": 1}, {"all_reduce": 1}),
}


def _not_divisible(gen: torch.Generator, ranks: int, low: int, high: int) -> int:
    while True:
        n = randint(gen, low, high)
        if n % ranks:
            return n


def _linear(gen, fan_in: int, fan_out: int, dt, bias: bool = True) -> dict:
    return {
        "weight": randn(gen, fan_out, fan_in, dtype=dt, scale=fan_in**-0.5),
        "bias": randn(gen, fan_out, dtype=dt, scale=0.5) if bias else None,
    }


def _case(gen, kind_: str, ranks: int, dtype: str, tokens: bool, bias: bool = True) -> dict:
    dt = DTYPES[dtype]
    lead = [randint(gen, 2, 4)] + ([randint(gen, 2, 3)] if tokens else [])
    if kind_ == "column":
        d, o = randint(gen, 3, 7), _not_divisible(gen, ranks, 4, 11)
        layers = {"fc1": _linear(gen, d, o, dt, bias)}
    elif kind_ == "row":
        d, o = _not_divisible(gen, ranks, 4, 11), randint(gen, 3, 7)
        layers = {"fc1": _linear(gen, d, o, dt, bias)}
    else:
        d, h = randint(gen, 3, 6), _not_divisible(gen, ranks, 5, 13)
        o = randint(gen, 3, 6)
        layers = {"fc1": _linear(gen, d, h, dt), "fc2": _linear(gen, h, o, dt)}
    return {
        "kind": kind_,
        "ranks": ranks,
        "dtype": dtype,
        **layers,
        "x": randn(gen, *lead, d, dtype=dt),
        "grad_out": randn(gen, *lead, o, dtype=dt),
    }


def make_inputs(gen: torch.Generator) -> dict:
    """One job of 3 ranks: column, row, MLP over all 3; then over ranks 0 and 1 (a column
    and a row layer without bias among them)."""
    cases = [
        _case(gen, "column", 3, "float32", tokens=False),
        _case(gen, "row", 3, "float64", tokens=True),
        _case(gen, "mlp", 3, "float64", tokens=True),
        _case(gen, "column", 2, "float64", tokens=True, bias=False),
        _case(gen, "row", 2, "float32", tokens=False),
        _case(gen, "row", 2, "float32", tokens=True, bias=False),
        _case(gen, "mlp", 2, "float32", tokens=False),
    ]
    return {"cases": [{"world_size": 3, "subs": cases}]}


def visible_inputs(gen: torch.Generator) -> dict:
    """One job of 3 ranks: a column layer and a row layer over all 3, the MLP over 2."""
    cases = [
        _case(gen, "column", 3, "float64", tokens=False),
        _case(gen, "row", 3, "float64", tokens=False),
        _case(gen, "mlp", 2, "float32", tokens=True),
    ]
    return {"cases": [{"world_size": 3, "subs": cases}]}


def owned(n: int, rank: int, ranks: int) -> torch.Tensor:
    """The features rank ``rank`` of ``ranks`` owns (the contract's ``tensor_split``)."""
    return torch.tensor_split(torch.arange(n), ranks)[rank]


def _linear_module(spec: dict) -> torch.nn.Linear:
    w, b = spec["weight"], spec["bias"]
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=b is not None).to(w.dtype)
    with torch.no_grad():
        lin.weight.copy_(w)
        if b is not None:
            lin.bias.copy_(b)
    return lin


def has_bias(spec: dict) -> bool:
    """Whether the case's layers have a bias (every case with bias=False is one layer)."""
    return spec["fc1"]["bias"] is not None


def _no_bias_hint(spec: dict, err: Exception) -> None:
    """Say in the error of a layer that assumed a bias where there is none that there is
    none (the rank's error is what the student reads): the traceback stays the student's."""
    if not has_bias(spec) and "NoneType" in str(err) and len(err.args) == 1:
        err.args = (
            f"{err} (in {case_text(spec)}: built from an nn.Linear without a bias, "
            "linear.bias is None; self.bias must be None too, and forward work without it)",
        )


def _params(layer) -> dict:
    out = {}
    for name in ("weight", "bias"):
        p = getattr(layer, name, "<missing>")
        if isinstance(p, torch.Tensor):
            out[name] = p.detach().clone()
            out[f"{name}_grad"] = None if p.grad is None else p.grad.clone()
        else:
            out[name] = p if p is None else "<missing>"
    return out


def _one(ns: dict, spec: dict, rank: int, group) -> dict:
    column, row = ns["ColumnParallelLinear"], ns["RowParallelLinear"]
    n = spec["ranks"]
    fwd, bwd = Counter(), Counter()
    if spec["kind"] == "row":
        x = spec["x"][..., owned(spec["x"].shape[-1], rank, n)].clone().requires_grad_(True)
    else:
        x = spec["x"].clone().requires_grad_(True)
    grad_out = spec["grad_out"]
    if spec["kind"] == "column":
        grad_out = grad_out[..., owned(grad_out.shape[-1], rank, n)]
    with counted_collectives(fwd):
        if spec["kind"] == "column":
            layers = {"fc1": column(_linear_module(spec["fc1"]), group=group)}
            y = layers["fc1"](x)
        elif spec["kind"] == "row":
            layers = {"fc1": row(_linear_module(spec["fc1"]), group=group)}
            y = layers["fc1"](x)
        else:
            layers = {
                "fc1": column(_linear_module(spec["fc1"]), group=group),
                "fc2": row(_linear_module(spec["fc2"]), group=group),
            }
            y = layers["fc2"](F.gelu(layers["fc1"](x)))
    with counted_collectives(bwd):
        y.backward(grad_out)
    return {
        "y": y.detach().clone(),
        "x_grad": None if x.grad is None else x.grad.clone(),
        "layers": {k: _params(v) for k, v in layers.items()},
        "forward_calls": dict(fwd),
        "backward_calls": dict(bwd),
    }


def run_rank(ns: dict, inputs: dict, case: dict, rank: int, world: int) -> list:
    """Each case on this rank (``None`` where the rank is outside the case's group)."""
    student = guards.load_student_file(TP_FILE)
    sizes = [spec["ranks"] for spec in case["subs"]]
    groups = groups_for(sizes, world)
    out = []
    for spec in case["subs"]:
        if rank >= spec["ranks"]:
            out.append(None)
            continue

        def hung(spec=spec) -> str:
            return (
                f"the {spec['kind']} case did not finish within {WATCHDOG_S:g} s on rank {rank} "
                f"of a group of {spec['ranks']}: pass group= to every collective (the ranks "
                "outside the group never join it), and let every rank of the group call it"
            )

        with guards.call_watchdog(WATCHDOG_S, hung):
            try:
                out.append(_one(student, spec, rank, groups.get(spec["ranks"])))
            except (TypeError, AttributeError) as err:
                _no_bias_hint(spec, err)
                raise
    release(sizes, rank, world)
    return out


def oracle(spec: dict) -> dict:
    """Autograd through the unsplit layer (or MLP) on the full tensors."""
    x = spec["x"].clone().requires_grad_(True)
    fc1 = _linear_module(spec["fc1"])
    if spec["kind"] == "mlp":
        fc2 = _linear_module(spec["fc2"])
        y = fc2(F.gelu(fc1(x)))
        layers = {"fc1": fc1, "fc2": fc2}
    else:
        y = fc1(x)
        layers = {"fc1": fc1}
    y.backward(spec["grad_out"])
    return {"y": y.detach(), "x_grad": x.grad, "layers": layers}


def case_text(spec: dict) -> str:
    """``"RowParallelLinear over 3 ranks (float64, input (2, 3, 7))"`` (``", no bias"`` at
    the end of the brackets for a layer without one)."""
    what = {"column": "ColumnParallelLinear", "row": "RowParallelLinear"}.get(
        spec["kind"], "the MLP block Column -> GELU -> Row"
    )
    bias = "" if has_bias(spec) else ", no bias"
    shape = tuple(spec["x"].shape)
    return f"{what} over {spec['ranks']} ranks ({spec['dtype']}, input {shape}{bias})"


def _parts(spec: dict, name: str, linear, rank: int) -> dict:
    """The parts of the unsplit ``linear`` that rank ``rank`` must hold (``name``: fc1, fc2)."""
    n = spec["ranks"]
    by_rows = spec["kind"] == "column" or (spec["kind"] == "mlp" and name == "fc1")
    w, wg = linear.weight.detach(), linear.weight.grad
    if by_rows:
        idx = owned(w.shape[0], rank, n)
        out = {"weight": w[idx], "weight_grad": wg[idx]}
        if linear.bias is not None:
            out |= {"bias": linear.bias.detach()[idx], "bias_grad": linear.bias.grad[idx]}
    else:
        idx = owned(w.shape[1], rank, n)
        out = {"weight": w[:, idx], "weight_grad": wg[:, idx]}
        if linear.bias is not None:
            out |= {"bias": linear.bias.detach(), "bias_grad": linear.bias.grad}
    return out


def rank_problem(spec: dict, rank: int, got, want: dict) -> str | None:
    """What is wrong on one rank of one case, or None."""
    atol, rtol = TOL[spec["dtype"]]
    at = f"{case_text(spec)}, rank {rank}"
    if not isinstance(got, dict):
        return f"{at}: returned {kind(got)}"
    n = spec["ranks"]
    y, xg = want["y"], want["x_grad"]
    if spec["kind"] == "column":
        y = y[..., owned(y.shape[-1], rank, n)]
    if spec["kind"] == "row":
        xg = xg[..., owned(xg.shape[-1], rank, n)]
    for name, linear in want["layers"].items():
        mine = got["layers"][name]
        for key, value in _parts(spec, name, linear, rank).items():
            if key.endswith("_grad"):
                continue
            if not is_close(mine.get(key), value, atol, rtol):
                return (
                    f"{at}: {name}'s {key} should hold this rank's part of the unsplit layer's "
                    f"(shape {tuple(value.shape)}), got {kind(mine.get(key))}"
                )
        if linear.bias is None and mine.get("bias") is not None:
            return f"{at}: the layer has no bias (bias=False), so neither may yours"
    if not is_close(got["y"], y, atol, rtol):
        return f"{at}: the forward output differs from the unsplit layer's (shape {tuple(y.shape)})"
    if not is_close(got["x_grad"], xg, atol, rtol):
        return (
            f"{at}: the gradient of the input differs from the unsplit layer's "
            f"(shape {tuple(xg.shape)}, got {kind(got['x_grad'])})"
        )
    for name, linear in want["layers"].items():
        mine = got["layers"][name]
        for key, value in _parts(spec, name, linear, rank).items():
            if key.endswith("_grad") and not is_close(mine.get(key), value, atol, rtol):
                part = key.removesuffix("_grad")
                return f"{at}: {name}'s {part} gradient differs from the unsplit layer's"
    return None


def calls_problem(spec: dict, rank: int, got: dict) -> str | None:
    """Collectives that should not be there (or are missing), or None."""
    for phase, expected in zip(("forward", "backward"), EXPECTED_CALLS[spec["kind"]], strict=True):
        calls = {k: v for k, v in got[f"{phase}_calls"].items() if v}
        if calls != expected:
            said = ", ".join(f"{v} {k}" for k, v in calls.items()) or "no collective"
            want = ", ".join(f"{v} {k}" for k, v in expected.items()) or "no collective"
            return (
                f"{case_text(spec)}, rank {rank}: the {phase} pass called {said}; it needs "
                f"{want} (the column layer all-reduces the input's gradient in backward, the "
                "row layer its partial outputs in forward, and nothing else communicates)"
            )
    return None


def judge(inputs: dict, outputs: dict) -> str:
    """Every rank of every case against the unsplit layers, then the collectives' counts."""
    for case, ranks in zip(inputs["cases"], outputs["cases"], strict=True):
        for s, spec in enumerate(case["subs"]):
            want = oracle(spec)
            members = [r[s] if len(r) > s else None for r in ranks[: spec["ranks"]]]
            for rank, got in enumerate(members):
                if why := rank_problem(spec, rank, got, want):
                    raise CheckFailed(why)
            for rank, got in enumerate(members):
                if why := calls_problem(spec, rank, got):
                    raise CheckFailed(why)
    subs = [spec for case in inputs["cases"] for spec in case["subs"]]
    bias = ", with and without bias" if not all(map(has_bias, subs)) else ""
    return (
        "ColumnParallelLinear and RowParallelLinear equal nn.Linear forward and backward over "
        f"2 and 3 ranks (uneven splits, 2-D and 3-D inputs, float32 and float64{bias}), and "
        "the MLP block Column -> GELU -> Row communicates one all-reduce each way"
    )


EXERCISE = Exercise(
    "test_ex4_tensor_parallel",
    ("ex4_tensor_parallel",),
    "column- and row-parallel linear layers equal to nn.Linear",
    make_inputs,
    judge,
    run_rank=run_rank,
    forbid_modules=BUILT_INS,
    timeout=120,
    visible_inputs=visible_inputs,
    files=(TP_FILE,),
)
