"""Exercise 3: ``make_compress_hook(dtype)`` in ``compress.py``, a gradient-compression DDP
communication hook.

``make_compress_hook(dtype)`` (``torch.float16`` or ``torch.bfloat16``) returns
``hook(process_group, bucket) -> torch.futures.Future[torch.Tensor]``, registered with
``ddp_model.register_comm_hook(process_group, hook)`` (``process_group`` None: the default
group). It sends the bucket's gradients compressed to ``dtype``, by one ``all_reduce`` of a
``dtype`` tensor over the group, averages them over the group's ranks, and its Future holds
the average in the bucket's own dtype and shape (float32 here).

The oracle is torch's own ``fp16_compress_hook`` / ``bf16_compress_hook`` (captured when this
module is imported, and run on every rank before the student's file is loaded), on the same
DDP model and data in the same job: the averaged gradients after every backward pass and the
parameters after every SGD step must equal torch's bit for bit on every rank. The checker
also records, per bucket, the collectives the hook calls (name, dtype, numbers, group size)
and what its Future holds: one ``all_reduce`` of the bucket's numbers in ``dtype`` (half
the bytes of float32), nothing else, and a float32 tensor of the bucket's size back.

Case set, in one torchrun job of 3 ranks, :data:`STEPS` SGD steps each (the first with one
bucket, the later ones with the buckets DDP rebuilds, at least 3, for a cap of
:data:`BUCKET_CAP_MB`): an MLP of 6 float32 parameters over all 3 ranks (``process_group``
None) in float16 and in bfloat16, then over a group of ranks 0 and 1 (``process_group`` that
group; the default group has 3 ranks) in float16 and bfloat16. The loss is scaled so that the
ranks' largest gradient is near 0.6 of float16's largest number (65504) and the ranks'
gradients are alike: each fits float16, their sum over 2 or 3 ranks does not (it overflows to
inf). Random values elsewhere, so that in bfloat16 over 3 ranks dividing before or after the
sum rounds differently.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as _default_hooks

from ddp_lab.checks import guards, runner
from ddp_lab.checks.contract import Exercise
from ddp_lab.checks.failure import CheckFailed
from ddp_lab.checks.lab07.common import groups_for, release
from ddp_lab.checks.lab08.common import LAB
from ddp_lab.checks.lab08.recorder import Recorder
from ddp_lab.checks.values import kind, randint, uniform

COMPRESS_FILE = "compress.py"
GRADE_ID = "test_ex3_compress_hook"
STEPS = 4
#: DDP's bucket cap: a few hundred bytes, so that the rebuilt buckets are several.
BUCKET_CAP_MB = 2e-4
WATCHDOG_S = 30.0
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
#: torch's hooks, captured at import (before any student file runs on this rank).
TORCH_HOOKS = {
    "float16": _default_hooks.fp16_compress_hook,
    "bfloat16": _default_hooks.bf16_compress_hook,
}
HOOK_NAMES = {"float16": "fp16_compress_hook", "bfloat16": "bf16_compress_hook"}
FP16_MAX = float(torch.finfo(torch.float16).max)
#: The ranks' largest gradient, as a share of float16's largest number.
TARGET = 0.6
#: torch's own hooks (the answer): the file may not mention their package.
BUILT_INS = ("ddp_comm_hooks",)


# --- the case set ----------------------------------------------------------------------------


def mlp(sizes) -> nn.Module:
    """``Linear -> Tanh -> Linear -> Tanh -> Linear`` of widths ``sizes`` (6 parameters)."""
    d, h1, h2, c = sizes
    return nn.Sequential(
        nn.Linear(d, h1), nn.Tanh(), nn.Linear(h1, h2), nn.Tanh(), nn.Linear(h2, c)
    )


def build(spec: dict) -> nn.Module:
    """The run's MLP with its initial parameters (float32)."""
    model = mlp(spec["sizes"])
    with torch.no_grad():
        for p, t in zip(model.parameters(), spec["init"], strict=True):
            p.copy_(t)
    return model


