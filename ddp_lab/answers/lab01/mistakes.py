"""Typical wrong answers of lab 1, and what the grader must say about each.

Each source replaces the whole solution cell (imports as in the release). The first
mistake of each exercise is the one the sample class's ``mistake`` student submits.
"""

from __future__ import annotations

from ddp_lab.answers import Mistake

MISTAKES = [
    # --- exercise 1: split_batch -----------------------------------------------------------
    Mistake(
        "ex1_split_batch",
        "drops_the_remainder",  # B // n samples per shard: the remainder B % n is lost
        """
import torch


def split_batch(x, y, n):
    size = x.shape[0] // n
    return [(x[k * size:(k + 1) * size], y[k * size:(k + 1) * size]) for k in range(n)]
""",
        "are lost",
    ),
    Mistake(
        "ex1_split_batch",
        "torch_chunk",
        """
import torch


def split_batch(x, y, n):
    return list(zip(torch.chunk(x, n), torch.chunk(y, n)))
""",
        "the sizes torch.chunk makes",
    ),
    Mistake(
        "ex1_split_batch",
        "last_shard_takes_the_remainder",
        """
def split_batch(x, y, n):
    size = x.shape[0] // n
    bounds = [k * size for k in range(n)] + [x.shape[0]]
    return [(x[s:e], y[s:e]) for s, e in zip(bounds, bounds[1:])]
""",
        "differ by more than one",
    ),
    Mistake(
        "ex1_split_batch",
        "shuffles",
        """
import torch


def split_batch(x, y, n):
    perm = torch.randperm(x.shape[0])
    sizes = [len(t) for t in torch.tensor_split(torch.arange(x.shape[0]), n)]
    return list(zip(torch.split(x[perm], sizes), torch.split(y[perm], sizes)))
""",
        "do not give back x",
    ),
    Mistake(
        "ex1_split_batch",
        "keeps_all_targets",
        """
import torch


def split_batch(x, y, n):
    return [(xk, y) for xk in torch.tensor_split(x, n)]
""",
        "inputs but",
    ),
    Mistake(
        "ex1_split_batch",
        "returns_a_tensor",
        """
def split_batch(x, y, n):
    return x  # forgot to split
""",
        "expected a list of",
    ),
    # --- exercise 2: average_gradients -----------------------------------------------------
    Mistake(
        "ex2_average_gradients",
        "sums",  # the gradient of n times the loss
        """
import torch


def average_gradients(grads_per_replica):
    return [torch.stack(grads).sum(0) for grads in zip(*grads_per_replica)]
""",
        "sum of the replicas' gradients",
    ),
    Mistake(
        "ex2_average_gradients",
        "keeps_replica_0",
        """
def average_gradients(grads_per_replica):
    return list(grads_per_replica[0])
""",
        "replica 0's gradients",
    ),
    Mistake(
        "ex2_average_gradients",
        "averages_over_parameters",
        """
def average_gradients(grads_per_replica):
    return [sum(g.sum() for g in grads) / len(grads) for grads in grads_per_replica]
""",
        "averaged gradient",
    ),
    # --- exercise 3: data_parallel_gradients -----------------------------------------------
    Mistake(
        "ex3_data_parallel_gradients",
        "plain_average",  # replicas done right, but a plain average over unequal shards
        """
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
        "plain average of the shard gradients",
    ),
    Mistake(
        "ex3_data_parallel_gradients",
        "sums_the_shards",
        """
import copy

import torch


def data_parallel_gradients(model, shards, loss_fn):
    out = [torch.zeros_like(p) for p in model.parameters()]
    for xk, yk in shards:
        replica = copy.deepcopy(model)
        loss_fn(replica(xk), yk).backward()
        for acc, p in zip(out, replica.parameters()):
            acc += p.grad
    return out
""",
        "sum of the shard gradients",
    ),
    Mistake(
        "ex3_data_parallel_gradients",
        "shares_the_model_and_accumulates",
        """
import torch


def data_parallel_gradients(model, shards, loss_fn):
    total = sum(len(xk) for xk, _ in shards)
    combined = [torch.zeros_like(p) for p in model.parameters()]
    for xk, yk in shards:
        loss_fn(model(xk), yk).backward()  # no copy, no zero_grad
        for acc, p in zip(combined, model.parameters()):
            acc += p.grad * (len(xk) / total)
    return combined
""",
        "expected the full-batch gradient",
    ),
    Mistake(
        "ex3_data_parallel_gradients",
        "leaves_gradients_in_the_model",
        """
import torch


def data_parallel_gradients(model, shards, loss_fn):
    total = sum(len(xk) for xk, _ in shards)
    combined = [torch.zeros_like(p) for p in model.parameters()]
    for xk, yk in shards:
        model.zero_grad()
        loss_fn(model(xk), yk).backward()
        for acc, p in zip(combined, model.parameters()):
            acc += p.grad * (len(xk) / total)
    return combined
""",
        "now holds gradients",
    ),
    # --- exercise 4: combine_shard_stats ---------------------------------------------------
    Mistake(
        "ex4_combine_shard_stats",
        "plain_averages",  # ignores the counts and the spread of the shard means
        """
import torch


def combine_shard_stats(means, variances, counts):
    return means.mean(0), variances.mean(0)
""",
        "plain average of the shard means",
    ),
    Mistake(
        "ex4_combine_shard_stats",
        "variance_without_the_spread_of_means",
        """
import torch


def combine_shard_stats(means, variances, counts):
    w = counts.to(means.dtype).unsqueeze(1) / counts.sum()
    return (w * means).sum(0), (w * variances).sum(0)
""",
        "leaves out how far the shard means lie",
    ),
    Mistake(
        "ex4_combine_shard_stats",
        "unbiased_variance",
        """
import torch


def combine_shard_stats(means, variances, counts):
    b = counts.sum()
    w = counts.to(means.dtype).unsqueeze(1) / b
    mean = (w * means).sum(0)
    var = (w * (variances + (means - mean) ** 2)).sum(0)
    return mean, var * b / (b - 1)
""",
        "unbiased variance",
    ),
    Mistake(
        "ex4_combine_shard_stats",
        "ignores_the_counts",
        """
import torch


def combine_shard_stats(means, variances, counts):
    mean = means.mean(0)
    return mean, (variances + (means - mean) ** 2).mean(0)
""",
        "plain average of the shard means",
    ),
    # --- exercise 5: dataparallel_step_time ------------------------------------------------
    Mistake(
        "ex5_dataparallel_step_time",
        "forgets_replication",  # the weights are copied to every device at every step
        """
def dataparallel_step_time(n, *, compute_s, param_bytes, batch_bytes, output_bytes,
                           bandwidth, host_s):
    reduce = (n - 1) * param_bytes / bandwidth
    scatter = (n - 1) / n * batch_bytes / bandwidth
    gather = 2 * (n - 1) / n * output_bytes / bandwidth
    return compute_s / n + reduce + scatter + gather + n * host_s
""",
        "leaves out a parameter transfer",
    ),
    Mistake(
        "ex5_dataparallel_step_time",
        "forgets_the_gil",
        """
def dataparallel_step_time(n, *, compute_s, param_bytes, batch_bytes, output_bytes,
                           bandwidth, host_s):
    return (compute_s / n + 2 * (n - 1) * param_bytes / bandwidth
            + (n - 1) / n * (batch_bytes + 2 * output_bytes) / bandwidth + host_s)
""",
        "the n threads launch one after another under the GIL: n * host_s",
    ),
    Mistake(
        "ex5_dataparallel_step_time",
        "gathers_outputs_once",
        """
def dataparallel_step_time(n, *, compute_s, param_bytes, batch_bytes, output_bytes,
                           bandwidth, host_s):
    return (compute_s / n + 2 * (n - 1) * param_bytes / bandwidth
            + (n - 1) / n * (batch_bytes + output_bytes) / bandwidth + n * host_s)
""",
        "their gradients go out again in backward",
    ),
]
