"""Exercise 5: ``global_grad_norm`` in ``grad_norm.py``, the norm of gradients sharded over ranks.

Every rank of a process group holds a disjoint part of the gradients (a sharded model or
optimizer, as in lab 7): a list of tensors, of different counts and sizes on different ranks,
possibly empty, possibly holding a tensor with no element. The student's function returns,
on every rank of the group, the norm of all the group's gradients together.

The oracle is ``torch.linalg.vector_norm`` of the concatenation of every rank's gradients
(float64), for ``norm_type`` 2 and ``inf``; every rank must return the same value. Case set,
in one torchrun job of 3 ranks (each job costs seconds): three calls over all 3 ranks
(``group=None``), then three over a group of ranks 0 and 1 (``group`` given; rank 2 waits
for them without any collective, so a solution that ignores ``group`` deadlocks and the
watchdog says why). Inside: float32 and float64 gradients, uneven shards, a rank with an
empty list (3 ranks) or an empty tensor (2 ranks), the L2 norm and the inf-norm, whose
largest magnitude is a negative entry, and float32 gradients so small (below ``2**-71``)
that their squares underflow in float32: a norm accumulated in float32 is far off there,
one accumulated in float64 is right. Every rank must return a 0-d float64 tensor.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ddp_lab.checks import guards
from ddp_lab.checks.contract import Exercise
from ddp_lab.checks.failure import CheckFailed
from ddp_lab.checks.lab05.common import NORM_FILE
from ddp_lab.checks.values import kind, number, plain, randint, uniform

#: Seconds one call may take before the rank ends with a one-line diagnosis (a deadlock).
WATCHDOG_S = 30.0
#: Relative tolerance by the gradients' dtype (the result is accumulated in float64).
RTOL = {torch.float32: 1e-6, torch.float64: 1e-12}
NORMS = {"2": 2.0, "inf": math.inf}
#: The exponents of the tiny gradients' magnitudes (``2**-TINY``, times ``2**-3 .. 2**3``
#: per rank and a normal draw): squares of at most about ``2**-142``, subnormal in float32.
TINY = (76, 80)


def _shard(gen: torch.Generator, count: int, dtype: torch.dtype, scale: float) -> list:
    return [
        (scale * torch.randn(randint(gen, 1, 4), randint(gen, 1, 5), generator=gen)).to(dtype)
        for _ in range(count)
    ]


def _sub(
    gen: torch.Generator, world: int, dtype, norm: str, empty: str | None, tiny: bool = False
) -> dict:
    """One call on every rank: rank r holds 1 to 3 tensors at its own magnitude; with
    ``empty="list"`` one rank holds none, with ``"tensor"`` one rank's list also holds a
    tensor with no element. For the inf-norm the largest magnitude is a negative entry.
    With ``tiny``, every magnitude is below ``2**-71`` (:data:`TINY`): squared in float32
    the entries round to 0 or to a few bits of a subnormal, so a float32 sum of squares is
    far off while float64 holds every square exactly."""
    base = 2.0 ** -randint(gen, *TINY) if tiny else 1.0
    shards = [
        _shard(gen, randint(gen, 1, 3), dtype, base * 2.0 ** randint(gen, -3, 3))
        for _ in range(world)
    ]
    if empty == "list":
        shards[randint(gen, 0, world - 1)] = []
    elif empty == "tensor":
        shards[randint(gen, 0, world - 1)].append(torch.zeros(0, 3, dtype=dtype))
    if norm == "inf":
        full = [r for r, s in enumerate(shards) if s]
        r = full[randint(gen, 0, len(full) - 1)]
        top = max(float(g.abs().max()) for s in shards for g in s if g.numel())
        shards[r][0].view(-1)[0] = -(top * uniform(gen, 1.5, 3.0))
    return {
        "ranks": world,
        "shards": shards,
        "norm": norm,
        "dtype": str(dtype).removeprefix("torch."),
    }


def make_inputs(gen: torch.Generator) -> dict:
    """One job of 3 ranks: three calls over all of them, then three over ranks 0 and 1."""
    return {
        "cases": [
            {
                "world_size": 3,
                "subs": [
                    _sub(gen, 3, torch.float64, "2", "list"),
                    _sub(gen, 3, torch.float32, "inf", "list"),
                    _sub(gen, 3, torch.float64, "2", None),
                    _sub(gen, 2, torch.float32, "2", None, tiny=True),
                    _sub(gen, 2, torch.float64, "inf", None),
                    _sub(gen, 2, torch.float32, "2", "tensor"),
                ],
            }
        ]
    }


def visible_inputs(gen: torch.Generator) -> dict:
    """One job of 3 ranks, smaller: an L2 norm over all 3 (one rank empty), an L2 norm and
    an inf-norm over the group of ranks 0 and 1."""
    return {
        "cases": [
            {
                "world_size": 3,
                "subs": [
                    _sub(gen, 3, torch.float64, "2", "list"),
                    _sub(gen, 2, torch.float32, "2", "tensor", tiny=True),
                    _sub(gen, 2, torch.float64, "inf", None),
                ],
            }
        ]
    }


def run_rank(ns: dict, inputs: dict, case: dict, rank: int, world: int) -> list:
    """The student's ``global_grad_norm`` on this rank's shard, once per call this rank takes
    part in (``None`` for the others). Calls over fewer ranks than the job's get ``group``, a
    process group of ranks ``0 .. n-1``; the ranks outside it wait for rank 0's word that
    the group is done (a point-to-point message, which no collective can answer)."""
    fn = guards.load_student_file(NORM_FILE)["global_grad_norm"]
    sizes = sorted({sub["ranks"] for sub in case["subs"] if sub["ranks"] < world})
    groups = {n: dist.new_group(list(range(n))) for n in sizes}  # every rank creates each
    out = []
    for sub in case["subs"]:
        n = sub["ranks"]
        if rank >= n:
            out.append(None)
            continue
        grads = [g.clone() for g in sub["shards"][rank]]

        def hung(n=n) -> str:
            return (
                f"global_grad_norm did not return within {WATCHDOG_S:g} s on rank {rank} of a "
                f"group of {n} of the {world} ranks: pass group=group to every collective "
                "(the ranks outside the group never join it)"
                if n < world
                else f"global_grad_norm did not return within {WATCHDOG_S:g} s on rank {rank}: "
                "does every rank call the same collectives, also a rank without gradients?"
            )

        with guards.call_watchdog(WATCHDOG_S, hung):
            out.append(plain(fn(grads, NORMS[sub["norm"]], groups.get(n))))
    token = torch.zeros(1)
    for n in sizes:  # the ranks outside a group wait until the group is done
        if rank == 0:
            for r in range(n, world):
                dist.send(token, dst=r)
        elif rank >= n:
            dist.recv(token, src=0)
    return out


def oracle(sub: dict) -> float:
    """``torch.linalg.vector_norm`` of every rank's gradients together, in float64."""
    flat = [g.reshape(-1).double() for shard in sub["shards"] for g in shard]
    return float(torch.linalg.vector_norm(torch.cat(flat), NORMS[sub["norm"]]))


