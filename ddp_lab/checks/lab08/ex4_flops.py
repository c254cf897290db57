"""Exercise 4, ``train_flops(layers, input_shape)``: the FLOPs of one training step of a
model, forward and backward, as ``torch.utils.flop_counter.FlopCounterMode`` counts them.

A model is a list of layer specs, run in order on an input of ``input_shape`` (batch first)
that needs no gradient:

- ``{"kind": "linear", "in": i, "out": o, "bias": bool, "frozen": bool}``: ``nn.Linear``
  on the last dimension (any number of leading dimensions);
- ``{"kind": "conv", "in": c, "out": o, "kernel": k, "stride": s, "padding": p, "bias":
  bool, "frozen": bool}``: ``nn.Conv2d`` (square kernel) on ``(batch, c, height, width)``;
- ``{"kind": "relu"}``, ``{"kind": "gelu"}``, ``{"kind": "flatten"}``: no FLOPs counted.

A frozen layer's parameters have ``requires_grad=False`` (fine-tuning). The student returns
``{"forward": int, "backward": int}``. The oracle builds the model from the specs and counts
with ``FlopCounterMode`` around its forward pass and around ``loss.backward()`` (the loss is
the sum of the output, which counts nothing).

Case set (every draw): an MLP on a single sample (batch 1, a layer without bias); an MLP on
``(batch, tokens, features)``; a CNN (a strided, padded 3x3 convolution on an odd-sized
input, a 1x1 convolution, flatten, linear); the same kind of CNN with its first convolution
frozen; an MLP with a middle layer frozen; a 5x5 convolution without padding on a
non-square input with a frozen last layer.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from ddp_lab.checks import runner
from ddp_lab.checks.contract import Exercise
from ddp_lab.checks.failure import CheckFailed
from ddp_lab.checks.lab08.common import LAB
from ddp_lab.checks.values import kind, randint

KEYS = ("forward", "backward")


def _linear(i: int, o: int, bias: bool = True, frozen: bool = False) -> dict:
    return {"kind": "linear", "in": i, "out": o, "bias": bias, "frozen": frozen}


def _conv(c: int, o: int, k: int, s: int, p: int, frozen: bool = False) -> dict:
    spec = {"kind": "conv", "in": c, "out": o, "kernel": k, "stride": s, "padding": p}
    return {**spec, "bias": True, "frozen": frozen}


def _conv_out(size: int, layer: dict) -> int:
    return (size + 2 * layer["padding"] - layer["kernel"]) // layer["stride"] + 1


def _cnn(gen, frozen_first: bool, batch: int) -> dict:
    """A strided padded 3x3 conv on an odd input, relu, a 1x1 conv, relu, flatten, linear."""
    c, h = randint(gen, 2, 4), 2 * randint(gen, 4, 8) + 1
    c1, c2 = randint(gen, 4, 8), randint(gen, 4, 8)
    first, second = _conv(c, c1, 3, 2, 1, frozen_first), _conv(c1, c2, 1, 1, 0)
    side = _conv_out(h, first)
    layers = [first, {"kind": "relu"}, second, {"kind": "relu"}, {"kind": "flatten"}]
    layers.append(_linear(c2 * side * side, randint(gen, 3, 10)))
    return {
        "name": "a CNN" + (" with its first convolution frozen" if frozen_first else ""),
        "layers": layers,
        "input_shape": [batch, c, h, h],
    }


def models(gen: torch.Generator) -> list[dict]:
    """The six models of every draw (see the module docstring)."""
    d, h1, h2, out = (randint(gen, 5, 40) for _ in range(4))
    single = {
        "name": "an MLP on one sample",
        "layers": [
            _linear(d, h1),
            {"kind": "relu"},
            _linear(h1, h2, bias=False),
            {"kind": "relu"},
            _linear(h2, out),
        ],
        "input_shape": [1, d],
    }
    d, h = randint(gen, 4, 24), randint(gen, 8, 48)
    tokens = {
        "name": "an MLP on (batch, tokens, features)",
        "layers": [_linear(d, h), {"kind": "gelu"}, _linear(h, d)],
        "input_shape": [randint(gen, 2, 5), randint(gen, 3, 9), d],
    }
    d, h = randint(gen, 5, 30), randint(gen, 5, 30)
    middle = {
        "name": "an MLP with its middle layer frozen",
        "layers": [
            _linear(d, h),
            {"kind": "relu"},
            _linear(h, h, frozen=True),
            {"kind": "relu"},
            _linear(h, randint(gen, 2, 9)),
        ],
        "input_shape": [randint(gen, 2, 16), d],
    }
    c, height, width = randint(gen, 1, 3), randint(gen, 9, 14), randint(gen, 15, 20)
    o = randint(gen, 2, 6)
    conv = _conv(c, o, 5, 1, 0)
    area = (height - 4) * (width - 4)
    wide = {
        "name": "a 5x5 convolution without padding on a non-square input, last layer frozen",
        "layers": [
            conv,
            {"kind": "relu"},
            {"kind": "flatten"},
            _linear(o * area, randint(gen, 2, 6), frozen=True),
        ],
        "input_shape": [randint(gen, 2, 4), c, height, width],
    }
    batch = randint(gen, 2, 6)
    return [single, tokens, _cnn(gen, False, batch), _cnn(gen, True, batch), middle, wide]


def make_inputs(gen: torch.Generator) -> dict:
    """Every model of the draw."""
    return {"cases": models(gen)}


def visible_inputs(gen: torch.Generator) -> dict:
    """The MLP on one sample, the CNN and the MLP with its middle layer frozen."""
    cases = models(gen)
    return {"cases": [cases[0], cases[2], cases[4]]}


def build(layers: list[dict]) -> nn.Module:
    """The model the specs describe (frozen layers with ``requires_grad=False``)."""
    modules = []
    for spec in layers:
        if spec["kind"] == "linear":
            m = nn.Linear(spec["in"], spec["out"], bias=spec["bias"])
        elif spec["kind"] == "conv":
            m = nn.Conv2d(
                spec["in"],
                spec["out"],
                spec["kernel"],
                spec["stride"],
                spec["padding"],
                bias=spec["bias"],
            )
        else:
            m = {"relu": nn.ReLU, "gelu": nn.GELU, "flatten": nn.Flatten}[spec["kind"]]()
        m.requires_grad_(not spec.get("frozen", False))
        modules.append(m)
    return nn.Sequential(*modules)


def counted(case: dict) -> dict[str, int]:
    """The oracle: ``FlopCounterMode`` around a real forward pass and its backward pass."""
    torch.manual_seed(0)
    model = build(case["layers"])
    x = torch.randn(*case["input_shape"])
    with FlopCounterMode(display=False) as fwd:
        loss = model(x).sum()
    with FlopCounterMode(display=False) as bwd:
        loss.backward()
    return {"forward": fwd.get_total_flops(), "backward": bwd.get_total_flops()}


def run(ns: dict, inputs: dict, workdir) -> dict:
    """The student's ``train_flops`` on every case."""
    fn = ns["train_flops"]
    out = []
    for case in inputs["cases"]:
        got = fn([dict(layer) for layer in case["layers"]], list(case["input_shape"]))
        out.append(
            {k: got[k] for k in KEYS} if isinstance(got, dict) and set(KEYS) <= set(got) else got
        )
    return {"results": out}


