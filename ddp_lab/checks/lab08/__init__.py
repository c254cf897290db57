"""Checks of lab 8 (profiling and performance): four exercises, 14 points (and three
written answers, 6 points, graded by hand).

1. ``step_breakdown(events)`` (4): per profiled step of one rank's trace, the compute, the
   communication and the exposed communication; judged on real DDP traces recorded at
   grading time (bucket size and link drawn per job) and on synthetic ones for the edge
   cases, against the checker's own reading of the same events;
2. ``find_straggler(traces)`` (3): the slow rank and its slow phase, from every rank's
   trace of real jobs recorded at grading time (the truth sealed from the student);
3. ``make_compress_hook(dtype)`` (4, file ``compress.py``, every rank): a DDP communication
   hook that compresses to fp16 or bf16, judged against PyTorch's own ``default_hooks`` bit
   for bit and by the collectives it calls;
4. ``train_flops(layers, input_shape)`` (3): the FLOPs of a training step, against
   ``FlopCounterMode`` on the real model.

One file per exercise holds its contract; :mod:`~ddp_lab.checks.lab08.jobs` launches the
real jobs (:mod:`~ddp_lab.checks.lab08.trace_jobs`, :mod:`~ddp_lab.checks.lab08.straggler_jobs`).
The functions below are the notebook's visible checks; the grader runs the same contracts
on inputs drawn at grading time.

Example:
    >>> from ddp_lab.checks import lab08 as checks
    >>> checks.train_flops(train_flops)  # doctest: +SKIP
    OK: train_flops equals FlopCounterMode on 3 real models ...
"""

from __future__ import annotations

from ddp_lab.checks import runner
from ddp_lab.checks.lab08 import ex1_step_breakdown, ex2_straggler, ex3_compress_hook, ex4_flops
from ddp_lab.checks.lab08.common import LAB

__all__ = [
    "EXERCISES",
    "GRADING",
    "LAB",
    "compress_hook",
    "step_breakdown",
    "straggler",
    "train_flops",
]

#: The exercises, in the order of the notebook's test cells.
EXERCISES = [
    ex1_step_breakdown.EXERCISE,
    ex2_straggler.EXERCISE,
    ex3_compress_hook.EXERCISE,
    ex4_flops.EXERCISE,
]

#: True while ``nbgrader autograde`` runs the notebook: the notebook then skips its
#: demonstrations (the grader judges the exercises outside the kernel).
GRADING = runner.grading()

step_breakdown = ex1_step_breakdown.visible
straggler = ex2_straggler.visible
compress_hook = ex3_compress_hook.visible
train_flops = ex4_flops.visible