def local_grads(spec: dict, params: list[torch.Tensor], rank: int) -> torch.Tensor:
    """Rank ``rank``'s own flat gradient (no averaging) at ``params``, in float32."""
    model = build({**spec, "init": params})
    loss = spec["scale"] * F.mse_loss(model(spec["x"][rank]), spec["y"][rank])
    loss.backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def _fits(spec: dict) -> bool:
    """Each rank's gradient fits float16 at every step of an exact-mean replay, and at the
    first step the float16 sum over the ranks overflows somewhere."""
    params = [t.clone() for t in spec["init"]]
    for step in range(STEPS):
        g = torch.stack([local_grads(spec, params, r) for r in range(spec["ranks"])])
        if float(g.abs().max()) > 0.85 * FP16_MAX:
            return False
        if step == 0 and not bool(g.half().float().sum(0).abs().max() > 1.02 * 65520):
            return False
        flat = torch.cat([p.reshape(-1) for p in params]) - spec["lr"] * g.double().mean(0).float()
        params = list(torch.split(flat, [p.numel() for p in params]))
        params = [q.reshape(p.shape) for q, p in zip(params, spec["init"], strict=True)]
    return True


def _run(gen: torch.Generator, ranks: int, dtype: str) -> dict:
    while True:
        sizes = [
            randint(gen, 10, 16),
            randint(gen, 24, 40),
            randint(gen, 16, 32),
            randint(gen, 3, 6),
        ]
        init = [p.detach().clone() for p in mlp(sizes).parameters()]
        for p in init:  # reproducible from gen, not from the global RNG
            p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
        b = randint(gen, 6, 10)
        x0, y0 = torch.randn(b, sizes[0], generator=gen), torch.randn(b, sizes[3], generator=gen)
        noise = uniform(gen, 0.05, 0.15)
        spec = {
            "ranks": ranks,
            "dtype": dtype,
            "sizes": sizes,
            "init": init,
            "x": [x0 + noise * torch.randn(x0.shape, generator=gen) for _ in range(ranks)],
            "y": [y0 + noise * torch.randn(y0.shape, generator=gen) for _ in range(ranks)],
            "scale": 1.0,
        }
        biggest = max(float(local_grads(spec, init, r).abs().max()) for r in range(ranks))
        spec["scale"] = TARGET * FP16_MAX / biggest
        spec["lr"] = uniform(gen, 0.02, 0.1) / spec["scale"]
        if _fits(spec):
            return spec


def make_inputs(gen: torch.Generator) -> dict:
    """One job of 3 ranks: float16 and bfloat16 over all 3, then over ranks 0 and 1."""
    runs = [_run(gen, 3, "float16"), _run(gen, 3, "bfloat16")]
    runs += [_run(gen, 2, "float16"), _run(gen, 2, "bfloat16")]
    return {"cases": [{"world_size": 3, "runs": runs}]}


# --- the ranks -------------------------------------------------------------------------------


