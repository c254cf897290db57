"""Lab 8, exercise 4 (instructor only): the grader's additions, the solution cell and the
typical mistakes of ``train_flops``.

The hidden check compares with the reference's count; a wrong answer is matched against
twins of the reference with one flaw each (multiply-adds instead of FLOPs, the backward as
twice the forward everywhere, convolutions without stride and padding, frozen layers
trained, the tokens of a 3-D input left out, bias additions counted) and against the
``6 x parameters x batch`` rule of thumb.
"""

from __future__ import annotations

import math

from ddp_lab.answers import Hidden, Mistake
from ddp_lab.answers.lab08.references_ex4 import train_flops
from ddp_lab.checks.failure import CheckFailed
from ddp_lab.checks.lab08 import ex4_flops as ex4

GRADE_ID = "test_ex4_flops"


def _twin(layers, input_shape, flaw: str) -> dict:
    """The reference's count with one typical flaw."""
    shape = list(input_shape)
    forward = backward = 0
    upstream = False
    for layer in layers:
        if layer["kind"] == "flatten":
            shape = [shape[0], math.prod(shape[1:])]
            continue
        if layer["kind"] == "linear":
            rows = shape[0] if flaw == "batch_only" else math.prod(shape[:-1])
            cost = 2 * rows * layer["in"] * layer["out"]
            if flaw == "bias" and layer["bias"]:
                cost += rows * layer["out"]
            shape = shape[:-1] + [layer["out"]]
        elif layer["kind"] == "conv":
            k, s, p = layer["kernel"], layer["stride"], layer["padding"]
            if flaw == "no_stride":
                s, p = 1, (k - 1) // 2
            h, w = ((n + 2 * p - k) // s + 1 for n in shape[2:])
            shape = [shape[0], layer["out"], h, w]
            cost = 2 * math.prod(shape) * layer["in"] * k * k
        else:
            continue
        if flaw == "macs":
            cost //= 2
        trainable = flaw == "frozen" or not layer.get("frozen", False)
        forward += cost
        if flaw == "twice":
            backward += 2 * cost
        else:
            backward += cost * (upstream + trainable)
        upstream = upstream or trainable
    return {"forward": forward, "backward": backward}


def _rule_of_thumb(case: dict) -> dict:
    n = ex4.parameters(case["layers"])
    return {"forward": 2 * n * case["input_shape"][0], "backward": 4 * n * case["input_shape"][0]}


#: flaw -> what the diagnosis says (the mistakes' reasons are fragments of these)
FLAWS = {
    "rule": "you counted 6 x parameters x batch (2 forward, 4 backward): a convolution reuses "
    "each weight at every output position, a 3-D input at every token, and the first layer "
    "computes no input gradient",
    "macs": "you counted multiply-adds: FlopCounterMode counts 2 FLOPs per multiply-add",
    "twice": "your backward is twice the forward on every layer: the first layer's input "
    "gradient is never computed (its input needs no gradient), nor any frozen layer's weight "
    "gradient",
    "no_stride": "your convolutions ignore stride and padding: the output size is "
    "(size + 2 padding - kernel) // stride + 1",
    "frozen": "you counted the weight gradients of frozen layers: autograd computes no "
    "gradient for a parameter with requires_grad=False (and no input gradient before the "
    "first layer that trains)",
    "batch_only": "a linear layer on (batch, tokens, features) multiplies every leading "
    "dimension: you counted the batch only",
    "bias": "you counted the bias additions of the linear layers: FlopCounterMode counts "
    "the matmul and the convolution only",
}


def _results(outputs: dict) -> list:
    return [
        {k: r.get(k) for k in ex4.KEYS} if isinstance(r, dict) else r
        for r in outputs.get("results", [])
    ]


def check(inputs: dict, outputs: dict) -> None:
    for case, got in zip(inputs["cases"], _results(outputs), strict=True):
        want = train_flops(case["layers"], case["input_shape"])
        if why := ex4.case_problem(case, got, want):
            raise CheckFailed(why)


def explain(inputs: dict, outputs: dict) -> str | None:
    got = _results(outputs)
    if len(got) != len(inputs["cases"]):
        return None
    for flaw, why in FLAWS.items():
        twins = [
            _rule_of_thumb(c) if flaw == "rule" else _twin(c["layers"], c["input_shape"], flaw)
            for c in inputs["cases"]
        ]
        if all(g == t for g, t in zip(got, twins, strict=True)):
            return f"train_flops: {why}"
    for case, g in zip(inputs["cases"], got, strict=True):
        if isinstance(g, dict) and g.get("backward") in (0, g.get("forward")):
            want = train_flops(case["layers"], case["input_shape"])
            if g.get("forward") == want["forward"] and want["backward"] != g.get("backward"):
                return (
                    f"train_flops for {case['name']}: the forward is right, the backward is "
                    f"{g.get('backward'):,} instead of {want['backward']:,}: backward computes "
                    "a gradient for the input and one for the weight of each layer that needs "
                    "them, each a matmul of the forward's size"
                )
    return None


HIDDEN = {GRADE_ID: Hidden(check=check, explain=explain)}

SOLUTION_CELL = '''def train_flops(layers, input_shape):
    """FLOPs of one training step (forward, then backward of a loss) of the model described by
    ``layers``, run on an input of ``input_shape`` (batch first) that needs no gradient,
    counted as torch.utils.flop_counter.FlopCounterMode counts them: matrix multiplications
    and convolutions only (2 FLOPs per multiply-add), nothing for activations, bias
    additions or the loss.

    Args:
        layers: a list of dicts, applied in order:
            {"kind": "linear", "in": i, "out": o, "bias": bool, "frozen": bool}: nn.Linear on
                the last dimension (the input may have any number of leading dimensions);
            {"kind": "conv", "in": c, "out": o, "kernel": k, "stride": s, "padding": p,
                "bias": bool, "frozen": bool}: nn.Conv2d with a k x k kernel on
                (batch, c, height, width);
            {"kind": "relu"}, {"kind": "gelu"}, {"kind": "flatten"} (flatten keeps the batch
                dimension and joins the others).
            A frozen layer's parameters have requires_grad=False.
        input_shape: the input's shape, a list of ints.

    Returns:
        {"forward": int, "backward": int}.

    Example:
        >>> train_flops([{"kind": "linear", "in": 3, "out": 2, "bias": True,
        ...               "frozen": False}], [4, 3])
        {'forward': 48, 'backward': 48}
    """
    ### BEGIN SOLUTION
    import math

    shape = list(input_shape)
    forward = backward = 0
    upstream = False  # does a layer before this one need a gradient?
    for layer in layers:
        if layer["kind"] == "flatten":
            shape = [shape[0], math.prod(shape[1:])]
            continue
        if layer["kind"] == "linear":
            rows = math.prod(shape[:-1])  # every leading dimension is a row of the matmul
            cost = 2 * rows * layer["in"] * layer["out"]
            shape = shape[:-1] + [layer["out"]]
        elif layer["kind"] == "conv":
            k, s, p = layer["kernel"], layer["stride"], layer["padding"]
            h, w = ((n + 2 * p - k) // s + 1 for n in shape[2:])
            shape = [shape[0], layer["out"], h, w]
            cost = 2 * math.prod(shape) * layer["in"] * k * k  # one dot product per output
        else:
            continue  # activations: no matmul
        trainable = not layer.get("frozen", False)
        forward += cost
        backward += cost * (upstream + trainable)  # the input's gradient, the weight's
        upstream = upstream or trainable
    return {"forward": forward, "backward": backward}
    ### END SOLUTION'''

# --- mistakes: the first is the sample class's, written as a student who learnt "6N" would ---

_RULE = """def train_flops(layers, input_shape):
    # the rule from the scaling-law papers: 6 FLOPs per parameter per sample,
    # 2 in the forward pass and 4 in the backward pass
    n_params = 0
    for spec in layers:
        if spec["kind"] == "linear":
            n_params += spec["in"] * spec["out"] + (spec["out"] if spec["bias"] else 0)
        elif spec["kind"] == "conv":
            n_params += spec["out"] * spec["in"] * spec["kernel"] ** 2 + spec["out"]
    batch = input_shape[0]
    return {"forward": 2 * n_params * batch, "backward": 4 * n_params * batch}
"""

_WALK = """def train_flops(layers, input_shape):
    dims = list(input_shape)
    fwd, bwd = 0, 0
    needs_grad_before = False
    for L in layers:
        if L["kind"] == "linear":
            m = {rows}
            flops = {factor}m * L["in"] * L["out"]{bias}
            dims = dims[:-1] + [L["out"]]
        elif L["kind"] == "conv":
{conv}
            dims = [dims[0], L["out"], oh, ow]
            flops = {factor}dims[0] * L["out"] * oh * ow * L["in"] * L["kernel"] ** 2
        elif L["kind"] == "flatten":
            n = 1
            for d in dims[1:]:
                n *= d
            dims = [dims[0], n]
            continue
        else:
            continue
        fwd += flops
{backward}
    return {{"forward": fwd, "backward": bwd}}
"""
_ROWS = "1\n            for d in dims[:-1]:\n                m *= d"
_CONV = (
    '            oh = (dims[2] + 2 * L["padding"] - L["kernel"]) // L["stride"] + 1\n'
    '            ow = (dims[3] + 2 * L["padding"] - L["kernel"]) // L["stride"] + 1'
)
_NO_STRIDE = "            oh, ow = dims[2], dims[3]"
_BACKWARD = (
    '        if not L["frozen"]:\n            bwd += flops  # weight gradient\n'
    "        if needs_grad_before:\n            bwd += flops  # input gradient\n"
    '        needs_grad_before = needs_grad_before or not L["frozen"]'
)


def _walk(rows=_ROWS, factor="2 * ", bias="", conv=_CONV, backward=_BACKWARD) -> str:
    return _WALK.format(rows=rows, factor=factor, bias=bias, conv=conv, backward=backward)


CELL = "ex4_flops"
MISTAKES = [
    Mistake(CELL, "typical", _RULE, "6 x parameters x batch"),
    Mistake(CELL, "multiply_adds", _walk(factor=""), "you counted multiply-adds"),
    Mistake(
        CELL,
        "backward_twice_forward",
        _walk(backward="        bwd += 2 * flops"),
        "the first layer's input gradient is never computed",
    ),
    Mistake(CELL, "ignores_stride_padding", _walk(conv=_NO_STRIDE), "ignore stride and padding"),
    Mistake(
        CELL,
        "frozen_layers_trained",
        _walk(
            backward="        bwd += flops * (2 if needs_grad_before else 1)\n"
            "        needs_grad_before = True"
        ),
        "weight gradients of frozen layers",
    ),
    Mistake(CELL, "batch_only", _walk(rows="dims[0]"), "you counted the batch only"),
    Mistake(
        CELL, "bias_counted", _walk(bias=' + (m * L["out"] if L["bias"] else 0)'), "bias additions"
    ),
]
