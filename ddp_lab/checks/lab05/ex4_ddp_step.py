"""Exercise 4: ``train_steps`` in ``ddp_step.py``, what labs 3 to 5 taught in one DDP step.

Every rank of a torchrun job receives a ``DistributedDataParallel`` model built by the
checker (a float32 :class:`~ddp_lab.checks.lab05.common.Net`, one gradient bucket, the
checker's communication hook counting DDP's all-reduces as in exercise 3), plain SGD, a
``torch.amp.GradScaler("cpu", init_scale=2**6..2**9, growth_interval=1)``, its own list of
micro-batches, ``accumulate`` and ``max_norm``. The student's function takes one optimizer
step per ``accumulate`` consecutive micro-batches, in float16 autocast with the scaler, the
gradient clipped to ``max_norm``, and returns the norm before clipping of every step.

The checker's code, in the ranks, records at every ``scaler.update()`` the weights, the
scale and the all-reduces since the previous update.

The oracle is one process in float32 without any scaler: from the weights before the step,
the mean loss over every rank's micro-batches of the step (the global batch),
``backward``, ``clip_grad_norm_(max_norm)``, ``step``. A right step moves the weights as
that one does up to float16 rounding and returns the same norm; every rank holds the same
weights; each optimizer step cost exactly one all-reduce; the scale follows
``GradScaler``'s rule (a second scaler, driven by the judge). One step of every run holds a
sample whose float16 cast is inf, on one rank and, where ``accumulate > 1``, in a
micro-batch under ``no_sync``: DDP's average carries the NaN to every rank, so every rank
must skip that step (weights unchanged to the bit) and halve the scale.

Case set, in one job of 3 ranks: on 2 ranks and on 3 ranks, ``accumulate = 1`` over 3
steps and ``accumulate`` = 3 or 4 over 2 steps, clipping active in one of the two and not
(at the first step) in the other.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from ddp_lab.checks import guards
from ddp_lab.checks.contract import Exercise
from ddp_lab.checks.failure import CheckFailed
from ddp_lab.checks.lab04.common import as_world
from ddp_lab.checks.lab05.common import DDP_STEP_FILE, net, random_state, state
from ddp_lab.checks.lab05.ex3_accumulation import BUCKET_CAP_MB, _counting_hook
from ddp_lab.checks.values import max_diff, number, randint, same_bits, uniform
from ddp_lab.dist import ddp_bucket_count

#: How far a right step may be from the float32 step (relative to the step's size).
TOLERANCE = 1e-2
#: A value whose float16 cast is inf (float16's largest is 65504).
HUGE = 1e5


def _batch(spec: dict, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of one optimizer step: every rank's micro-batches of that step."""
    k = spec["accumulate"]
    idx = range(step * k, (step + 1) * k)
    x = torch.cat([xs[i] for xs in spec["xs"] for i in idx])
    y = torch.cat([ys[i] for ys in spec["ys"] for i in idx])
    return x, y


def fp32_step(weights: dict, spec: dict, step: int, max_norm: float | None = None):
    """The oracle: one float32 step on the global batch, clipped on the true gradients.

    Returns:
        ``(weights after, norm before clipping)``.
    """
    model = net(weights)
    optimizer = torch.optim.SGD(model.parameters(), lr=spec["lr"])
    x, y = _batch(spec, step)
    F.cross_entropy(model(x), y).backward()
    limit = spec["max_norm"] if max_norm is None else max_norm
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), limit)
    optimizer.step()
    return state(model), float(norm)


def _run_spec(gen: torch.Generator, world: int, accumulate: int, steps: int, clip: bool) -> dict:
    dims = (randint(gen, 4, 8), randint(gen, 6, 12), 3)
    b = randint(gen, 2, 4)
    n = accumulate * steps
    spec = {
        "ranks": world,
        "accumulate": accumulate,
        "lr": uniform(gen, 0.2, 0.5),
        "init": random_state(dims, gen, unused=False),
        "init_scale": 2.0 ** randint(gen, 6, 9),
        "xs": [
            [2 * torch.randn(b, dims[0], generator=gen) for _ in range(n)] for _ in range(world)
        ],
        "ys": [[torch.randint(0, 3, (b,), generator=gen) for _ in range(n)] for _ in range(world)],
        "max_norm": math.inf,
    }
    _, norm = fp32_step(spec["init"], spec, 0)
    spec["max_norm"] = norm / uniform(gen, 2, 4) if clip else norm * uniform(gen, 1.5, 2.5)
    # the overflow: one sample of one rank, in a micro-batch that runs under no_sync
    o, r = randint(gen, 1, steps - 1), randint(gen, 0, world - 1)
    j = o * accumulate + randint(gen, 0, max(accumulate - 2, 0))
    x = spec["xs"][r][j]
    x[randint(gen, 0, b - 1)] = HUGE * torch.where(torch.rand(dims[0], generator=gen) < 0.5, -1, 1)
    spec["overflow"] = {"step": o, "rank": r, "micro_batch": j}
    return spec