def _train(spec: dict, hook, state, group, rec: Recorder) -> dict:
    """``STEPS`` DDP steps of the run's MLP with ``hook`` registered (with ``state``)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = dist.get_rank(group)
    model = DDP(build(spec), process_group=group, bucket_cap_mb=BUCKET_CAP_MB)
    model.register_comm_hook(state, rec.watch(hook))
    out = {"grads": [], "params": [], "buckets": [], "calls": []}
    for _ in range(STEPS):
        rec.buckets, rec.calls = [], []
        out["buckets"].append(rec.buckets)
        out["calls"].append(rec.calls)
        try:
            loss = spec["scale"] * F.mse_loss(model(spec["x"][rank]), spec["y"][rank])
            loss.backward()
        finally:
            rec.calls = None
        params = list(model.parameters())
        out["grads"].append(torch.cat([p.grad.reshape(-1) for p in params]).clone())
        with torch.no_grad():
            for p in params:
                p.add_(p.grad, alpha=-spec["lr"])
                p.grad = None
        out["params"].append(torch.cat([p.detach().reshape(-1) for p in params]).clone())
    return out


def run_text(spec: dict) -> str:
    """``"float16 over 3 ranks (process_group None: the default group)"``."""
    where = (
        "over 3 ranks (process_group None: the default group)"
        if spec["ranks"] == 3
        else "over ranks 0 and 1 (process_group: their group; the default group has 3)"
    )
    return f"make_compress_hook(torch.{spec['dtype']}) {where}"


def _each_run(case: dict, rank: int, world: int, hook_of, rec: Recorder) -> list:
    """``_train`` of every run this rank takes part in (None for the others)."""
    sizes = [spec["ranks"] for spec in case["runs"]]
    groups = groups_for(sizes, world)
    out = []
    for spec in case["runs"]:
        if rank >= spec["ranks"]:
            out.append(None)
            continue
        group = groups.get(spec["ranks"])

        def hung(spec=spec) -> str:
            return (
                f"{run_text(spec)}: a DDP step did not finish within {WATCHDOG_S:g} s on rank "
                f"{rank}: does your hook all-reduce over process_group (group=process_group; "
                "None is the default group)? The other ranks never join a collective of "
                "another group"
            )

        with guards.call_watchdog(WATCHDOG_S, hung):
            out.append(_train(spec, hook_of(spec), group, group, rec))
    release(sizes, rank, world)
    return out


def run_rank(ns: dict, inputs: dict, case: dict, rank: int, world: int) -> dict:
    """torch's hooks on every run first (before the student's file is loaded), then the
    student's ``make_compress_hook(dtype)`` on the same runs."""
    if Path(COMPRESS_FILE).is_file():  # the grader checks the cell; the visible check here
        guards.refuse_mentions({COMPRESS_FILE: Path(COMPRESS_FILE).read_text()}, BUILT_INS)
    rec = Recorder()
    with rec.installed():
        oracle = _each_run(case, rank, world, lambda s: TORCH_HOOKS[s["dtype"]], rec)
        make = guards.load_student_file(COMPRESS_FILE).get("make_compress_hook")
        if not callable(make):
            raise NameError(f"{COMPRESS_FILE} defines no function make_compress_hook(dtype)")
        student = _each_run(case, rank, world, lambda s: make(DTYPES[s["dtype"]]), rec)
    return {"oracle": oracle, "student": student}


# --- the judge -------------------------------------------------------------------------------


def raw(t: torch.Tensor) -> torch.Tensor:
    """A float32 tensor's bits (NaNs of the same bits compare equal)."""
    return t.contiguous().view(torch.int32)


def ratio(got: torch.Tensor, want: torch.Tensor) -> float:
    """The least-squares factor ``k`` with ``got ~ k * want`` over the finite numbers."""
    ok = torch.isfinite(got) & torch.isfinite(want)
    g, w = got[ok].double(), want[ok].double()
    den = float((w * w).sum())
    return float((g * w).sum()) / den if den > 0 else math.nan


def _well_formed(spec: dict, rank: int, got) -> str | None:
    at = f"{run_text(spec)}: rank {rank}"
    if not isinstance(got, dict) or any(k not in got for k in ("grads", "params", "buckets")):
        return f"{at} returned {kind(got)}"
    for key in ("grads", "params", "buckets", "calls"):
        if not isinstance(got.get(key), list) or len(got[key]) != STEPS:
            return f"{at} recorded {kind(got.get(key))} for {key}, not {STEPS} steps"
    return None


