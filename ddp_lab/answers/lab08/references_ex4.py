"""Lab 8's reference answer to exercise 4 (instructor only): the FLOPs of a training step."""

from __future__ import annotations

import math


def train_flops(layers, input_shape):
    """FLOPs of one forward and one backward pass, counted as FlopCounterMode counts them."""
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
        backward += cost * (upstream + trainable)  # input's gradient, weight's gradient
        upstream = upstream or trainable
    return {"forward": forward, "backward": backward}
