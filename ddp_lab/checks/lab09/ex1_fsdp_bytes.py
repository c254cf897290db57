"""Exercise 1, ``fsdp_bytes(shapes, bytes_per_number, world_size)``: what each rank holds
of a model sharded with ``fully_shard`` (FSDP2) and trained with ``torch.optim.AdamW``.

The student returns, for every rank, the bytes of its part (``to_local()``) of the
parameters, of their gradients and of AdamW's moments (``exp_avg`` and ``exp_avg_sq``; the
0-d ``step`` counters left out). FSDP2 does not cut a flat vector as lab 7's ZeRO does: it
cuts *every parameter along dimension 0*, ``torch.chunk`` style, so rank ``r`` holds rows
``[r c, min((r + 1) c, d0))`` of a parameter of ``d0`` rows, ``c = ceil(d0 / n)``: the
last ranks may hold fewer rows, or none.

The judge's oracle measures real tensors: it cuts each parameter with FSDP2's own
``_chunk_with_empty`` (the function ``fully_shard`` calls, in
``torch/distributed/fsdp/_fully_shard/_fsdp_common.py``), gives each piece to a real AdamW
for one step, and measures ``numel * element_size`` (:mod:`ddp_lab.parallel.memory`).
``tests/test_facts.py`` checks the same numbers against ``fully_shard`` itself on 3 gloo
ranks.

Case set (every draw): the parameters of a small GPT (float32; an odd vocabulary, so the
embedding and the head have uneven rows), of a convolution and a linear layer (float64,
4-D and 2-D weights) and a weight of a single row with two biases of one number (bfloat16:
more ranks than rows, and three different answers if the cut is by numbers or flat); each
over 1, 2, 3 and 4 ranks.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from ddp_lab.checks.contract import Exercise
from ddp_lab.checks.lab07.common import check_cases
from ddp_lab.checks.lab07.ex1_memory import DTYPES, KEYS
from ddp_lab.checks.values import kind, number, plain, randint
from ddp_lab.gpt import GPT, GPTConfig
from ddp_lab.parallel.memory import nbytes, optimizer_bytes

WORLDS = (1, 2, 3, 4)


def rows(d0: int, world: int) -> list[int]:
    """Rows of a parameter of ``d0`` rows on each of ``world`` ranks, as FSDP2 cuts it."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import _chunk_with_empty

    return [len(c) for c in _chunk_with_empty(torch.empty(d0, device="meta"), world, dim=0)]


def _gpt_shapes(gen: torch.Generator) -> list[list[int]]:
    heads = randint(gen, 1, 3)
    cfg = GPTConfig(
        vocab=6 * randint(gen, 1, 2) + 1,  # 7 or 13: rows that divide by neither 2 nor 3
        seq_len=randint(gen, 5, 9),
        width=heads * randint(gen, 2, 4),
        heads=heads,
        layers=randint(gen, 1, 2),
    )
    return [list(p.shape) for p in GPT(cfg).parameters()]


def models(gen: torch.Generator) -> list[dict]:
    """The three models of every draw (see the module docstring)."""
    out_ch, k = 2 * randint(gen, 2, 4) + 1, randint(gen, 2, 3)
    conv = [[out_ch, randint(gen, 1, 3), k, k], [out_ch], [randint(gen, 2, 9), out_ch * 4]]
    return [
        {"name": "a GPT's parameters", "shapes": _gpt_shapes(gen), "bytes": 4},
        {"name": "a convolution and a linear layer", "shapes": conv, "bytes": 8},
        {  # one row each: rank 0 holds it all; cut by numbers or flat, three other answers
            "name": "a single row and two one-number biases",
            "shapes": [[1, randint(gen, 3, 5)], [1], [1]],
            "bytes": 2,
        },
    ]


def make_inputs(gen: torch.Generator) -> dict:
    """Every model over 1, 2, 3 and 4 ranks."""
    return {"cases": [{"model": m, "world": w} for m in models(gen) for w in WORLDS]}


