"""Exercise 2: ``shard_model(model, mesh, adamw)`` in ``fsdp.py``: FSDP2 (``fully_shard``) on
the course's GPT, one unit per block, and its optimizer.

The student's function receives a ``ddp_lab.gpt.GPT`` (the same weights on every rank), a
1-D ``DeviceMesh`` of all the job's ranks and ``adamw``, a dict of ``torch.optim.AdamW``'s
keyword arguments (``lr``, ``eps``), and returns ``(model, optimizer)``. Required, on every
rank:

- every block is its own FSDP unit and the whole model is one too, for the embeddings, the
  final LayerNorm and the head (``isinstance(m, FSDPModule)``);
- one training step (forward and backward of this rank's share of the batch) calls, as
  ZeRO-3 does, ``2 L + 1`` all-gathers for ``L`` blocks (each block's parameters before
  its forward and again before its backward, the rest of the model's once) and ``L + 1``
  reduce-scatters (each unit's gradients), and no all-reduce (``CommDebugMode`` counts
  them);
- the rank holds its rows of every parameter, of every gradient and of AdamW's two moments
  (:mod:`ddp_lab.parallel.memory`, ``to_local()`` parts): exactly what FSDP2's chunks give;
- after ``k`` steps of ``torch.optim.AdamW(..., **adamw)``, the weights (gathered) equal
  those of one process trained on the whole batch, which is what DDP trains (float64 to
  1e-9, float32 to 1e-5). ``eps`` is 1e-4 in float32: AdamW divides a gradient by its
  own size, so a gradient that is zero in exact arithmetic (the key's bias: softmax ignores
  a constant added to every score of a row) but 1e-9 of rounding in float32 would move its
  weight by a sizeable part of ``lr`` either way.

The oracle is one process: the same GPT from the same seed, the global batch (every rank's
share, in rank order), ``torch.optim.AdamW``, ``k`` steps, built in the judge's process.
Case set (every draw): 3 ranks, float64, 2 blocks, a share of 1 sequence a rank, 3 steps;
2 ranks, float32, 1 or 3 blocks, 2 sequences a rank, 2 steps. Vocabularies are odd and
widths drawn, so rows never divide evenly. Each case is one torchrun job of its ranks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ddp_lab.checks import guards
from ddp_lab.checks.contract import Exercise
from ddp_lab.checks.lab09.common import (
    DTYPES,
    FSDP_FILE,
    WATCHDOG_S,
    collectives,
    gathered,
    judge_ranks,
    weights_problem,
)
from ddp_lab.checks.lab09.ex1_fsdp_bytes import rows
from ddp_lab.checks.values import kind, randint
from ddp_lab.gpt import GPT, GPTConfig
from ddp_lab.parallel.memory import model_bytes, optimizer_bytes

TOL = {"float32": (1e-5, 1e-5), "float64": (1e-9, 1e-9)}
#: Parts of the model outside the blocks (the root unit's parameters).
ROOT_PARTS = ("tok", "pos", "ln_f", "head")


def _case(gen, world: int, layers: int, share: int, steps: int, dtype: str) -> dict:
    heads = randint(gen, 1, 2)
    cfg = {
        "vocab": 2 * randint(gen, 4, 8) + 1,
        "seq_len": randint(gen, 4, 7),
        "width": heads * randint(gen, 2, 4),
        "heads": heads,
        "layers": layers,
    }
    tokens = torch.randint(
        0, cfg["vocab"], (steps, world * share, cfg["seq_len"] + 1), generator=gen
    )
    return {
        "world_size": world,
        "cfg": cfg,
        "dtype": dtype,
        "seed": randint(gen, 0, 2**31 - 1),
        "adamw": {"lr": 0.01 * randint(gen, 1, 5), "eps": 1e-4 if dtype == "float32" else 1e-8},
        "tokens": tokens,
    }


def make_inputs(gen: torch.Generator) -> dict:
    """The two cases of the module docstring."""
    return {
        "cases": [
            _case(gen, 3, 2, 1, 3, "float64"),
            _case(gen, 2, 2 * randint(gen, 0, 1) + 1, 2, 2, "float32"),
        ]
    }


def model(case: dict) -> GPT:
    """The case's GPT, unsharded (its weights from the case's seed)."""
    torch.manual_seed(case["seed"])
    return GPT(GPTConfig(**case["cfg"])).to(DTYPES[case["dtype"]])


def adamw(case: dict, params) -> torch.optim.Optimizer:
    """The case's ``torch.optim.AdamW`` over ``params`` (the judge's oracle's, and the
    optimizer the 2-D exercise's loop builds)."""
    return torch.optim.AdamW(list(params), **case["adamw"])


