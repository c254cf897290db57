"""Exercise 4: ``parallelize_2d(model, tp, plan_block)`` in ``mesh2d.py``: the course's GPT on
a 2-D (data x tensor) device mesh, tensor groups of neighbouring ranks.

The student's function receives a ``ddp_lab.gpt.GPT`` (the same weights on every rank), the
tensor-parallel degree ``tp`` (it divides the job's number of ranks) and ``plan_block``, a
function that splits one block over a 1-D mesh (the grader hands it
:func:`ddp_lab.parallel.plans.plain_block_plan`, so that this exercise does not depend on
exercise 3). It returns ``(mesh, model)``. Required, on every rank:

- ``mesh`` is 2-D with dimensions named ``"dp"`` and ``"tp"`` (else the run stops with that
  message); this rank's tensor group is ``tp`` neighbouring ranks (``r - r % tp`` to
  ``r - r % tp + tp - 1``: Megatron's order, one node's GPUs on a cluster) and its data
  group the ranks ``r % tp``, ``r % tp + tp``, ... (the same tensor slice in every replica);
- every block is split over the tensor group and then sharded over the data group: each
  rank holds its data group's share of its tensor rank's rows of a block's query weight;
  the parameters outside the blocks are sharded over the data group (FSDP2);
- with the grader's training loop (each data replica, ``mesh["dp"].get_local_rank()``,
  takes its share of the global batch; ``torch.optim.AdamW`` built after the function
  returns), the weights after ``k`` steps equal those of one process trained on the whole
  batch (float64 to 1e-9, float32 to 1e-5).

Case set (every draw): 4 ranks as 2 x 2, float64, 2 blocks, 2 or 4 heads; 3 ranks, float32,
1 block, 3 heads, with ``tp`` 3 (one replica) or 1 (no tensor parallelism): a mesh of one
row or one column. Each case is one torchrun job of its ranks; 2 steps each.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ddp_lab.checks import guards
from ddp_lab.checks.contract import Exercise
from ddp_lab.checks.lab09.common import (
    MESH_FILE,
    WATCHDOG_S,
    gathered,
    judge_ranks,
    weights_problem,
)
from ddp_lab.checks.lab09.ex1_fsdp_bytes import rows
from ddp_lab.checks.lab09.ex2_fsdp import adamw, loss_of, model, trained
from ddp_lab.checks.values import kind, randint
from ddp_lab.parallel.plans import plain_block_plan

TOL = {"float32": (1e-5, 1e-5), "float64": (1e-9, 1e-9)}
STEPS = 2


def _case(gen, world: int, tp: int, layers: int, heads: int, dtype: str) -> dict:
    cfg = {
        "vocab": 2 * randint(gen, 4, 8) + 1,
        "seq_len": randint(gen, 4, 6),
        "width": heads * randint(gen, 2, 3),
        "heads": heads,
        "layers": layers,
    }
    replicas = world // tp
    shape = (STEPS, replicas * randint(gen, 1, 2), cfg["seq_len"] + 1)
    return {
        "world_size": world,
        "tp": tp,
        "cfg": cfg,
        "dtype": dtype,
        "seed": randint(gen, 0, 2**31 - 1),
        "adamw": {"lr": 0.01 * randint(gen, 1, 5), "eps": 1e-4 if dtype == "float32" else 1e-8},
        "tokens": torch.randint(0, cfg["vocab"], shape, generator=gen),
    }


def make_inputs(gen: torch.Generator) -> dict:
    """The two cases of the module docstring."""
    return {
        "cases": [
            _case(gen, 4, 2, 2, 2 * randint(gen, 1, 2), "float64"),
            _case(gen, 3, 3 if randint(gen, 0, 1) else 1, 1, 3, "float32"),
        ]
    }


def _local_numel(t) -> int:
    return (t.to_local() if hasattr(t, "to_local") else t).numel()


def run_rank(ns: dict, inputs: dict, case: dict, rank: int, world: int) -> dict:
    """The student's 2-D GPT on this rank: its mesh, its shards, ``k`` steps."""
    fn = guards.load_student_file(MESH_FILE)["parallelize_2d"]

    def hung() -> str:
        return (
            f"the GPT on a 2-D mesh of {world} ranks did not finish within {WATCHDOG_S:g} s on "
            f"rank {rank}: every rank must build the same mesh and split the same modules"
        )

    with guards.call_watchdog(WATCHDOG_S, hung):
        got = fn(model(case), case["tp"], plain_block_plan)
        if not isinstance(got, tuple) or len(got) != 2:
            raise TypeError(f"parallelize_2d must return (mesh, model), got {kind(got)}")
        mesh, net = got
        names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
        if sorted(names) != ["dp", "tp"]:
            raise ValueError(f"the mesh's dimensions must be named 'dp' and 'tp', not {names}")
        groups = {k: dist.get_process_group_ranks(mesh[k].get_group()) for k in names}
        dp = mesh["dp"]
        replica, replicas = dp.get_local_rank(), dp.size()
        optimizer = adamw(case, net.parameters())
        steps = case["tokens"] if replicas * case["tp"] == world else []  # else: no batch split
        for tokens in steps:  # (the judge says what is wrong with the mesh)
            share = len(tokens) // replicas
            loss_of(net, tokens[replica * share : (replica + 1) * share]).backward()
            optimizer.step()
            optimizer.zero_grad()
        weights = gathered(net)
    return {
        "shape": list(mesh.mesh.shape),
        "names": list(names),
        "groups": groups,
        "replica": replica,
        "local": {
            "blocks.0.attn.q.weight": _local_numel(net.blocks[0].attn.q.weight),
            "tok.weight": _local_numel(net.tok.weight),
        },
        "weights": weights,
    }