def visible_inputs(gen: torch.Generator) -> dict:
    """The GPT over 2 and 3 ranks, the single row and its bias over 3."""
    gpt, _, tiny = models(gen)
    return {
        "cases": [
            {"model": gpt, "world": 2},
            {"model": gpt, "world": 3},
            {"model": tiny, "world": 3},
        ]
    }


def run(ns: dict, inputs: dict, workdir) -> dict:
    """The student's ``fsdp_bytes`` on every case."""
    fn = ns["fsdp_bytes"]
    return {
        "results": [
            plain(fn([tuple(s) for s in c["model"]["shapes"]], c["model"]["bytes"], c["world"]))
            for c in inputs["cases"]
        ]
    }


def _adamw_bytes(piece: torch.Tensor) -> int:
    """The state of a real AdamW over ``piece`` after one step (counters left out)."""
    p = nn.Parameter(piece.clone())
    opt = torch.optim.AdamW([p])
    p.grad = torch.ones_like(p)
    opt.step()
    return optimizer_bytes(opt)


@functools.lru_cache(maxsize=256)
def _measured(shapes: tuple, nbytes_each: int, world: int) -> tuple[dict, ...]:
    from torch.distributed.fsdp._fully_shard._fsdp_common import _chunk_with_empty

    out = [dict.fromkeys(KEYS, 0) for _ in range(world)]
    for shape in shapes:
        whole = torch.ones(*shape, dtype=DTYPES[nbytes_each])
        for rank, piece in enumerate(_chunk_with_empty(whole, world, dim=0)):
            piece = piece.reshape(-1, *shape[1:])  # an empty chunk keeps the row's shape
            out[rank]["params"] += nbytes(piece)
            out[rank]["grads"] += nbytes(torch.zeros_like(piece))
            out[rank]["optimizer"] += _adamw_bytes(piece)
    return tuple(out)


def oracle(case: dict) -> list[dict[str, int]]:
    """Every rank's measured bytes for one case (each model and world measured once)."""
    shapes = tuple(tuple(s) for s in case["model"]["shapes"])
    return [dict(r) for r in _measured(shapes, case["model"]["bytes"], case["world"])]


def describe(case: dict) -> str:
    """``"a GPT's parameters (17 tensors, float32) over 3 ranks"``."""
    m = case["model"]
    dtype = str(DTYPES[m["bytes"]]).removeprefix("torch.")
    n = len(m["shapes"])
    ranks = f"{case['world']} rank{'s' if case['world'] > 1 else ''}"
    return f"{m['name']} ({n} tensor{'s' if n > 1 else ''}, {dtype}) over {ranks}"


def case_problem(case: dict, got, want: list[dict]) -> str | None:
    """What is wrong with one case's result, or None."""
    what = f"fsdp_bytes for {describe(case)}"
    if not isinstance(got, list) or len(got) != case["world"]:
        n = len(got) if isinstance(got, list) else kind(got)
        return f"{what}: expected a list of {case['world']} dicts (one per rank), got {n}"
    for rank, (row, expected) in enumerate(zip(got, want, strict=True)):
        if not isinstance(row, dict) or set(KEYS) - set(row):
            return f"{what}: rank {rank}'s entry must be a dict with keys {', '.join(KEYS)}"
        for part in KEYS:
            if number(row[part]) != expected[part]:
                return (
                    f"{what}: rank {rank}'s {part!r} should be {expected[part]:,} bytes "
                    f"(measured on FSDP2's own shards), got {row[part]}"
                )
    return None


def judge(inputs: dict, outputs: dict) -> str:
    """Every rank of every case against the measured bytes."""
    check_cases(inputs, outputs, oracle, case_problem)
    worlds = sorted({c["world"] for c in inputs["cases"]})
    return (
        f"fsdp_bytes matches FSDP2's shards measured on every rank ({len(inputs['cases'])} "
        f"cases over {', '.join(map(str, worlds))} ranks: uneven rows, ranks that hold nothing)"
    )


EXERCISE = Exercise(
    "test_ex1_fsdp_bytes",
    ("ex1_fsdp_bytes",),
    "bytes per rank under FSDP2",
    make_inputs,
    judge,
    run=run,
    visible_inputs=visible_inputs,
)
