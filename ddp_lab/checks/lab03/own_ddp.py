"""How the checks of exercises 4 and 5 train a student's own DDP wrapper, and what they
compare it with.

On every rank of a torchrun job the checker builds an :class:`OwnNet` from the rank's *own*
random weights, wraps it in the student's class (torch's ``DistributedDataParallel``
refused meanwhile), and trains a few SGD steps on the rank's own batches, with
``dist.all_reduce`` replaced by the checker's :class:`~ddp_lab.checks.lab03.network.
SlowNetwork` (real sums; results valid after the wait; every call counted). Each step is
``forward -> loss.backward() -> wrapped.finish() -> an SGD step``. Oracles, computed in
the judge:

- after wrapping, every rank holds rank 0's parameters *and* buffers (what a broadcast from
  rank 0 gives, known by construction);
- after the first step's ``finish()``, every trainable parameter's gradient is the gradient
  of the mean loss over the *big batch* (all ranks' batches concatenated), by autograd at
  rank 0's weights; the frozen parameter has none;
- after the last step, every rank holds the weights of plain SGD on the big batches, which
  is what ``DistributedDataParallel`` gives (the frozen parameter and the buffer unchanged).

A timing run wraps a :class:`~ddp_lab.checks.lab03.network.SlowBackwardNet` (a backward pass
that computes between layers) on a slow link, and times steps with the link's calls
returning at once (the student's overlap) and blocking (what the same code costs without
overlap), interleaved, in the same processes.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ddp_lab.checks.failure import max_abs_diff
from ddp_lab.checks.lab03.common import ATOL, RTOL, same_state, state
from ddp_lab.checks.lab03.network import SlowBackwardNet, SlowNetwork, best_steps
from ddp_lab.checks.values import randint, uniform

#: float32 runs: rounding of the averaged gradients, summed over a few steps.
ATOL32, RTOL32 = 1e-5, 1e-4
#: The timing run: layers, width, backward compute between two layers, link latency.
TIMING = {"layers": 4, "width": 32, "compute": 0.05, "latency": 0.04, "reps": 3}
#: The overlapped step must save at least this share of what perfect overlap saves.
MIN_GAIN_SHARE = 0.5


class OwnNet(nn.Module):
    """Linear - tanh - Linear (no bias) - times a frozen parameter and a buffer - tanh -
    Linear: trainable tensors of five sizes, one frozen parameter, one buffer."""

    def __init__(self, d: int, h1: int, h2: int, c: int):
        super().__init__()
        self.gate = nn.Parameter(torch.ones(h2), requires_grad=False)  # frozen
        self.first = nn.Linear(d, h1)
        self.middle = nn.Linear(h1, h2, bias=False)
        self.out = nn.Linear(h2, c)
        self.register_buffer("scale", torch.ones(h2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.middle(torch.tanh(self.first(x))))
        return self.out(h * self.gate * self.scale)


def own_net(dims, init: dict) -> OwnNet:
    """An :class:`OwnNet` of ``dims = (d, h1, h2, c)`` holding ``init`` (its dtype too)."""
    model = OwnNet(*(int(v) for v in dims)).to(init["out.weight"].dtype)
    model.load_state_dict(init)
    return model


def random_dims(gen: torch.Generator) -> list[int]:
    """``[d, h1, h2, c]``: 3-6 inputs, two hidden layers of 4-9 units, 2-4 classes."""
    return [randint(gen, 3, 6), randint(gen, 4, 9), randint(gen, 4, 9), randint(gen, 2, 4)]


def random_init(dims, gen: torch.Generator, dtype=torch.float64) -> dict:
    """Random weights, frozen gate and buffer for an :class:`OwnNet` of ``dims``."""
    d, h1, h2, c = (int(v) for v in dims)

    def draw(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen, dtype=torch.float64)).to(dtype)

    return {
        "gate": (0.5 + torch.rand(h2, generator=gen, dtype=torch.float64)).to(dtype),
        "first.weight": draw(h1, d, scale=1 / math.sqrt(d)),
        "first.bias": draw(h1, scale=0.1),
        "middle.weight": draw(h2, h1, scale=1 / math.sqrt(h1)),
        "out.weight": draw(c, h2, scale=1 / math.sqrt(h2)),
        "out.bias": draw(c, scale=0.1),
        "scale": (0.5 + torch.rand(h2, generator=gen, dtype=torch.float64)).to(dtype),
    }


def trainable_shapes(dims) -> list[tuple[int, ...]]:
    """The shapes of an :class:`OwnNet`'s trainable parameters, in registration order."""
    d, h1, h2, c = (int(v) for v in dims)
    return [(h1, d), (h1,), (h2, h1), (c, h2), (c,)]


