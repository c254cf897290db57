"""Exercise 1, ``memory_per_rank(numels, bytes_per_number, world_size, stage)``: what each
rank holds under DDP (stage 0) and ZeRO stages 1, 2 and 3.

The student returns, for every rank, the bytes of its parameters, gradients and AdamW
moments (``exp_avg`` and ``exp_avg_sq``). ZeRO cuts the flat vector of all ``N`` parameter
numbers into chunks of ``ceil(N / world_size)``: rank ``r`` owns
``[r * c, min((r + 1) * c, N))``, so the last ranks may own fewer numbers, or none. Stage 1
shards the optimizer state, stage 2 the gradients too, stage 3 the parameters too.

The judge's oracle measures real tensors: it builds the model's parameters in the case's
dtype, takes one ``torch.optim.AdamW`` step, and measures ``numel * element_size`` of the
parameters, the gradients and the optimizer's state (:mod:`ddp_lab.parallel.memory`); for
a sharded part it cuts the flat parameter vector into the chunks above and measures a rank's
chunk (and the state of an AdamW that owns only that chunk).

Case set (every draw): a model whose ``N`` is divisible by neither 2 nor 3 (float32), one
whose ``N`` is divisible by 6 (float64), and a single tiny parameter of 1 or 2 numbers
(bfloat16: more ranks than numbers, so some ranks own nothing); each over 1, 2, 3 and 8
ranks, at stages 0, 1, 2 and 3.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import nn

from ddp_lab.checks.contract import Exercise
from ddp_lab.checks.lab07.common import check_cases
from ddp_lab.checks.values import kind, number, plain, randint
from ddp_lab.parallel.memory import nbytes, optimizer_bytes

KEYS = ("params", "grads", "optimizer")
#: From which stage on each part is sharded.
SHARDED_FROM = {"optimizer": 1, "grads": 2, "params": 3}
WORLDS = (1, 2, 3, 8)
STAGES = (0, 1, 2, 3)
DTYPES = {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}


def _mlp_shapes(gen: torch.Generator, remainder_ok) -> list[list[int]]:
    """Shapes of a two-layer MLP (weights and biases) whose total passes ``remainder_ok``."""
    while True:
        d, h, c = randint(gen, 5, 20), randint(gen, 16, 40), randint(gen, 3, 10)
        shapes = [[h, d], [h], [c, h], [c]]
        if remainder_ok(sum(math.prod(s) for s in shapes) % 6):
            return shapes


def _model(name: str, shapes: list[list[int]], nbytes_each: int) -> dict:
    return {"name": name, "shapes": shapes, "bytes": nbytes_each}


def models(gen: torch.Generator) -> list[dict]:
    """The three models of every draw (see the module docstring)."""
    return [
        _model("an MLP", _mlp_shapes(gen, lambda r: r in (1, 5)), 4),
        _model("an MLP", _mlp_shapes(gen, lambda r: r == 0), 8),
        _model("a tiny parameter", [[randint(gen, 1, 2)]], 2),
    ]


def make_inputs(gen: torch.Generator) -> dict:
    """Every model over 1, 2, 3 and 8 ranks at every stage."""
    cases = [
        {"model": m, "world": w, "stage": s} for m in models(gen) for w in WORLDS for s in STAGES
    ]
    return {"cases": cases}


def visible_inputs(gen: torch.Generator) -> dict:
    """The uneven MLP over 2 and 3 ranks at every stage, the tiny parameter over 3 ranks."""
    uneven, _, tiny = models(gen)
    cases = [{"model": uneven, "world": w, "stage": s} for w in (2, 3) for s in STAGES]
    cases += [{"model": tiny, "world": 3, "stage": s} for s in STAGES]
    return {"cases": cases}


def numels(model: dict) -> list[int]:
    """The number of values of each parameter tensor."""
    return [math.prod(s) for s in model["shapes"]]


def run(ns: dict, inputs: dict, workdir) -> dict:
    """The student's ``memory_per_rank`` on every case."""
    fn = ns["memory_per_rank"]
    return {
        "results": [
            plain(fn(numels(c["model"]), c["model"]["bytes"], c["world"], c["stage"]))
            for c in inputs["cases"]
        ]
    }


