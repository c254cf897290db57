"""Exercise 3: ``gpipe_step`` in ``pipeline.py``, one GPipe training step across ranks.

A model (``Linear`` layers with ``tanh`` between them) is cut into ``p`` stages; rank ``i``
holds stage ``i`` only. The student's function runs on every stage's rank: every
micro-batch forward through the stages (``send``/``recv`` of the activations), then every
micro-batch backward (``send``/``recv`` of the activations' gradients), so that each stage's
parameters end up holding the gradient of the whole batch's mean loss; the last stage
returns the loss and the outputs.

The oracle is the *unsplit* model on one process: the micro-batches concatenated, the mean
cross-entropy, autograd. The last rank's loss and outputs and every stage's gradients must
equal it (float64 to 1e-10, float32 to 1e-6 + 1e-5 relative). A forward hook on each
stage's first layer records its schedule: every stage must run GPipe's, once per
micro-batch, all ``m`` forwards of a step before any backward (``"FFFBBB"`` for ``m = 3``);
each micro-batch's forward and backward in turn gives the right gradients with no pipeline
at all.

Case set, in one torchrun job of 3 ranks: 3 stages with 1 micro-batch (no pipelining) in
float32, 3 stages with 4 micro-batches (more than stages) in float64, 2 stages (rank 2
idle) with 3 micro-batches in float32 and with 2 in float64; two steps each on fresh
data (the gradients set to None in between), stages of 1 to 3 layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ddp_lab.checks import guards
from ddp_lab.checks.contract import Exercise
from ddp_lab.checks.failure import CheckFailed, is_close
from ddp_lab.checks.lab07.common import BUILT_INS, DTYPES, PIPELINE_FILE, WATCHDOG_S, randn
from ddp_lab.checks.values import kind, randint

STEPS = 2
TOL = {"float32": (1e-6, 1e-5), "float64": (1e-10, 1e-9)}


def _run(gen: torch.Generator, stages: int, micro: int, dtype: str) -> dict:
    dt = DTYPES[dtype]
    d, h, c = randint(gen, 4, 8), randint(gen, 6, 12), randint(gen, 3, 5)
    n_layers = stages + randint(gen, 0, 2)
    dims = [d] + [h] * (n_layers - 1) + [c]
    layers = [[dims[i], dims[i + 1]] for i in range(n_layers)]
    cuts = [0] + sorted(torch.randperm(n_layers - 1, generator=gen)[: stages - 1].add(1).tolist())
    mb = randint(gen, 2, 4)
    return {
        "stages": stages,
        "micro": micro,
        "dtype": dtype,
        "layers": layers,
        "cuts": cuts,
        "micro_batch": mb,
        "init": [
            [randn(gen, o, i, dtype=dt, scale=i**-0.5), randn(gen, o, dtype=dt, scale=0.3)]
            for i, o in layers
        ],
        "steps": [
            {
                "xs": [randn(gen, mb, d, dtype=dt) for _ in range(micro)],
                "ys": [torch.randint(0, c, (mb,), generator=gen) for _ in range(micro)],
            }
            for _ in range(STEPS)
        ],
    }


def make_inputs(gen: torch.Generator) -> dict:
    """One job of 3 ranks: two 3-stage pipelines, then two 2-stage ones (rank 2 idle)."""
    runs = [
        _run(gen, 3, 1, "float32"),
        _run(gen, 3, 4, "float64"),
        _run(gen, 2, 3, "float32"),
        _run(gen, 2, 2, "float64"),
    ]
    return {"cases": [{"world_size": 3, "runs": runs}]}


def visible_inputs(gen: torch.Generator) -> dict:
    """One job of 3 ranks: 3 stages with 4 micro-batches, 2 stages with 2 (float64)."""
    runs = [_run(gen, 3, 4, "float32"), _run(gen, 2, 2, "float64")]
    return {"cases": [{"world_size": 3, "runs": runs}]}


def stage_layers(spec: dict, stage: int) -> range:
    """The indices of the layers stage ``stage`` holds."""
    cuts = [*spec["cuts"], len(spec["layers"])]
    return range(cuts[stage], cuts[stage + 1])


def model(spec: dict, layers=None) -> nn.Sequential:
    """The model (or the stage holding ``layers``): Linear, tanh, Linear, ... Linear."""
    layers = range(len(spec["layers"])) if layers is None else layers
    last = len(spec["layers"]) - 1
    parts: list[nn.Module] = []
    for i in layers:
        fan_in, fan_out = spec["layers"][i]
        linear = nn.Linear(fan_in, fan_out).to(DTYPES[spec["dtype"]])
        with torch.no_grad():
            linear.weight.copy_(spec["init"][i][0])
            linear.bias.copy_(spec["init"][i][1])
        parts.append(linear)
        if i != last:
            parts.append(nn.Tanh())
    return nn.Sequential(*parts)


def _record(order: list[str], output) -> None:
    """A forward of the stage's first layer: ``F``, and ``B`` when its backward reaches it."""
    if isinstance(output, torch.Tensor) and output.requires_grad:
        order.append("F")
        output.register_hook(lambda grad: order.append("B"))


