"""Exercise 3, ``data_parallel_forward(module, x, n)``: ``nn.DataParallel``'s forward on one
device (replicate, scatter, parallel_apply, gather), trainable through ``module``.

The checker registers a forward pre-hook on ``module`` (``copy.deepcopy`` copies it onto
the replicas) that records, for every forward pass, how many samples it saw, in which
thread it ran, whether it ran with ``module``'s own parameter tensors, and the memory its
parameters live in, so that two replicas sharing one copy (or views of one) show. Then it runs a
backward pass from the returned outputs (the mean cross-entropy of the whole batch), as a
training step would.

The oracles are ``module(x)`` and autograd's gradient of that loss, both in float64. A right
answer returns the same outputs, runs one forward per piece of the batch (at most ``n``
pieces, together every sample once), each in its own thread and, when there is more than
one piece, with its own copy of the parameters (one per replica, as ``replicate`` makes one
per device); and the backward pass puts the whole batch's
gradient into ``module``'s ``.grad`` (the copies' gradients added up, as ``nn.DataParallel``'s
``Broadcast`` / ``ReduceAddCoalesced`` pair does). The fixed case set, random values
inside: ``n = 1``, ``n = 2`` on an odd batch, ``n = 3`` on a batch not divisible by 3
(float32), ``n`` = 4 to 6 on a batch not divisible by ``n`` (image-shaped inputs), and more
replicas than samples (float32).
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch
import torch.nn.functional as F

from ddp_lab.checks.contract import Exercise
from ddp_lab.checks.failure import CheckFailed, assert_close, require
from ddp_lab.checks.lab01.common import (
    DTYPES,
    TOLERANCE,
    close,
    draw_dims,
    full_batch,
    memo,
    model_of,
    param_names,
    random_state,
)
from ddp_lab.checks.values import kind, plain, randint


def _case(gen: torch.Generator, batch: int, n: int, dtype: str, image: bool = False) -> dict:
    dims = draw_dims(gen)
    shape = (batch, 2, dims[0] // 2) if image else (batch, dims[0])
    if image:
        dims[0] = 2 * (dims[0] // 2)
    return {
        "dims": dims,
        "dtype": dtype,
        "n": n,
        "state": random_state(gen, dims, dtype),
        "x": torch.randn(shape, generator=gen).to(DTYPES[dtype]),
        "y": torch.randint(0, dims[-1], (batch,), generator=gen),
    }


def _not_divisible(gen: torch.Generator, n: int) -> int:
    return n * randint(gen, 1, 3) + randint(gen, 1, n - 1)


def make_inputs(gen: torch.Generator) -> dict:
    """Five cases: n = 1, 2 (odd batch), 3 (float32), 4 to 6 (image-shaped), n > B."""
    n4 = randint(gen, 4, 6)
    few = randint(gen, 1, 3)
    return {
        "cases": [
            _case(gen, randint(gen, 2, 7), 1, "float64"),
            _case(gen, _not_divisible(gen, 2), 2, "float64"),
            _case(gen, _not_divisible(gen, 3), 3, "float32"),
            _case(gen, _not_divisible(gen, n4), n4, "float64", image=True),
            _case(gen, few, few + randint(gen, 1, 3), "float32"),
        ]
    }


def visible_inputs(gen: torch.Generator) -> dict:
    """10 samples on 4 replicas (float64), 5 on 1, and 2 on 3 (float32)."""
    return {
        "cases": [
            _case(gen, 10, 4, "float64"),
            _case(gen, 5, 1, "float64"),
            _case(gen, 2, 3, "float32"),
        ]
    }


def _memory(t: torch.Tensor) -> int:
    """The address of the memory a tensor's values live in (views share their base's)."""
    return t.untyped_storage().data_ptr()


def _one(fn, case: dict) -> dict:
    module = model_of(case)
    own = {id(p) for p in module.parameters()}
    threads: list[threading.Thread] = []  # kept alive, so that no two share an id
    held: list[torch.Tensor] = []  # the replicas' parameters, kept alive: addresses stay unique
    seen: list[dict] = []

    def record(mod, args):
        first = args[0] if args else None
        here = threading.current_thread()
        if here not in threads:
            threads.append(here)
        params = list(mod.parameters())
        held.extend(params)
        memory = [_memory(p) for p in params]
        seen.append(
            {
                "samples": int(first.shape[0]) if isinstance(first, torch.Tensor) else -1,
                "thread": threads.index(here),
                "own": any(id(p) in own for p in params),
                "memory": memory,
            }
        )

    module.register_forward_pre_hook(record)
    out = fn(module, case["x"].clone(), case["n"])
    result = {
        "out": plain(out),
        "forwards": seen,
        "grad_before": any(p.grad is not None for p in module.parameters()),
        "backward": "",
    }
    try:
        F.cross_entropy(out, case["y"]).backward()
    except Exception as err:  # noqa: BLE001 - said in the verdict
        result["backward"] = f"{type(err).__name__}: {err}"
    result["grads"] = [plain(p.grad) for p in module.parameters()]
    return result


def run(ns: dict, inputs: dict, workdir: Path | None) -> dict:
    """The student's forward on each case, then the checker's backward from its outputs."""
    return {"cases": [_one(ns["data_parallel_forward"], case) for case in inputs["cases"]]}


def describe(case: dict) -> str:
    """``data_parallel_forward(module, x, n=3) on a batch of 7 (float32)``."""
    b = case["x"].shape[0]
    return f"data_parallel_forward(module, x, n={case['n']}) on a batch of {b} ({case['dtype']})"


def _check_forwards(case: dict, got: dict) -> None:
    what, n, batch = describe(case), case["n"], case["x"].shape[0]
    forwards = got["forwards"]
    sizes = [f["samples"] for f in forwards]
    require(
        len(forwards) <= n and sum(sizes) == batch,
        f"{what}: the replicas' forward passes saw {sizes} samples; expected at most {n} "
        f"pieces that hold the {batch} samples once (scatter: torch.chunk(x, n))",
    )
    if len(forwards) > 1:
        require(
            len({f["thread"] for f in forwards}) == len(forwards),
            f"{what}: the {len(forwards)} replicas ran in "
            f"{len({f['thread'] for f in forwards})} thread(s); parallel_apply starts one "
            "thread per replica, so that the devices work at the same time",
        )
        require(
            not any(f["own"] for f in forwards),
            f"{what}: a replica ran with module's own parameter tensors; replicate first: "
            "every replica (device) holds its own copy of the parameters",
        )
        memory = [set(f.get("memory", [])) for f in forwards]
        for i in range(len(memory)):
            for j in range(i):
                if memory[i] & memory[j]:
                    raise CheckFailed(
                        f"{what}: replicas {j} and {i} ran with the same parameter tensors; "
                        "replicate makes one copy per device (torch.nn.parallel.replicate), "
                        "so every replica needs its own copy of the parameters, not one copy "
                        "shared by all"
                    )


def _check_case(case: dict, got: dict) -> None:
    what, dtype = describe(case), case["dtype"]
    atol, rtol = TOLERANCE[dtype]
    expected = memo(case, "ex3_out", lambda: model_of(case, "float64")(case["x"].double()).detach())
    out = got["out"]
    if not isinstance(out, torch.Tensor):
        raise CheckFailed(f"{what}: expected the outputs as one tensor, got {kind(out)}")
    require(
        tuple(out.shape) == tuple(expected.shape),
        f"{what}: expected outputs of shape {tuple(expected.shape)} (one row per sample, "
        f"like module(x)), got {tuple(out.shape)}",
    )
    assert_close(out, expected, f"{what}: the outputs (expected module(x))", atol, rtol)
    _check_forwards(case, got)
    require(
        not got["grad_before"],
        f"{what}: module holds gradients before any backward pass: the forward must not "
        "run backward",
    )
    names = param_names(case)
    _, grads = memo(case, "ex3_grads", lambda: full_batch(case, case["x"], case["y"]))
    missing = [nm for nm, g in zip(names, got["grads"], strict=True) if g is None]
    if got["backward"] or missing:
        why = got["backward"] or f"the .grad of {', '.join(missing)} stayed empty"
        raise CheckFailed(
            f"{what}: after a backward pass from your outputs, {why}. The replicas' "
            "parameters are not connected to module's in autograd: copy.deepcopy makes "
            "new leaf tensors, so their gradients never reach module. Give each replica "
            "p.clone() of module's parameters (torch.func.functional_call), whose backward "
            "adds the replica's gradient into p"
        )
    for name, g, e in zip(names, got["grads"], grads, strict=True):
        if not close(g, e, dtype):
            assert_close(
                g,
                e,
                f"{what}: module's {name}.grad after a backward pass from your outputs "
                "(expected the whole batch's gradient)",
                atol,
                rtol,
            )


def judge(inputs: dict, outputs: dict) -> str:
    """Every case: outputs, forward passes (pieces, threads, copies), gradients."""
    cases, got = inputs["cases"], outputs.get("cases")
    require(isinstance(got, list) and len(got) == len(cases), "expected one result per case")
    for case, result in zip(cases, got, strict=True):
        _check_case(case, result)
    shown = ", ".join(f"{c['x'].shape[0]} on {c['n']}" for c in cases)
    return (
        f"outputs equal module(x) and one backward gives module the whole batch's gradient "
        f"({shown}); one thread and one parameter copy per replica"
    )


EXERCISE = Exercise(
    "test_ex3_data_parallel_forward",
    ("ex3_data_parallel_forward",),
    "nn.DataParallel's forward by hand, trainable",
    make_inputs,
    judge,
    run=run,
    visible_inputs=visible_inputs,
)