def _runs(gen: torch.Generator, world: int, clip_first: bool) -> list[dict]:
    return [
        _run_spec(gen, world, 1, 3, clip=clip_first),
        _run_spec(gen, world, randint(gen, 3, 4), 2, clip=not clip_first),
    ]


def make_inputs(gen: torch.Generator) -> dict:
    """One torchrun job of 3 ranks: two runs over a group of 2 ranks (rank 2 sits them out),
    then two over all 3; accumulate 1 and 3 or 4, clipping active in one run of each."""
    return {"cases": [{"world_size": 3, "runs": _runs(gen, 2, True) + _runs(gen, 3, False)}]}


def visible_inputs(gen: torch.Generator) -> dict:
    """One job on 2 ranks: accumulate 1 (clipping active) and 3 or 4."""
    return {"cases": [{"world_size": 2, "runs": _runs(gen, 2, True)}]}


def _one_run(fn, spec: dict, rank: int, group) -> dict:
    model = net(spec["init"])
    ddp = DistributedDataParallel(model, process_group=group, bucket_cap_mb=BUCKET_CAP_MB)
    counter = [0]
    ddp.register_comm_hook(group, _counting_hook(counter, spec["ranks"]))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=spec["lr"])
    scaler = torch.amp.GradScaler("cpu", init_scale=spec["init_scale"], growth_interval=1)
    updates: list[dict] = []
    update = scaler.update

    def recorded_update(*args, **kwargs):
        out = update(*args, **kwargs)
        seen = sum(u["allreduces"] for u in updates)
        updates.append(
            {"allreduces": counter[0] - seen, "scale": scaler.get_scale(), "weights": state(model)}
        )
        return out

    scaler.update = recorded_update
    micro = list(zip(spec["xs"][rank], spec["ys"][rank], strict=True))
    with as_world(group):
        norms = fn(ddp, optimizer, scaler, micro, spec["accumulate"], spec["max_norm"])
    buckets = ddp_bucket_count(ddp)
    norms = [number(v) for v in norms] if isinstance(norms, (list, tuple)) else None
    out = {
        "norms": norms,
        "updates": updates,
        "after_last": counter[0] - sum(u["allreduces"] for u in updates),
        "buckets": -1 if buckets is None else buckets,
    }
    del ddp, optimizer
    return out


def run_rank(ns: dict, inputs: dict, case: dict, rank: int, world: int) -> list[dict | None]:
    """The student's ``train_steps`` on this rank, once per run it takes part in (``None``
    for the others). A run over fewer ranks than the job's sees a process group of ranks
    ``0 .. n-1`` as its world (DDP's ``process_group`` and the default group)."""
    fn = guards.load_student_file(DDP_STEP_FILE)["train_steps"]
    sizes = sorted({spec["ranks"] for spec in case["runs"] if spec["ranks"] < world})
    groups = {n: dist.new_group(list(range(n))) for n in sizes}  # every rank creates each
    return [
        _one_run(fn, spec, rank, groups.get(spec["ranks"])) if rank < spec["ranks"] else None
        for spec in case["runs"]
    ]


