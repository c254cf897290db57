"""What lab 1's exercises share: the lab's name and the tolerances of its comparisons."""

from __future__ import annotations

LAB = "lab01_data_parallel"

# Tensors are compared with float64 oracles, to float32 precision: tight enough to reject
# every wrong formula (they are off by 1e-3 or more), loose enough for a right answer that
# computes in float32 somewhere (``counts.float()``, ``torch.zeros(shape)`` accumulators).
ATOL, RTOL = 1e-6, 1e-5
