"""Typical mistakes of lab 1, one per exercise (see tests/mistakes.py).

Each source replaces the whole solution cell; imports stay as in the release.
"""

LAB = "lab01_data_parallel"

MISTAKES = {
    # B // n samples per shard: the remainder B % n is silently dropped
    "ex1_split_batch": """
import torch


def split_batch(x, y, n):
    size = x.shape[0] // n
    return [(x[k * size:(k + 1) * size], y[k * size:(k + 1) * size]) for k in range(n)]
""",
    # summing instead of averaging: the gradient of n times the loss
    "ex2_average_gradients": """
import torch


def average_gradients(grads_per_replica):
    return [torch.stack(grads).sum(0) for grads in zip(*grads_per_replica)]
""",
    # replicas done right, but a plain average over unequal shards
    "ex3_data_parallel_gradients": """
import copy

import torch


def data_parallel_gradients(model, shards, loss_fn):
    per_replica = []
    for xk, yk in shards:
        replica = copy.deepcopy(model)
        replica.zero_grad()
        loss_fn(replica(xk), yk).backward()
        per_replica.append([p.grad for p in replica.parameters()])
    return [torch.stack(g).mean(0) for g in zip(*per_replica)]
""",
    # averaging the shard statistics: ignores the counts and the spread of the shard means
    "ex4_combine_shard_stats": """
import torch


def combine_shard_stats(means, variances, counts):
    return means.mean(0), variances.mean(0)
""",
    # forgets that the weights are replicated to every device at every step
    "ex5_dataparallel_step_time": """
def dataparallel_step_time(n, *, compute_s, param_bytes, batch_bytes, output_bytes,
                           bandwidth, host_s):
    reduce = (n - 1) * param_bytes / bandwidth
    scatter = (n - 1) / n * batch_bytes / bandwidth
    gather = 2 * (n - 1) / n * output_bytes / bandwidth
    return compute_s / n + reduce + scatter + gather + n * host_s
""",
}