def expected_scales(spec: dict) -> list[float]:
    """The scale after every step, from a second ``GradScaler`` driven through the same
    steps (an inf gradient at the overflow step, a finite one elsewhere)."""
    p = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([p], lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=spec["init_scale"], growth_interval=1)
    out = []
    for s in range(len(spec["xs"][0]) // spec["accumulate"]):
        scaler.scale(p.sum())  # (the scaler's state starts with its first scale call)
        p.grad = torch.full((1,), math.inf if s == spec["overflow"]["step"] else 1.0)
        scaler.step(optimizer)
        scaler.update()
        out.append(scaler.get_scale())
    return out


def run_text(spec: dict) -> str:
    """``"2 ranks x 8 micro-batches of 3 samples, accumulate 4, max_norm 0.51"``."""
    n, b = len(spec["xs"][0]), spec["xs"][0][0].shape[0]
    return (
        f"{spec['ranks']} ranks x {n} micro-batches of {b} samples, accumulate "
        f"{spec['accumulate']}, max_norm {spec['max_norm']:.3g}"
    )


def steps_of(spec: dict) -> int:
    """Optimizer steps of a run."""
    return len(spec["xs"][0]) // spec["accumulate"]


def count_problem(spec: dict, outs: list[dict]) -> str | None:
    """What is wrong with the numbers of steps, updates and all-reduces, or None."""
    at, steps = run_text(spec), steps_of(spec)
    for rank, o in enumerate(outs):
        if len(o["updates"]) != steps:
            return (
                f"{at}: rank {rank} called scaler.update() {len(o['updates'])} times for "
                f"{steps} optimizer steps: call it once per optimizer step, skipped steps "
                "included (after a skipped step it is what lowers the scale)"
            )
        if o["norms"] is None or len(o["norms"]) != steps:
            return f"{at}: rank {rank}: train_steps should return a list of {steps} norms"
        buckets = o["buckets"] if o["buckets"] > 0 else 1
        for s, u in enumerate(o["updates"]):
            if u["allreduces"] != buckets:
                why = (
                    "run the backward passes of all but the last micro-batch of a step under "
                    "ddp_model.no_sync(), forward included"
                    if u["allreduces"] > buckets
                    else "the last micro-batch of each step must run outside no_sync(), so "
                    "that DDP averages the accumulated gradients"
                )
                return (
                    f"{at}: rank {rank}, optimizer step {s}: {u['allreduces']} gradient "
                    f"all-reduces, expected {buckets} (one bucket): {why}"
                )
        if o["after_last"]:
            return f"{at}: rank {rank}: {o['after_last']} all-reduces after the last step"
    return None


def flat_delta(after: dict, before: dict) -> torch.Tensor:
    """The step as one float64 vector (``after - before``)."""
    return torch.cat([(after[k].double() - before[k].double()).reshape(-1) for k in sorted(after)])


def step_problem(spec: dict, s: int, before: dict, outs: list[dict]) -> str | None:
    """What is wrong with optimizer step ``s`` of a run (every rank), or None."""
    what = f"{run_text(spec)}, step {s}"
    got = outs[0]["updates"][s]["weights"]
    for rank, o in enumerate(outs[1:], 1):
        if not same_bits(o["updates"][s]["weights"], got):
            return (
                f"{what}: rank {rank}'s weights differ from rank 0's by "
                f"{max_diff(o['updates'][s]['weights'], got):.3g}: every rank must apply the "
                "same averaged, unscaled, clipped gradient"
            )
    if any(t.dtype != torch.float32 for t in got.values()):
        return f"{what}: the weights must stay float32 (autocast computes in float16)"
    norm = outs[0]["norms"][s]
    if s == spec["overflow"]["step"]:
        if not same_bits(got, before):
            return (
                f"{what}: one rank's micro-batch overflows float16 (inf) here, and DDP's "
                "average carries it to every rank: the step must be skipped on every rank "
                "(scaler.step(optimizer) skips it; optimizer.step() does not)"
            )
        if math.isfinite(norm):
            return f"{what}: the gradients overflowed, yet the returned norm is {norm:.4g}"
        return None
    want, true_norm = fp32_step(before, spec, s)
    delta, expected = flat_delta(got, before), flat_delta(want, before)
    if not bool(torch.isfinite(delta).all()):
        return f"{what}: the weights are no longer finite"
    off = float((delta - expected).norm() / expected.norm())
    if off > TOLERANCE:
        ratio = float(delta.norm() / expected.norm())
        return (
            f"{what}: the step moved the weights by {ratio:.3g} times the float32 step of one "
            "process on the global batch, clipped on the true gradients (relative difference "
            f"{off:.2g}, allowed {TOLERANCE:g})"
        )
    if not abs(norm - true_norm) <= TOLERANCE * true_norm:
        return (
            f"{what}: returned {norm:.6g}; expected the norm before clipping of the true "
            f"(unscaled, averaged) gradient of the global batch, {true_norm:.6g}"
        )
    return None


def problem(spec: dict, outs: list[dict]) -> str | None:
    """The first thing wrong with one run on every rank, or None."""
    if len(outs) != spec["ranks"] or any(not isinstance(o, dict) for o in outs):
        return f"expected the results of {spec['ranks']} ranks"
    if why := count_problem(spec, outs):
        return why
    before = spec["init"]
    scales = expected_scales(spec)
    for s in range(steps_of(spec)):
        if why := step_problem(spec, s, before, outs):
            return why
        got = outs[0]["updates"][s]["scale"]
        if got != scales[s]:
            return (
                f"{run_text(spec)}, step {s}: the scale after the step should be "
                f"{scales[s]:g} (GradScaler halves it after a skipped step and doubles it "
                f"after a good one at growth_interval=1), got {got:g}: scaler.step, then "
                "scaler.update, once per optimizer step"
            )
        before = outs[0]["updates"][s]["weights"]
    return None


def judge(inputs: dict, outputs: dict) -> str:
    """Every step against one float32 process on the global batch; one all-reduce per step;
    the overflowing step skipped on every rank."""
    for case, ranks in zip(inputs["cases"], outputs["cases"], strict=True):
        for r, spec in enumerate(case["runs"]):
            outs = [rank_out[r] for rank_out in ranks[: spec["ranks"]]]
            if why := problem(spec, outs):
                raise CheckFailed(why)
    runs = [s for c in inputs["cases"] for s in c["runs"]]
    worlds = " and ".join(sorted({str(s["ranks"]) for s in runs}))
    ks = ", ".join(str(k) for k in sorted({s["accumulate"] for s in runs}))
    return (
        f"train_steps on {worlds} ranks (accumulate {ks}) equals one float32 process on the "
        "global batch with clip_grad_norm_ on the true gradients, step by step, with one "
        "all-reduce per optimizer step; an overflow is skipped on every rank"
    )


EXERCISE = Exercise(
    "test_ex4_ddp_step",
    ("ex4_ddp_step",),
    "a DDP step with accumulation, fp16, a scaler and clipping equals the float32 big batch",
    make_inputs,
    judge,
    run_rank=run_rank,
    timeout=120,
    visible_inputs=visible_inputs,
    files=(DDP_STEP_FILE,),
)