def sub_text(sub: dict) -> str:
    """``"3 ranks holding 2, 0, 3 float64 tensors (...), norm_type=2"``."""
    counts = ", ".join(str(len(s)) for s in sub["shards"])
    return (
        f"{len(sub['shards'])} ranks holding {counts} {sub['dtype']} tensors "
        f"({', '.join(str(sum(g.numel() for g in s)) for s in sub['shards'])} values), "
        f"norm_type={NORMS[sub['norm']]:g}"
    )


def sub_problem(sub: dict, results: list) -> str | None:
    """What is wrong with one call's results on every rank, or None."""
    want = oracle(sub)
    rtol = RTOL[getattr(torch, sub["dtype"])]
    what = f"global_grad_norm on {sub_text(sub)}"
    values = [number(v) for v in results]
    for rank, (value, raw) in enumerate(zip(values, results, strict=True)):
        if not abs(value - want) <= rtol * want:
            said = f"{value:.10g}" if value == value else kind(raw)
            if isinstance(raw, torch.Tensor) and raw.dtype != torch.float64:
                said += f" (a {raw.dtype} tensor; the docstring promises a 0-d float64 tensor)"
            return (
                f"{what}: rank {rank} returned {said}; expected {want:.10g}, the norm of all "
                "ranks' gradients together"
            )
    if len(set(values)) > 1:
        return f"{what}: the ranks returned different values {values}; every rank needs the same"
    for rank, raw in enumerate(results):  # right values: now the type the docstring promises
        if not (isinstance(raw, torch.Tensor) and raw.dtype == torch.float64 and raw.dim() == 0):
            said = (
                f"a {raw.dtype} tensor of shape {tuple(raw.shape)}"
                if isinstance(raw, torch.Tensor)
                else kind(raw)
            )
            return (
                f"{what}: rank {rank} returned the right value as {said}; the docstring "
                "promises a 0-d float64 tensor (torch.float64, shape ())"
            )
    return None


def judge(inputs: dict, outputs: dict) -> str:
    """Every call on every rank of its group against the norm of the concatenated gradients."""
    for case, ranks in zip(inputs["cases"], outputs["cases"], strict=True):
        if len(ranks) != case["world_size"]:
            raise CheckFailed(f"expected {case['world_size']} ranks' results, got {len(ranks)}")
        for s, sub in enumerate(case["subs"]):
            members = ranks[: sub["ranks"]]
            if why := sub_problem(sub, [r[s] if len(r) > s else None for r in members]):
                raise CheckFailed(why)
    sizes = " and ".join(sorted({str(s["ranks"]) for c in inputs["cases"] for s in c["subs"]}))
    return (
        f"global_grad_norm gives every rank the global L2 and inf-norm over groups of {sizes} "
        "ranks (float32 and float64, uneven and empty shards)"
    )


EXERCISE = Exercise(
    "test_ex5_global_grad_norm",
    ("ex5_global_grad_norm",),
    "the global gradient norm of sharded gradients",
    make_inputs,
    judge,
    run_rank=run_rank,
    timeout=120,
    visible_inputs=visible_inputs,
    files=(NORM_FILE,),
)
