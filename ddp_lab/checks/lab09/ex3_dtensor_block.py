"""Exercise 3: ``parallelize_block(block, mesh)`` in ``tp_plan.py``: one block of the course's
GPT split over the ranks of a 1-D device mesh with DTensor, Megatron's way, at Megatron's
cost.

The student's function receives a ``ddp_lab.gpt.Block`` and a ``DeviceMesh`` of all the
job's ranks, and returns the block split in place (``parallelize_module`` and its styles are
the tools). Required, on every rank:

- every linear weight of the block (``attn.q``, ``attn.k``, ``attn.v``, ``attn.proj``,
  ``mlp.fc``, ``mlp.proj``) is a ``DTensor`` of which this rank holds ``1/n``: the block is
  really split (a block left whole computes the right numbers without communicating);
- the output, the input's gradient and every parameter's gradient (gathered) equal the
  unsplit block's (float64 to 1e-10, float32 to 1e-5), the output whole on every rank;
- one forward pass calls exactly 2 all-reduces and one backward pass exactly 2, and no other
  collective (``CommDebugMode`` counts them): Megatron's count for a block; the plain plan
  (each of q, k and v reducing its input's gradient on its own) calls 4 in the backward.

The oracle is autograd through the unsplit block, built from the same seed in the judge's
process. Case set (every draw): 3 ranks, float64, 6 heads (2 a rank), a batch of 1; 2 ranks,
float32, 4 or 6 heads, a batch of 2-3; head widths, sequence lengths and values drawn.
Each case is one torchrun job of its number of ranks.
"""

from __future__ import annotations

import torch

from ddp_lab.checks import guards
from ddp_lab.checks.contract import Exercise
from ddp_lab.checks.failure import is_close
from ddp_lab.checks.lab09.common import (
    DTYPES,
    PLAN_FILE,
    WATCHDOG_S,
    collectives,
    judge_ranks,
    randn,
    whole,
)
from ddp_lab.checks.values import kind, randint
from ddp_lab.gpt import Block, GPTConfig

TOL = {"float32": (1e-5, 1e-5), "float64": (1e-10, 1e-10)}
LINEARS = ("attn.q", "attn.k", "attn.v", "attn.proj", "mlp.fc", "mlp.proj")
#: All-reduces a forward and a backward pass of one block must call (Megatron's count).
CALLS = {"forward": 2, "backward": 2}


def _case(gen, world: int, heads: int, batch: int, dtype: str) -> dict:
    head_dim, seq = randint(gen, 2, 4), randint(gen, 3, 8)
    width = heads * head_dim
    return {
        "world_size": world,
        "heads": heads,
        "width": width,
        "seq": seq,
        "dtype": dtype,
        "seed": randint(gen, 0, 2**31 - 1),
        "x": randn(gen, batch, seq, width, dtype=DTYPES[dtype]),
        "grad_out": randn(gen, batch, seq, width, dtype=DTYPES[dtype]),
    }


def make_inputs(gen: torch.Generator) -> dict:
    """The two cases of the module docstring."""
    return {
        "cases": [
            _case(gen, 3, 6, 1, "float64"),
            _case(gen, 2, 2 * randint(gen, 2, 3), randint(gen, 2, 3), "float32"),
        ]
    }


def block(case: dict) -> Block:
    """The case's unsplit block (its weights from the case's seed)."""
    torch.manual_seed(case["seed"])
    cfg = GPTConfig(seq_len=case["seq"], width=case["width"], heads=case["heads"], layers=1)
    return Block(cfg).to(DTYPES[case["dtype"]])


