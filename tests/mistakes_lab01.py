"""Typical mistakes of lab 1 (see tests/mistakes.py). PILOT - being extended."""

LAB = "lab01_data_parallel"

MISTAKES = {
    # summing instead of averaging: the gradient of N * loss
    "ex1_average_gradients": '''
def average_gradients(grads):
    import torch
    return [torch.stack(g).sum(0) for g in zip(*grads)]
''',
}