def run_rank(ns: dict, inputs: dict, case: dict, rank: int, world: int) -> list:
    """The student's ``gpipe_step`` on this rank's stage, ``STEPS`` times per run this rank
    takes part in (``None`` for the others)."""
    fn = guards.load_student_file(PIPELINE_FILE)["gpipe_step"]
    out = []
    for spec in case["runs"]:
        p, m = spec["stages"], spec["micro"]
        if rank >= p:
            out.append(None)
            continue
        stage = model(spec, stage_layers(spec, rank))
        order: list[str] = []
        stage[0].register_forward_hook(lambda *args, order=order: _record(order, args[-1]))
        hidden = spec["layers"][0][1]
        steps = []
        for step in spec["steps"]:
            for param in stage.parameters():
                param.grad = None
            order.clear()

            def hung(p=p, m=m) -> str:
                return (
                    f"gpipe_step did not return within {WATCHDOG_S:g} s on rank {rank} "
                    f"(stage {rank} of {p}, {m} micro-batches): does every send have its recv "
                    "on the neighbour, in the same order (every forward first, then every "
                    "backward)?"
                )

            with guards.call_watchdog(WATCHDOG_S, hung):
                result = fn(
                    stage,
                    p,
                    m,
                    [x.clone() for x in step["xs"]] if rank == 0 else None,
                    [y.clone() for y in step["ys"]] if rank == p - 1 else None,
                    (spec["micro_batch"], hidden),
                    F.cross_entropy,
                )
            grads = [None if q.grad is None else q.grad.clone() for q in stage.parameters()]
            steps.append(
                {
                    "grads": grads,
                    "result": result if rank == p - 1 else None,
                    "order": "".join(order),
                }
            )
        out.append(steps)
    return out


def oracle(spec: dict, step: dict) -> dict:
    """The unsplit model on the concatenated batch: loss, outputs, every layer's gradients."""
    full = model(spec)
    out = full(torch.cat(step["xs"]))
    loss = F.cross_entropy(out, torch.cat(step["ys"]))
    loss.backward()
    linears = [m for m in full if isinstance(m, nn.Linear)]
    grads = [[lin.weight.grad, lin.bias.grad] for lin in linears]
    return {"loss": loss.detach(), "outputs": out.detach(), "grads": grads}


def run_text(spec: dict) -> str:
    """``"3 stages, 4 micro-batches of 2 (float64)"``."""
    return (
        f"{spec['stages']} stages, {spec['micro']} micro-batch{'es' if spec['micro'] > 1 else ''}"
        f" of {spec['micro_batch']} ({spec['dtype']})"
    )


def result_problem(spec: dict, s: int, result, want: dict) -> str | None:
    """What is wrong with the last stage's (loss, outputs), or None."""
    atol, rtol = TOL[spec["dtype"]]
    at = f"{run_text(spec)}, step {s + 1}: the last stage"
    if not isinstance(result, list) or len(result) != 2:
        return f"{at} must return (loss, outputs), got {kind(result)}"
    loss, outputs = result
    if not is_close(outputs, want["outputs"], atol, rtol):
        return (
            f"{at}'s outputs (every micro-batch's, concatenated in order) differ from the "
            f"unsplit model's: expected shape {tuple(want['outputs'].shape)}, got {kind(outputs)}"
        )
    scalar = isinstance(loss, torch.Tensor) and loss.numel() == 1
    if not scalar or not is_close(loss.reshape(()), want["loss"], atol, rtol):
        said = f"{float(loss.reshape(())):.8g}" if scalar else kind(loss)
        return (
            f"{at} returned the loss {said}; the unsplit model's mean loss over the batch is "
            f"{float(want['loss']):.8g}"
        )
    return None


