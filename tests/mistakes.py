"""Typical student mistakes, one per exercise, keyed by lab and solution cell ``grade_id``.

``MISTAKES[lab]`` replaces every solution cell of the release at once (the exercises of a
lab are independent, so each mistake must cost exactly its own exercise's points).
``HANGS[lab]`` replaces cells of the solutions with code whose torchrun job deadlocks;
``HANG_LOSES[lab]`` lists the test cells that hang costs. ``FORGED_FILES[lab]`` are result
files a cheating student writes by hand.
"""

from __future__ import annotations

MISTAKES: dict[str, dict[str, str]] = {
    "lab01_data_parallel": {
        # summing instead of averaging: the gradient of N * loss
        "ex1_average_gradients": """
def average_gradients(grads):
    import torch
    return [torch.stack(g).sum(0) for g in zip(*grads)]
""",
    },
}

HANGS: dict[str, dict[str, str]] = {}
HANG_LOSES: dict[str, list[str]] = {}
FORGED_FILES: dict[str, dict[str, str]] = {}