def _adamw_bytes(values: torch.Tensor) -> int:
    """The state of a real AdamW that owns ``values`` (one step taken, counters left out)."""
    if values.numel() == 0:
        return 0
    p = nn.Parameter(values.clone())
    opt = torch.optim.AdamW([p])
    p.grad = torch.ones_like(p)
    opt.step()
    return optimizer_bytes(opt)


@functools.lru_cache(maxsize=256)
def _measured(shapes: tuple, nbytes_each: int, world: int) -> tuple[dict, tuple[dict, ...]]:
    dtype = DTYPES[nbytes_each]
    params = [nn.Parameter(torch.ones(*s, dtype=dtype)) for s in shapes]
    optimizer = torch.optim.AdamW(params)
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()
    whole = {
        "params": sum(nbytes(p) for p in params),
        "grads": sum(nbytes(p.grad) for p in params),
        "optimizer": optimizer_bytes(optimizer),
    }
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    pieces = list(flat.split(-(-flat.numel() // world)))
    pieces += [flat[:0]] * (world - len(pieces))  # ranks past the end own nothing
    chunks = tuple(
        {"params": nbytes(c), "grads": nbytes(torch.zeros_like(c)), "optimizer": _adamw_bytes(c)}
        for c in pieces
    )
    return whole, chunks


def measured(model: dict, world: int) -> dict:
    """The oracle's measurements: the whole model's ``params`` / ``grads`` / ``optimizer``
    bytes, and every rank's chunk of the flat vector (``chunks``: the same three keys).
    (The same model and world size are measured once per process.)"""
    shapes = tuple(tuple(s) for s in model["shapes"])
    whole, chunks = _measured(shapes, model["bytes"], world)
    return {"whole": dict(whole), "chunks": [dict(c) for c in chunks]}


def oracle(case: dict) -> list[dict[str, int]]:
    """Every rank's measured bytes for one case."""
    got = measured(case["model"], case["world"])
    return [
        {
            part: (chunk if case["stage"] >= SHARDED_FROM[part] else got["whole"])[part]
            for part in KEYS
        }
        for chunk in got["chunks"]
    ]


def describe(case: dict) -> str:
    """``"an MLP of N = 1,234 float32 numbers (4 tensors) over 3 ranks, stage 2"``."""
    m = case["model"]
    n = sum(numels(m))
    dtype = str(DTYPES[m["bytes"]]).removeprefix("torch.")
    return (
        f"{m['name']} of N = {n:,} {dtype} numbers ({len(m['shapes'])} tensors) over "
        f"{case['world']} rank{'s' if case['world'] > 1 else ''}, stage {case['stage']}"
    )


def case_problem(case: dict, got, want: list[dict]) -> str | None:
    """What is wrong with one case's result, or None."""
    what = f"memory_per_rank for {describe(case)}"
    if not isinstance(got, list) or len(got) != case["world"]:
        n = len(got) if isinstance(got, list) else kind(got)
        return f"{what}: expected a list of {case['world']} dicts (one per rank), got {n}"
    for rank, (row, expected) in enumerate(zip(got, want, strict=True)):
        if not isinstance(row, dict) or set(KEYS) - set(row):
            return f"{what}: rank {rank}'s entry must be a dict with keys {', '.join(KEYS)}"
        for part in KEYS:
            value = number(row[part])
            if value != expected[part]:
                return (
                    f"{what}: rank {rank}'s {part!r} should be {expected[part]:,} bytes "
                    f"(measured on real tensors), got {row[part]}"
                )
    return None


def judge(inputs: dict, outputs: dict) -> str:
    """Every rank of every case against the measured bytes."""
    check_cases(inputs, outputs, oracle, case_problem)
    worlds = sorted({c["world"] for c in inputs["cases"]})
    return (
        f"memory_per_rank matches real tensors measured on every rank ({len(inputs['cases'])} "
        f"cases: stages 0-3 over {', '.join(map(str, worlds))} ranks, uneven chunks, ranks "
        "that own nothing)"
    )


EXERCISE = Exercise(
    "test_ex1_memory",
    ("ex1_memory",),
    "bytes per rank under DDP and ZeRO stages 1-3",
    make_inputs,
    judge,
    run=run,
    visible_inputs=visible_inputs,
)