def grads_problem(spec: dict, s: int, rank: int, grads, want: dict) -> str | None:
    """What is wrong with one stage's gradients, or None."""
    atol, rtol = TOL[spec["dtype"]]
    expected = [g for i in stage_layers(spec, rank) for g in want["grads"][i]]
    at = f"{run_text(spec)}, step {s + 1}: stage {rank}"
    if not isinstance(grads, list) or len(grads) != len(expected):
        return f"{at}: expected {len(expected)} gradients, got {kind(grads)}"
    if all(g is None for g in grads):
        return (
            f"{at}'s parameters got no gradient: only the last stage has a loss; every other "
            "stage learns from the gradient the next stage sends back (send each stage's input "
            "gradient to the previous rank, and there call backward on the outputs with it)"
        )
    for j, (got, e) in enumerate(zip(grads, expected, strict=True)):
        if not is_close(got, e, atol, rtol):
            name = "weight" if j % 2 == 0 else "bias"
            return (
                f"{at}: the gradient of its layer {j // 2} {name} differs from the unsplit "
                f"model's (autograd on the whole batch's mean loss)"
            )
    return None


def order_problem(spec: dict, s: int, rank: int, order) -> str | None:
    """A stage that did not run GPipe's schedule (every forward, then every backward, one
    per micro-batch), or None."""
    m = spec["micro"]
    if order == "F" * m + "B" * m:
        return None
    return (
        f"{run_text(spec)}, step {s + 1}: stage {rank} ran its forward (F) and backward (B) "
        f"passes in the order {order!r} (per micro-batch, as its first layer saw them); a "
        f"GPipe step runs the stage once per micro-batch, all {m} forwards before any "
        "backward: only then does stage 1 work on micro-batch 0 while stage 0 works on "
        "micro-batch 1. The right gradients with each micro-batch's forward and backward in "
        "turn (or the whole batch at once) leave all stages but one idle all the time"
    )


def run_problem(spec: dict, ranks: list) -> str | None:
    """The first thing wrong with one run, or None."""
    for s, step in enumerate(spec["steps"]):
        want = oracle(spec, step)
        for rank in range(spec["stages"]):
            steps = ranks[rank]
            if not isinstance(steps, list) or len(steps) != STEPS:
                return f"{run_text(spec)}: rank {rank} returned {kind(steps)}"
            if why := grads_problem(spec, s, rank, steps[s]["grads"], want):
                return why
        last = ranks[spec["stages"] - 1][s]["result"]
        if why := result_problem(spec, s, last, want):
            return why
        for rank in range(spec["stages"]):
            if why := order_problem(spec, s, rank, ranks[rank][s].get("order")):
                return why
    return None


def judge(inputs: dict, outputs: dict) -> str:
    """Every stage's gradients and the last stage's loss and outputs against the unsplit
    model."""
    for case, ranks in zip(inputs["cases"], outputs["cases"], strict=True):
        for r, spec in enumerate(case["runs"]):
            if why := run_problem(spec, [rank_out[r] for rank_out in ranks]):
                raise CheckFailed(why)
    runs = [s for c in inputs["cases"] for s in c["runs"]]
    shapes = ", ".join(f"{s['stages']}x{s['micro']}" for s in runs)
    return (
        f"gpipe_step equals the unsplit model (loss, outputs and every stage's gradients) "
        f"for stages x micro-batches = {shapes}, float32 and float64"
    )


EXERCISE = Exercise(
    "test_ex3_pipeline",
    ("ex3_pipeline",),
    "a GPipe step equal to the unsplit model",
    make_inputs,
    judge,
    run_rank=run_rank,
    forbid=guards.COLLECTIVES,
    forbid_modules=BUILT_INS,
    timeout=120,
    visible_inputs=visible_inputs,
    files=(PIPELINE_FILE,),
)