def run_rank(ns: dict, inputs: dict, case: dict, rank: int, world: int) -> dict:
    """The student's split of the case's block on this rank: one forward, one backward."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode

    parallelize = guards.load_student_file(PLAN_FILE)["parallelize_block"]
    mesh = init_device_mesh("cpu", (world,))

    def hung() -> str:
        return (
            f"the block over {world} ranks did not finish within {WATCHDOG_S:g} s on rank "
            f"{rank}: every rank must split its block the same way"
        )

    with guards.call_watchdog(WATCHDOG_S, hung):
        model = parallelize(block(case), mesh)
        if model is None:
            raise TypeError("parallelize_block returned None: return the block")
        x = case["x"].clone().requires_grad_(True)
        with CommDebugMode() as forward:
            y = model(x)
        if hasattr(y, "to_local"):
            raise TypeError(
                "the split block returned a DTensor: it must return a plain tensor, the whole "
                "output on every rank, as the unsplit block does"
            )
        with CommDebugMode() as backward:
            y.backward(case["grad_out"])
    weights = {}
    for name in LINEARS:
        w = model.get_submodule(name).weight
        local = w.to_local() if hasattr(w, "to_local") else w
        weights[name] = {"dtensor": hasattr(w, "to_local"), "local_numel": local.numel()}
    return {
        "y": y.detach().clone(),
        "x_grad": None if x.grad is None else x.grad.clone(),
        "grads": {
            n: None if p.grad is None else whole(p.grad).detach().clone()
            for n, p in model.named_parameters()
        },
        "weights": weights,
        "forward": collectives(forward),
        "backward": collectives(backward),
    }


def oracle(case: dict) -> dict:
    """Autograd through the unsplit block."""
    unsplit = block(case)
    x = case["x"].clone().requires_grad_(True)
    y = unsplit(x)
    y.backward(case["grad_out"])
    grads = {n: p.grad for n, p in unsplit.named_parameters()}
    sizes = {n: unsplit.get_submodule(n).weight.numel() for n in LINEARS}
    return {"y": y.detach(), "x_grad": x.grad, "grads": grads, "sizes": sizes}


def describe(case: dict) -> str:
    """``"a block of width 24, 6 heads, over 3 ranks (float64)"``."""
    return (
        f"a block of width {case['width']}, {case['heads']} heads, over {case['world_size']} "
        f"ranks ({case['dtype']})"
    )


def rank_problem(case: dict, rank: int, got, want: dict) -> str | None:
    """What is wrong on one rank, or None."""
    what = f"parallelize_block, {describe(case)}, rank {rank}"
    if not isinstance(got, dict) or "weights" not in got:
        return f"{what}: no result ({kind(got)})"
    n = case["world_size"]
    for name in LINEARS:
        w = got["weights"][name]
        if not w["dtensor"] or w["local_numel"] * n != want["sizes"][name]:
            return (
                f"{what}: {name}.weight should be a DTensor of which each rank holds 1/{n} "
                f"({want['sizes'][name] // n} of {want['sizes'][name]} numbers); this rank "
                f"holds {w['local_numel']}" + ("" if w["dtensor"] else " (not a DTensor)")
            )
    atol, rtol = TOL[case["dtype"]]
    checks = [
        ("the output", got["y"], want["y"]),
        ("the input's gradient", got["x_grad"], want["x_grad"]),
    ]
    checks += [(f"{n}'s gradient", got["grads"].get(n), g) for n, g in want["grads"].items()]
    for label, value, expected in checks:
        if not isinstance(value, torch.Tensor) or value.shape != expected.shape:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else kind(value)
            return f"{what}: {label} should have shape {tuple(expected.shape)}, got {shape}"
        if not is_close(value, expected, atol, rtol):
            diff = (value.double() - expected.double()).abs().max().item()
            return (
                f"{what}: {label} differs from the unsplit block's (largest difference {diff:.2e})"
            )
    for phase, count in CALLS.items():
        if got[phase] != {"all_reduce": count}:
            said = ", ".join(f"{v} {k}" for k, v in sorted(got[phase].items())) or "none"
            return (
                f"{what}: one {phase} pass should call exactly {count} all-reduces, as "
                f"Megatron's block does; yours called {said}"
            )
    return None


def judge(inputs: dict, outputs: dict) -> str:
    """Every rank of every case against the unsplit block, its shards and its all-reduces."""
    judge_ranks(inputs, outputs, oracle, rank_problem)
    return (
        "parallelize_block splits every linear layer of the block over 3 and 2 ranks, equals "
        "the unsplit block forward and backward, with 2 all-reduces each way"
    )


EXERCISE = Exercise(
    "test_ex3_dtensor_block",
    ("ex3_dtensor_block",),
    "a transformer block split with DTensor at Megatron's cost",
    make_inputs,
    judge,
    run_rank=run_rank,
    timeout=120,
    files=(PLAN_FILE,),
)
