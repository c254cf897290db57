"""Typical wrong answers of lab 1's exercises 4 (shard statistics) and 5 (the cost model).

Written the way a student would write them; collected with the others in
:mod:`ddp_lab.answers.lab01.mistakes`.
"""

from __future__ import annotations

from ddp_lab.answers import Mistake

EX4 = [
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
    Mistake(
        "ex4_combine_shard_stats",
        "sum_of_squares",  # E[x^2] - mean^2: right on paper, lost to rounding far from 0
        """
import torch


def combine_shard_stats(means, variances, counts):
    ok = counts > 0
    c = counts[ok].to(means.dtype)[:, None]
    total = c.sum()
    mean = (c * means[ok]).sum(0) / total
    square = (c * (variances[ok] + means[ok] ** 2)).sum(0) / total
    return mean, square - mean ** 2
""",
        "subtracts two large numbers",
    ),
    Mistake(
        "ex4_combine_shard_stats",
        "sum_of_squares_in_float64",  # float64 does not save it when the data is far enough
        """
import torch


def combine_shard_stats(means, variances, counts):
    ok = counts > 0
    m, v = means[ok].double(), variances[ok].double()
    c = counts[ok].double()[:, None]
    mean = (c * m).sum(0) / c.sum()
    var = (c * (v + m * m)).sum(0) / c.sum() - mean * mean
    return mean.to(means.dtype), var.to(means.dtype)
""",
        "subtracts two large numbers",
    ),
    Mistake(
        "ex4_combine_shard_stats",
        "nan_from_empty_shards",
        """
import torch


def combine_shard_stats(means, variances, counts):
    share = counts.to(means.dtype)[:, None] / counts.sum()
    mean = (share * means).sum(0)
    spread = (means - mean) ** 2
    return mean, (share * (variances + spread)).sum(0)
""",
        "holds NaN",
    ),
    Mistake(
        "ex4_combine_shard_stats",
        "computes_in_float64",  # safe and exact, but hands back float64 for float32 shards
        """
import torch


def combine_shard_stats(means, variances, counts):
    keep = counts > 0
    m, v = means[keep].double(), variances[keep].double()
    w = counts[keep].double().unsqueeze(1) / counts.sum()
    mean = (w * m).sum(0)
    return mean, (w * (v + (m - mean) ** 2)).sum(0)
""",
        "the dtype of means",
    ),
]

EX5 = [
    Mistake(
        "ex5_dataparallel_step_time",
        "sends_a_copy_to_each_device",  # the textbook model: (n - 1) copies each way
        """
def dataparallel_step_time(n, *, compute_s, param_bytes, batch_bytes, output_bytes,
                           bandwidth, host_s, chunk_bytes):
    t = compute_s / n + n * host_s
    for device in range(1, n):
        t += param_bytes / bandwidth  # the weights to this device
        t += param_bytes / bandwidth  # its gradients back to device 0
    t += (n - 1) / n * (batch_bytes + 2 * output_bytes) / bandwidth
    return t
""",
        "one full copy per device",
    ),
    Mistake(
        "ex5_dataparallel_step_time",
        "ignores_the_pipeline_fill",
        """
def dataparallel_step_time(n, *, compute_s, param_bytes, batch_bytes, output_bytes,
                           bandwidth, host_s, chunk_bytes):
    if n == 1:
        return compute_s + host_s
    weights = param_bytes / bandwidth  # chunks flow through the chain back to back
    data = (n - 1) / n * (batch_bytes + 2 * output_bytes) / bandwidth
    return compute_s / n + 2 * weights + data + n * host_s
""",
        "n - 2",
    ),
    Mistake(
        "ex5_dataparallel_step_time",
        "a_small_model_as_a_whole_chunk",
        """
def dataparallel_step_time(n, *, compute_s, param_bytes, batch_bytes, output_bytes,
                           bandwidth, host_s, chunk_bytes):
    if n == 1:
        return compute_s + host_s
    chain = (param_bytes + (n - 2) * chunk_bytes) / bandwidth
    moved = (n - 1) / n * (batch_bytes + 2 * output_bytes) / bandwidth
    return compute_s / n + 2 * chain + moved + n * host_s
""",
        "smaller than one chunk",
    ),
    Mistake(
        "ex5_dataparallel_step_time",
        "forgets_the_reduce",
        """
def dataparallel_step_time(n, *, compute_s, param_bytes, batch_bytes, output_bytes,
                           bandwidth, host_s, chunk_bytes):
    if n == 1:
        return compute_s + host_s
    piece = min(chunk_bytes, param_bytes)
    broadcast = (param_bytes + (n - 2) * piece) / bandwidth
    moved = (n - 1) / n * (batch_bytes + 2 * output_bytes) / bandwidth
    return compute_s / n + broadcast + moved + n * host_s
""",
        "the gradients come back",
    ),
    Mistake(
        "ex5_dataparallel_step_time",
        "forgets_the_gil",
        """
def dataparallel_step_time(n, *, compute_s, param_bytes, batch_bytes, output_bytes,
                           bandwidth, host_s, chunk_bytes):
    if n == 1:
        return compute_s + host_s
    piece = min(chunk_bytes, param_bytes)
    broadcast = (param_bytes + (n - 2) * piece) / bandwidth
    moved = (n - 1) / n * (batch_bytes + 2 * output_bytes) / bandwidth
    return compute_s / n + 2 * broadcast + moved + host_s
""",
        "n * host_s",
    ),
    Mistake(
        "ex5_dataparallel_step_time",
        "gathers_outputs_once",
        """
def dataparallel_step_time(n, *, compute_s, param_bytes, batch_bytes, output_bytes,
                           bandwidth, host_s, chunk_bytes):
    if n == 1:
        return compute_s + host_s
    piece = min(chunk_bytes, param_bytes)
    broadcast = (param_bytes + (n - 2) * piece) / bandwidth
    moved = (n - 1) / n * (batch_bytes + output_bytes) / bandwidth
    return compute_s / n + 2 * broadcast + moved + n * host_s
""",
        "their gradients go out again",
    ),
]