def oracle_problem(spec: dict, outs: list) -> str | None:
    """The job's run of torch's own hook is not what torch's hook does (a changed
    ``torch.distributed``?), or None."""
    hook = HOOK_NAMES[spec["dtype"]]
    for rank, o in enumerate(outs):
        why = _well_formed(spec, rank, o)
        for s in range(STEPS if why is None else 0):
            if not torch.equal(raw(o["grads"][s]), raw(outs[0]["grads"][s])):
                why = f"rank {rank}'s gradients differ from rank 0's at step {s + 1}"
            elif not bool(torch.isfinite(o["params"][s]).all()):
                why = f"rank {rank}'s parameters are not finite after step {s + 1}"
            elif any(c[:2] != ["all_reduce", spec["dtype"]] for c in o["calls"][s]):
                why = f"rank {rank} called {o['calls'][s]} at step {s + 1}"
        if why:
            return (
                f"{run_text(spec)}: the checker's run of torch's own {hook} went wrong ({why}). "
                f"Does {COMPRESS_FILE} change torch or torch.distributed? It may only define "
                "make_compress_hook"
            )
    return None


def _bucket_problem(spec: dict, at: str, note, calls: list, n: int) -> str | None:
    dtype, name = spec["dtype"], HOOK_NAMES[spec["dtype"]]
    if not isinstance(note, dict):
        return f"{at}: the hook was not called"
    numel, b = note["numel"], note["index"]
    mine = [c for c in calls if c[4] == b]
    where = f"{at}, bucket {b} ({numel:,} float32 numbers, {4 * numel:,} bytes)"
    said = ", ".join(f"{c[0]} of {c[2]:,} {c[1]} numbers" for c in mine) or "no collective"
    if len(mine) != 1 or mine[0][0] != "all_reduce":
        return (
            f"{where}: your hook called {said}; it needs exactly one all_reduce (the sum over "
            "the group's ranks, the compressed bucket's numbers in one call), nothing else"
        )
    _, sent, count, size, _ = mine[0]
    if sent == "float32":
        return (
            f"{where}: your hook all-reduced a float32 tensor: {4 * count:,} bytes, no bytes "
            f"saved. Compression sends the bucket as {dtype}, 2 bytes a number ({2 * numel:,} "
            "bytes): all-reduce the compressed tensor itself"
        )
    if sent != dtype:
        return (
            f"{where}: your hook sent {sent} where it was made with dtype=torch.{dtype}: "
            f"make_compress_hook(dtype) must compress to the dtype it is given (torch's {name} "
            f"sends {dtype})"
        )
    if count != numel:
        return f"{where}: your hook all-reduced {count:,} numbers; the bucket holds {numel:,}"
    if size != n:
        return f"{where}: your hook all-reduced over {size} ranks; the run's group has {n}"
    value = note["value"]
    if not isinstance(value, list) or value[0] != "float32" or value[1] != numel:
        got = (
            f"a {value[0]} tensor of {value[1]:,} numbers"
            if isinstance(value, list)
            else kind(value)
        )
        return (
            f"{where}: your hook's Future holds {got}; a hook's Future holds the bucket's new "
            f"value in the bucket's own dtype and size (a float32 tensor of {numel:,} "
            f"numbers): the {dtype} tensor is only what travels, so cast the average back "
            f"(torch's {name} copies it into bucket.buffer())"
        )
    return None


def structure_problem(spec: dict, outs: list, oracle: list) -> str | None:
    """A bucket whose collectives or Future's value break the contract, or None."""
    for rank, (o, want) in enumerate(zip(outs, oracle, strict=True)):
        if why := _well_formed(spec, rank, o):
            return why
        for s in range(STEPS):
            at = f"{run_text(spec)}, step {s + 1}, rank {rank}"
            stray = [c for c in o["calls"][s] if c[4] == -1]
            if stray:
                return (
                    f"{at}: {stray[0][0]} was called outside your hook's own call (in a "
                    "Future's callback?): call the one all_reduce in the hook itself"
                )
            sizes = [b["numel"] for b in want["buckets"][s]]
            if [b.get("numel") for b in o["buckets"][s] if isinstance(b, dict)] != sizes:
                return f"{at}: DDP called your hook on buckets of sizes other than {sizes}"
            for note in o["buckets"][s]:
                if why := _bucket_problem(spec, at, note, o["calls"][s], spec["ranks"]):
                    return why
    return None