def layout(world: int, tp: int, rank: int) -> dict:
    """Megatron's groups of ``rank`` (tensor fastest): ``{"tp": [...], "dp": [...]}``."""
    first = rank - rank % tp
    return {"tp": list(range(first, first + tp)), "dp": list(range(rank % tp, world, tp))}


def oracle(case: dict) -> dict:
    """One process on the whole batch: the weights after ``k`` steps; every rank's groups and
    expected shards."""
    net = trained(case)
    n, tp, width, vocab = (
        case["world_size"],
        case["tp"],
        case["cfg"]["width"],
        case["cfg"]["vocab"],
    )
    replicas = n // tp
    ranks = []
    for rank in range(n):
        d = rank // tp
        ranks.append(
            {
                **layout(n, tp, rank),
                "local": {
                    "blocks.0.attn.q.weight": rows(width // tp, replicas)[d] * width,
                    "tok.weight": rows(vocab, replicas)[d] * width,
                },
            }
        )
    return {"weights": {k: v.detach() for k, v in net.state_dict().items()}, "ranks": ranks}


def describe(case: dict) -> str:
    """``"a GPT of 2 blocks on 4 ranks, tp = 2 (float64)"``."""
    layers = case["cfg"]["layers"]
    return (
        f"a GPT of {layers} block{'s' if layers > 1 else ''} on {case['world_size']} ranks, "
        f"tp = {case['tp']} ({case['dtype']})"
    )


def rank_problem(case: dict, rank: int, got, want: dict) -> str | None:
    """What is wrong on one rank, or None."""
    what = f"parallelize_2d, {describe(case)}, rank {rank}"
    if not isinstance(got, dict) or "groups" not in got:
        return f"{what}: no result ({kind(got)})"
    tp = case["tp"]
    mine = want["ranks"][rank]
    for dim, label in (("tp", "tensor"), ("dp", "data")):
        if got["groups"][dim] != mine[dim]:
            return (
                f"{what}: this rank's {label} group should be {mine[dim]} (tensor groups of "
                f"{tp} neighbouring ranks, Megatron's order); the mesh gives {got['groups'][dim]}"
            )
    for name, expected in mine["local"].items():
        if got["local"][name] != expected:
            how = (
                "split over the tensor group, then sharded over the data group"
                if name.startswith("blocks")
                else "sharded over the data group (FSDP2 on the whole model)"
            )
            return (
                f"{what}: this rank should hold {expected} numbers of {name} ({how}); it holds "
                f"{got['local'][name]}"
            )
    return weights_problem(what, got["weights"], want["weights"], TOL[case["dtype"]], STEPS)


def judge(inputs: dict, outputs: dict) -> str:
    """Every rank of every case: its mesh, groups, shards and trained weights."""
    judge_ranks(inputs, outputs, oracle, rank_problem)
    return (
        "parallelize_2d lays the ranks out as Megatron does (tensor groups of neighbours), "
        "splits every block over its tensor group and shards over its data group, and trains "
        "what one process trains on the whole batch"
    )


EXERCISE = Exercise(
    "test_ex4_mesh",
    ("ex4_mesh",),
    "the GPT on a data x tensor mesh",
    make_inputs,
    judge,
    run_rank=run_rank,
    timeout=150,
    files=(MESH_FILE,),
)