def loss_of(net, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of ``tokens`` (each row: inputs, then the last target)."""
    logits = net(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def run_rank(ns: dict, inputs: dict, case: dict, rank: int, world: int) -> dict:
    """The student's sharded GPT and optimizer on this rank: ``k`` steps on its share."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor.debug import CommDebugMode

    shard = guards.load_student_file(FSDP_FILE)["shard_model"]
    mesh = init_device_mesh("cpu", (world,))
    share = case["tokens"].shape[1] // world
    counts, grads = {}, {}

    def hung() -> str:
        return (
            f"the sharded GPT over {world} ranks did not finish within {WATCHDOG_S:g} s on rank "
            f"{rank}: every rank must shard the same modules in the same order"
        )

    with guards.call_watchdog(WATCHDOG_S, hung):
        whole = model(case)
        try:
            got = shard(whole, mesh, dict(case["adamw"]))
        except Exception as e:
            if isinstance(whole, FSDPModule) and not all(
                isinstance(b, FSDPModule) for b in whole.blocks
            ):  # PyTorch's own words say nothing of the order
                e.args = (
                    f"{e.args[0] if e.args else ''} (fully_shard was called on the whole model "
                    "before every block was a unit: it then takes the blocks' parameters "
                    "into the model's unit; shard the blocks first)",
                )
            raise
        if not isinstance(got, tuple) or len(got) != 2:
            raise TypeError(f"shard_model must return (model, optimizer), got {kind(got)}")
        net, optimizer = got
        for step, tokens in enumerate(case["tokens"]):
            mine = tokens[rank * share : (rank + 1) * share]
            with CommDebugMode() as mode:
                loss_of(net, mine).backward()
            if step == 0:
                counts = collectives(mode)
            grads = model_bytes(net)
            optimizer.step()
            optimizer.zero_grad()
        weights = gathered(net)
    return {
        "units": {
            "model": isinstance(net, FSDPModule),
            "blocks": [isinstance(b, FSDPModule) for b in net.blocks],
        },
        "collectives": counts,
        "bytes": {**grads, "optimizer": optimizer_bytes(optimizer)},
        "weights": weights,
    }


def trained(case: dict) -> GPT:
    """The case's GPT trained by one process on the whole batch, ``k`` steps of AdamW."""
    net = model(case)
    optimizer = adamw(case, net.parameters())
    for tokens in case["tokens"]:
        loss_of(net, tokens).backward()
        optimizer.step()
        optimizer.zero_grad()
    return net


def oracle(case: dict) -> dict:
    """One process on the whole batch: the weights after ``k`` steps, and this rank's
    expected bytes (FSDP2's rows of every parameter)."""
    net = trained(case)
    shapes = [tuple(p.shape) for p in net.parameters()]
    n, size = case["world_size"], DTYPES[case["dtype"]].itemsize
    per_rank = []
    for rank in range(n):
        mine = sum(rows(s[0], n)[rank] * (torch.Size(s[1:]).numel()) * size for s in shapes)
        per_rank.append({"params": mine, "grads": mine, "optimizer": 2 * mine})
    layers = case["cfg"]["layers"]
    return {
        "weights": {k: v.detach() for k, v in net.state_dict().items()},
        "bytes": per_rank,
        "collectives": {"all_gather": 2 * layers + 1, "reduce_scatter": layers + 1},
    }


def describe(case: dict) -> str:
    """``"a GPT of 2 blocks over 3 ranks (float64, 3 steps)"``."""
    layers = case["cfg"]["layers"]
    return (
        f"a GPT of {layers} block{'s' if layers > 1 else ''} over {case['world_size']} ranks "
        f"({case['dtype']}, {len(case['tokens'])} steps)"
    )


def _said(counts: dict) -> str:
    return ", ".join(f"{v} {k.replace('_', '-')}s" for k, v in sorted(counts.items())) or "none"


def rank_problem(case: dict, rank: int, got, want: dict) -> str | None:
    """What is wrong on one rank, or None."""
    what = f"shard_model, {describe(case)}, rank {rank}"
    if not isinstance(got, dict) or "units" not in got:
        return f"{what}: no result ({kind(got)})"
    units = got["units"]
    if not all(units["blocks"]):
        missing = [i for i, ok in enumerate(units["blocks"]) if not ok]
        return (
            f"{what}: every block should be its own FSDP unit (fully_shard on each); "
            f"block{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} "
            f"{'are' if len(missing) > 1 else 'is'} not"
        )
    if not units["model"]:
        return (
            f"{what}: the whole model should be an FSDP unit too, for the parameters outside "
            f"the blocks ({', '.join(ROOT_PARTS)}); it is not"
        )
    layers = case["cfg"]["layers"]
    if got["collectives"] != want["collectives"]:
        return (
            f"{what}: one training step should call {2 * layers + 1} all-gathers and "
            f"{layers + 1} reduce-scatters for {layers} block{'s' if layers > 1 else ''} "
            f"(ZeRO-3: each block gathered for its forward and again for its backward, the rest "
            f"of the model once; one reduce-scatter per unit); yours called "
            f"{_said(got['collectives'])}"
        )
    for part, expected in want["bytes"][rank].items():
        if got["bytes"].get(part) != expected:
            return (
                f"{what}: this rank should hold {expected:,} bytes of {part} (its rows of every "
                f"parameter, as FSDP2 cuts them), measured {got['bytes'].get(part)}"
            )
    return weights_problem(
        what, got["weights"], want["weights"], TOL[case["dtype"]], len(case["tokens"])
    )


def judge(inputs: dict, outputs: dict) -> str:
    """Every rank of every case: its units, collectives, bytes and trained weights."""
    judge_ranks(inputs, outputs, oracle, rank_problem)
    return (
        "shard_model makes every block and the model FSDP units over 3 and 2 ranks: ZeRO-3's "
        "collectives, each rank its rows of every parameter, gradient and moment, and the "
        "weights of one process on the whole batch"
    )


EXERCISE = Exercise(
    "test_ex2_fsdp",
    ("ex2_fsdp",),
    "FSDP2 on the GPT, one unit per block",
    make_inputs,
    judge,
    run_rank=run_rank,
    timeout=120,
    files=(FSDP_FILE,),
)