def numbers_problem(spec: dict, outs: list, oracle: list) -> str | None:
    """A step where some rank's gradients or parameters are not torch's hook's bit for bit."""
    name = HOOK_NAMES[spec["dtype"]]
    for s in range(STEPS):
        for rank, (o, want) in enumerate(zip(outs, oracle, strict=True)):
            got, exp = o["grads"][s], want["grads"][s]
            at = f"{run_text(spec)}, step {s + 1}, rank {rank}"
            if not isinstance(got, torch.Tensor) or got.shape != exp.shape:
                return f"{at}: the gradients are {kind(got)}, not {exp.numel():,} numbers"
            differ = raw(got) != raw(exp)
            if bool(differ.any()):
                i = int(differ.nonzero()[0])
                bad = ~torch.isfinite(got) & torch.isfinite(exp)
                e = f"number {i} of the flat gradient: torch's {float(exp[i]):.9g}, yours "
                e += f"{float(got[i]):.9g}"
                if bool(bad.any()):
                    j = int(bad.nonzero()[0])
                    return (
                        f"{at}: after the backward pass {int(bad.sum()):,} of your averaged "
                        f"gradients are inf or NaN where torch's {name} gives finite numbers "
                        f"(at most {float(exp.abs().max()):.6g} in size), e.g. number {j}: torch's "
                        f"{float(exp[j]):.9g}, yours {float(got[j])}. float16's largest finite "
                        "number is 65504"
                    )
                k = ratio(got, exp)
                times = f"; yours are about {k:.4g} times torch's" if abs(k - 1) > 0.01 else ""
                return (
                    f"{at}: {int(differ.sum()):,} of the {got.numel():,} averaged gradients "
                    f"differ from torch's {name}'s (bit for bit), e.g. {e}{times}"
                )
            if not torch.equal(raw(o["params"][s]), raw(want["params"][s])):
                return f"{at}: the parameters after the SGD step differ from torch's {name}'s"
    return None


def _outs(inputs: dict, outputs: dict):
    """``(spec, student outputs per rank, oracle outputs per rank)`` of every run."""
    for case, ranks in zip(inputs["cases"], outputs["cases"], strict=True):
        for i, spec in enumerate(case["runs"]):
            mine = [r.get("student", [])[i] if isinstance(r, dict) else None for r in ranks]
            torch_ = [r.get("oracle", [])[i] if isinstance(r, dict) else None for r in ranks]
            yield spec, mine[: spec["ranks"]], torch_[: spec["ranks"]]


def judge(inputs: dict, outputs: dict) -> str:
    """torch's hook's run sound; every bucket's collectives and Future right; then every
    rank's gradients and parameters equal to torch's hook's bit for bit at every step."""
    runs = list(_outs(inputs, outputs))
    for check in (oracle_problem,):
        for spec, _, oracle in runs:
            if why := check(spec, oracle):
                raise CheckFailed(why)
    for check in (structure_problem, numbers_problem):
        for spec, mine, oracle in runs:
            if why := check(spec, mine, oracle):
                raise CheckFailed(why)
    return (
        f"make_compress_hook(float16 and bfloat16) equals torch's fp16_compress_hook and "
        f"bf16_compress_hook bit for bit on every rank after each of {STEPS} DDP steps, over 3 "
        "ranks (process_group None) and a group of 2, with one all_reduce per bucket of the "
        "compressed dtype: half the bytes"
    )


EXERCISE = Exercise(
    GRADE_ID,
    ("ex3_compress_hook",),
    "a gradient-compression DDP communication hook equal to torch's",
    make_inputs,
    judge,
    run_rank=run_rank,
    forbid_modules=BUILT_INS,
    timeout=90,
    files=(COMPRESS_FILE,),
)


def visible(path: str = COMPRESS_FILE) -> None:
    """Visible check of exercise 3: the file on 3 ranks (torchrun), DDP steps in float16 and
    bfloat16 over all 3 ranks and over a group of 2, against torch's own hooks."""
    runner.visible(LAB, GRADE_ID, folder=Path(path).parent)