def _whole(value) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def case_problem(case: dict, got, want: dict[str, int]) -> str | None:
    """What is wrong with one case's result, or None."""
    shape = "x".join(map(str, case["input_shape"]))
    what = f"train_flops for {case['name']} (input {shape})"
    if not isinstance(got, dict) or set(KEYS) - set(got):
        return f"{what}: expected a dict with keys 'forward' and 'backward', got {kind(got)}"
    for key in KEYS:
        value = _whole(got[key])
        if value is None:
            return f"{what}: {key!r} must be a whole number of FLOPs, got {got[key]!r}"
        if value != want[key]:
            return (
                f"{what}: {key} FLOPs should be {want[key]:,} (FlopCounterMode on the real "
                f"model), got {value:,} ({value / want[key]:.3g} times)"
                if want[key]
                else f"{what}: {key} FLOPs should be 0, got {value:,}"
            )
    return None


def judge(inputs: dict, outputs: dict) -> str:
    """Every case against ``FlopCounterMode`` on the real model."""
    results = outputs.get("results")
    if not isinstance(results, list) or len(results) != len(inputs["cases"]):
        raise CheckFailed("expected one result per model")
    for case, got in zip(inputs["cases"], results, strict=True):
        if why := case_problem(case, got, counted(case)):
            raise CheckFailed(why)
    return (
        f"train_flops equals FlopCounterMode on {len(results)} real models, forward and "
        "backward (linear and convolutional layers, frozen layers, 2-D and 3-D inputs)"
    )


def parameters(layers: list[dict]) -> int:
    """The number of parameters of a model's specs (for the figures and the prose)."""
    return sum(p.numel() for p in build(layers).parameters())


def output_shape(case: dict) -> list[int]:
    """The shape the model returns (run on a real tensor)."""
    with torch.no_grad():
        return list(build(case["layers"])(torch.zeros(*case["input_shape"])).shape)


EXERCISE = Exercise(
    "test_ex4_flops",
    ("ex4_flops",),
    "the FLOPs of a training step, forward and backward",
    make_inputs,
    judge,
    run=run,
    visible_inputs=visible_inputs,
)


def visible(fn) -> None:
    """Visible check of exercise 4: an MLP on one sample, a CNN and an MLP with a frozen
    middle layer, against ``FlopCounterMode``."""
    runner.visible(LAB, "test_ex4_flops", functions={"train_flops": fn})