def run_spec(gen: torch.Generator, ranks: int, dtype=torch.float64, steps: int = 3, **extra):
    """``ranks`` ranks that start from different weights, ``steps`` batches each."""
    dims = random_dims(gen)
    b = randint(gen, 3, 6)
    return {
        "ranks": ranks,
        "dims": dims,
        "dtype": str(dtype).removeprefix("torch."),
        "inits": [random_init(dims, gen, dtype) for _ in range(ranks)],
        "xs": [
            torch.randn(steps, b, dims[0], generator=gen, dtype=torch.float64).to(dtype)
            for _ in range(ranks)
        ],
        "ys": [torch.randint(0, dims[3], (steps, b), generator=gen) for _ in range(ranks)],
        "lr": uniform(gen, 0.1, 0.5),
        **extra,
    }


def train(cls, kwargs: dict, run: dict, rank: int, net: SlowNetwork) -> dict:
    """Wrap this rank's :class:`OwnNet` in the student's class and train it (checker side)."""
    net.reset()
    model = own_net(run["dims"], run["inits"][rank])
    wrapped = cls(model, **kwargs)
    after_wrap = state(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    grads0: dict = {}
    for step, (x, y) in enumerate(zip(run["xs"][rank], run["ys"][rank], strict=True)):
        for p in trainable:
            p.grad = None
        net.begin_step()
        nn.functional.cross_entropy(wrapped(x), y).backward()
        wrapped.finish()
        if step == 0:
            grads0 = {
                k: (p.grad.detach().clone() if p.grad is not None else torch.full_like(p, math.nan))
                for k, p in model.named_parameters()
                if p.requires_grad
            }
            frozen_grad = model.gate.grad is not None
        with torch.no_grad():  # plain SGD (torch.optim's first use costs seconds of imports)
            for p in trainable:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-run["lr"])
    return {
        "after_wrap": after_wrap,
        "grads0": grads0,
        "frozen_grad": frozen_grad,
        "final": state(model),
        "calls": [[c[0], c[1], c[2], bool(c[4])] for c in net.calls],
    }


def timing(cls, kwargs: dict, spec: dict, net: SlowNetwork) -> dict:
    """Step times of the student's wrapper on a slow link: overlapped (calls return at once)
    and without overlap (calls block), interleaved; the calls of the fastest overlapped step."""
    torch.manual_seed(0)  # the same weights on every rank (the wrapper broadcasts anyway)
    model = SlowBackwardNet(spec["layers"], spec["width"], spec["compute"])
    wrapped = cls(model, **kwargs)
    x = torch.randn(8, spec["width"], generator=torch.Generator().manual_seed(1))
    net.reset(spec["latency"])
    best = best_steps(wrapped, x, net, spec["reps"])
    over = best["overlapped"]
    return {
        "overlapped": over["step"],
        "blocking": best["blocking"]["step"],
        "calls": [[c[1], c[0], c[2]] for c in over["calls"]],
        "end": over["end"],
    }


# --- the judge's side -----------------------------------------------------------------------


def tolerances(run: dict) -> tuple[float, float]:
    """``(atol, rtol)`` of a run's comparisons (float32 or float64)."""
    return (ATOL32, RTOL32) if run["dtype"] == "float32" else (ATOL, RTOL)


