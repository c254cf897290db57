"""Exercise 4: ``MyDDP`` in ``my_ddp.py``, a minimal DistributedDataParallel.

Every rank builds a float64 :class:`~ddp_lab.checks.lab03.common.TinyNet` from its *own*
random weights, wraps it in the student's ``MyDDP`` (torch's ``DistributedDataParallel``
refused meanwhile) and takes a few SGD steps on its own batches. Oracles, computed in the
judge:

- after wrapping, every rank holds rank 0's parameters *and* buffers (what a broadcast
  from rank 0 gives, known by construction);
- after the first backward, every rank's gradient is the gradient of the mean loss over
  the *big batch* (all ranks' first batches concatenated), by autograd at rank 0's weights;
- after the last step, every rank holds the weights of plain SGD on the big batches, which
  is what ``DistributedDataParallel`` gives.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddp_lab.checks import guards
from ddp_lab.checks.contract import Exercise
from ddp_lab.checks.failure import CheckFailed, max_abs_diff
from ddp_lab.checks.lab03.common import random_dims, random_state, same_state, state, tiny_net
from ddp_lab.checks.values import randint, uniform

FILE = "my_ddp.py"
NO_TORCH_DDP = (
    "MyDDP must not use torch's DistributedDataParallel: broadcast the parameters and "
    "all-reduce the gradients yourself"
)


def case(gen: torch.Generator, world: int, steps: int = 3) -> dict:
    """``world`` ranks that start from different weights, ``steps`` batches each."""
    dims = random_dims(gen)
    d, c = dims[0], dims[2]
    b = randint(gen, 3, 6)
    return {
        "world_size": world,
        "dims": dims,
        "inits": [random_state(dims, gen) for _ in range(world)],
        "xs": [torch.randn(steps, b, d, generator=gen, dtype=torch.float64) for _ in range(world)],
        "ys": [torch.randint(0, c, (steps, b), generator=gen) for _ in range(world)],
        "lr": uniform(gen, 0.1, 0.5),
    }


def make_inputs(gen: torch.Generator) -> dict:
    """One job on 3 ranks."""
    return {"cases": [case(gen, 3)]}


def visible_inputs(gen: torch.Generator) -> dict:
    """One job on 2 ranks."""
    return {"cases": [case(gen, 2)]}


def _train(wrapped: nn.Module, model: nn.Module, case: dict, rank: int) -> dict:
    """SGD steps through ``wrapped`` on this rank's batches; the first step's gradients."""
    opt = torch.optim.SGD(wrapped.parameters(), lr=case["lr"])
    grads0: dict = {}
    for step, (x, y) in enumerate(zip(case["xs"][rank], case["ys"][rank], strict=True)):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(wrapped(x), y)
        loss.backward()
        if step == 0:
            grads0 = {
                k: (p.grad.detach().clone() if p.grad is not None else torch.full_like(p, math.nan))
                for k, p in model.named_parameters()
            }
        opt.step()
    return grads0


def run_rank(ns: dict, inputs: dict, case: dict, rank: int, world: int) -> dict:
    """Wrap this rank's model in the student's ``MyDDP`` and train it."""
    with guards.refused_class(DistributedDataParallel, NO_TORCH_DDP):
        mod = guards.load_student_file(FILE)
        model = tiny_net(case["dims"], case["inits"][rank])
        wrapped = mod["MyDDP"](model)
        after_wrap = state(model)
        grads0 = _train(wrapped, model, case, rank)
    return {"after_wrap": after_wrap, "grads0": grads0, "final": state(model)}


def big_batch(case: dict, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's batch of ``step``, concatenated."""
    w = case["world_size"]
    return (
        torch.cat([case["xs"][r][step] for r in range(w)]),
        torch.cat([case["ys"][r][step] for r in range(w)]),
    )


def big_batch_gradient(case: dict) -> dict:
    """The gradient of the mean loss over the first big batch, at rank 0's weights."""
    model = tiny_net(case["dims"], case["inits"][0])
    x, y = big_batch(case, 0)
    nn.functional.cross_entropy(model(x), y).backward()
    return {k: p.grad.detach().clone() for k, p in model.named_parameters()}


def big_batch_sgd(case: dict) -> dict:
    """Rank 0's weights after plain SGD on every step's big batch (what DDP gives)."""
    model = tiny_net(case["dims"], case["inits"][0])
    opt = torch.optim.SGD(model.parameters(), lr=case["lr"])
    for step in range(case["xs"][0].shape[0]):
        x, y = big_batch(case, step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return state(model)


def where(case: dict) -> str:
    """``"3 ranks that start from different weights"``."""
    return f"{case['world_size']} ranks that start from different weights"


def problem(case: dict, outs: list[dict]) -> str | None:
    """What is wrong with ``MyDDP`` on every rank, or None."""
    w, at = case["world_size"], where(case)
    if len(outs) != w:
        return f"expected the results of {w} ranks, got {len(outs)}"
    start = case["inits"][0]
    for r, o in enumerate(outs):
        after = o["after_wrap"]
        if not same_state(after, start, 0, 0):
            params = {k: v for k, v in start.items() if k != "scale"}
            if same_state({k: after[k] for k in params if k in after}, params, 0, 0):
                return (
                    f"{at}: after MyDDP(model), rank {r}'s buffers differ from rank 0's: "
                    "broadcast the buffers too (module.buffers())"
                )
            return (
                f"{at}: after MyDDP(model), rank {r}'s parameters differ from rank 0's: "
                "broadcast every parameter from rank 0 in __init__ (dist.broadcast(p, src=0))"
            )
    mean = big_batch_gradient(case)
    for r, o in enumerate(outs):
        g = o["grads0"]
        if same_state(g, mean):
            continue
        if isinstance(g, dict) and any(bool(torch.isnan(v).all()) for v in g.values()):
            return f"{at}: after loss.backward() rank {r} has parameters without .grad"
        return (
            f"{at}: after the first backward, rank {r}'s gradient is not the average over the "
            f"ranks, the gradient of the mean loss over all ranks' batches (max abs difference "
            f"{max_abs_diff(g, mean):.3g}): all-reduce every gradient in a hook and divide by "
            "the world size"
        )
    expected = big_batch_sgd(case)
    for r, o in enumerate(outs):
        if not same_state(o["final"], expected):
            return (
                f"{at}: after {case['xs'][0].shape[0]} steps rank {r}'s weights differ from "
                f"DDP's (max abs difference {max_abs_diff(o['final'], expected):.3g}): every step "
                "must average the gradients, not only the first"
            )
    return None


def judge(inputs: dict, outputs: dict) -> str:
    """Rank 0's weights everywhere, big-batch gradients, DDP's weights after the steps."""
    for c, outs in zip(inputs["cases"], outputs["cases"], strict=True):
        if why := problem(c, outs):
            raise CheckFailed(why)
    c = inputs["cases"][0]
    return (
        f"MyDDP on {c['world_size']} ranks that start from different weights: rank 0's weights "
        f"everywhere, the big batch's gradient, the weights of DDP after {c['xs'][0].shape[0]} "
        "steps"
    )


EXERCISE = Exercise(
    "test_ex4_my_ddp",
    ("ex4_my_ddp",),
    "your own DDP: broadcast and gradient hooks",
    make_inputs,
    judge,
    run_rank=run_rank,
    timeout=60,
    visible_inputs=visible_inputs,
    files=(FILE,),
)