def big_batch(run: dict, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's batch of ``step``, concatenated."""
    w = run["ranks"]
    return torch.cat([run["xs"][r][step] for r in range(w)]), torch.cat(
        [run["ys"][r][step] for r in range(w)]
    )


def _once_per_run(oracle):
    """``oracle(run)`` computed once per run object (a judge asks for it on every rank and
    every check; the run is kept alive with its result, so its id is not reused)."""
    memo: dict[int, tuple] = {}

    def cached(run: dict) -> dict:
        if id(run) not in memo:
            if len(memo) > 8:
                memo.clear()
            memo[id(run)] = (run, oracle(run))
        return memo[id(run)][1]

    cached.__doc__ = oracle.__doc__
    return cached


@_once_per_run
def big_batch_gradient(run: dict) -> dict:
    """The gradient of the mean loss over the first big batch, at rank 0's weights."""
    model = own_net(run["dims"], run["inits"][0])
    x, y = big_batch(run, 0)
    nn.functional.cross_entropy(model(x), y).backward()
    return {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.requires_grad}


@_once_per_run
def big_batch_sgd(run: dict) -> dict:
    """Rank 0's model after plain SGD on every step's big batch (what DDP gives)."""
    model = own_net(run["dims"], run["inits"][0])
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=run["lr"])
    for step in range(run["xs"][0].shape[0]):
        x, y = big_batch(run, step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return state(model)


def where(run: dict) -> str:
    """``"3 ranks (float64) that start from different weights"``."""
    return f"{run['ranks']} ranks ({run['dtype']}) that start from different weights"


def broadcast_problem(run: dict, outs: list[dict]) -> str | None:
    """Whether every rank holds rank 0's parameters and buffers after wrapping."""
    start, at = run["inits"][0], where(run)
    buffers = {"scale"}
    for r, o in enumerate(outs):
        after = o["after_wrap"]
        if same_state(after, start, 0, 0):
            continue
        params = {k: v for k, v in start.items() if k not in buffers}
        if same_state({k: after[k] for k in params if k in after}, params, 0, 0):
            return (
                f"{at}: after wrapping, rank {r}'s buffers differ from rank 0's: broadcast the "
                "buffers too (module.buffers())"
            )
        return (
            f"{at}: after wrapping, rank {r}'s parameters differ from rank 0's: broadcast every "
            "parameter (the frozen ones too) from rank 0 in __init__ (dist.broadcast(p, src=0))"
        )
    return None


def gradient_problem(run: dict, outs: list[dict]) -> str | None:
    """Whether every rank holds the big batch's gradient after the first ``finish()``."""
    atol, rtol = tolerances(run)
    mean, at = big_batch_gradient(run), where(run)
    for r, o in enumerate(outs):
        g = o["grads0"]
        if o["frozen_grad"]:
            return f"{at}: rank {r}'s frozen parameter (requires_grad=False) got a .grad"
        if same_state(g, mean, atol, rtol):
            continue
        if isinstance(g, dict) and any(bool(torch.isnan(v).all()) for v in g.values()):
            return f"{at}: after backward and finish(), rank {r} has parameters without .grad"
        return (
            f"{at}: after backward and finish(), rank {r}'s gradient is not the average over the "
            f"ranks, the gradient of the mean loss over all ranks' batches (max abs difference "
            f"{max_abs_diff(g, mean):.3g}): every gradient must be summed over the ranks, and "
            "divided by the world size once the sum has arrived"
        )
    return None


def weights_problem(run: dict, outs: list[dict]) -> str | None:
    """Whether every rank ends with DDP's weights."""
    atol, rtol = tolerances(run)
    expected = big_batch_sgd(run)
    for r, o in enumerate(outs):
        if not same_state(o["final"], expected, atol, rtol):
            return (
                f"{where(run)}: after {run['xs'][0].shape[0]} steps rank {r}'s weights differ "
                f"from DDP's (max abs difference {max_abs_diff(o['final'], expected):.3g}): "
                "every step must average the gradients, not only the first"
            )
    return None


def ideal_gain(spec: dict, messages: int) -> float:
    """What perfect overlap saves on the timing run: the backward compute that can hide
    the link's time, or the link's time that can hide behind it (all but the last message)."""
    compute = (spec["layers"] - 1) * spec["compute"]
    return min(compute, (messages - 1) * spec["latency"])


def timing_problem(spec: dict, measured: dict, what: str) -> str | None:
    """Whether the overlapped steps are measurably faster than the blocking ones."""
    ms = {k: 1000 * measured[k] for k in ("overlapped", "blocking")}
    gain, ideal = ms["blocking"] - ms["overlapped"], 1000 * ideal_gain(spec, len(measured["calls"]))
    if gain >= MIN_GAIN_SHARE * ideal:
        return None
    said = (
        f"on a slowed link ({1000 * spec['latency']:g} ms a message), a step took "
        f"{ms['overlapped']:.0f} ms, and {ms['blocking']:.0f} ms with every all-reduce made "
        f"to block: overlap saved {gain:.0f} ms of the {ideal:.0f} ms it can save"
    )
    calls = measured["calls"]
    if calls and not any(c[2] for c in calls):
        return f"{said}: start each all-reduce with async_op=True and wait in finish()"
    if calls and all(c[1] >= measured["end"] for c in calls):
        return (
            f"{said}: every all-reduce started after backward had ended: start {what} in the "
            "hook, as soon as it is ready, so that it travels while backward goes on"
        )
    return (
        f"{said}: do not wait for an all-reduce right after starting it (work.wait() in the "
        "hook): collect the works and wait for them in finish()"
    )
