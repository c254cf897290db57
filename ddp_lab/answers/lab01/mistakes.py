"""Typical wrong answers of lab 1, and what the grader must say about each.

Each source replaces the whole solution cell (imports as in the release), written the way a
student would write it. The first mistake of each exercise is the one the sample class's
``mistake`` student submits. Exercise 3 keeps its own in
:mod:`ddp_lab.answers.lab01.mistakes_forward`, exercises 4 and 5 theirs in
:mod:`ddp_lab.answers.lab01.mistakes_stats_cost`.
"""

from __future__ import annotations

from ddp_lab.answers import Mistake
from ddp_lab.answers.lab01.mistakes_forward import EX3
from ddp_lab.answers.lab01.mistakes_stats_cost import EX4, EX5

_EX1 = [
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
        "last_shard_takes_the_remainder",  # a remainder of 1: balanced, but the last shard
        """
def split_batch(x, y, n):
    size = x.shape[0] // n
    bounds = [k * size for k in range(n)] + [x.shape[0]]
    return [(x[s:e], y[s:e]) for s, e in zip(bounds, bounds[1:])]
""",
        "take one sample more",
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
    Mistake(
        "ex1_split_batch",
        "skips_empty_shards",  # fine until there are more replicas than samples
        """
import torch


def split_batch(x, y, n):
    index = torch.arange(x.shape[0])
    parts = [p for p in index.tensor_split(n) if len(p) > 0]
    return [(x[p], y[p]) for p in parts]
""",
        "get an empty shard",
    ),
    Mistake(
        "ex1_split_batch",
        "remainder_at_the_end",  # sizes within one, but the first shards are the short ones
        """
def split_batch(x, y, n):
    b = x.shape[0]
    bounds = [k * b // n for k in range(n + 1)]
    return [(x[s:e], y[s:e]) for s, e in zip(bounds, bounds[1:])]
""",
        "take one sample more",
    ),
    Mistake(
        "ex1_split_batch",
        "extra_samples_to_the_last_shards",  # with n > B the first shards come out empty
        """
import torch


def split_batch(x, y, n):
    base, extra = divmod(x.shape[0], n)
    sizes = [base + 1 if k >= n - extra else base for k in range(n)]
    return list(zip(torch.split(x, sizes), torch.split(y, sizes)))
""",
        "empty shards are the last ones",
    ),
]

_EX2 = [
    Mistake(
        "ex2_data_parallel_step",
        "plain_average",  # replicas done right, but every shard counts the same
        """
import copy

import torch


def data_parallel_step(model, shards, loss_fn, lr):
    grads, losses = [], []
    for xk, yk in shards:
        replica = copy.deepcopy(model)
        replica.zero_grad()
        out = loss_fn(replica(xk), yk)
        out.backward()
        losses.append(out.item())
        grads.append([p.grad.clone() for p in replica.parameters()])
    avg = [torch.stack(g).mean(dim=0) for g in zip(*grads)]
    with torch.no_grad():
        for p, g in zip(model.parameters(), avg):
            p.grad = g
            p.sub_(lr * g)
    return sum(losses) / len(losses)
""",
        "plain average of the shard gradients",
    ),
    Mistake(
        "ex2_data_parallel_step",
        "sums_the_shards",
        """
import copy

import torch


def data_parallel_step(model, shards, loss_fn, lr):
    total_loss = 0
    summed = None
    for x_k, y_k in shards:
        if len(x_k) == 0:
            continue
        r = copy.deepcopy(model)
        l = loss_fn(r(x_k), y_k)
        g = torch.autograd.grad(l, list(r.parameters()))
        summed = list(g) if summed is None else [a + b for a, b in zip(summed, g)]
        total_loss += l.item()
    for p, g in zip(model.parameters(), summed):
        p.grad = g
        p.data -= lr * g
    return total_loss
""",
        "sum of the shard gradients",
    ),
    Mistake(
        "ex2_data_parallel_step",
        "accumulates_onto_the_stale_grad",
        """
import torch


def data_parallel_step(model, shards, loss_fn, lr):
    n_total = sum(len(t) for _, t in shards)
    running = 0.0
    for inputs, targets in shards:
        if not len(targets):
            continue
        piece = loss_fn(model(inputs), targets) * (len(targets) / n_total)
        piece.backward()  # the shards' gradients add up in model's .grad
        running += float(piece)
    with torch.no_grad():
        for w in model.parameters():
            w -= lr * w.grad
    return running
""",
        "the one the model arrived with",
    ),
    Mistake(
        "ex2_data_parallel_step",
        "steps_after_each_shard",
        """
import copy

import torch


def data_parallel_step(model, shards, loss_fn, lr):
    B = sum(y.shape[0] for _, y in shards)
    loss_total = 0.0
    for xb, yb in shards:
        if yb.shape[0] == 0:
            continue
        replica = copy.deepcopy(model)
        loss = loss_fn(replica(xb), yb)
        loss.backward()
        frac = yb.shape[0] / B
        loss_total += frac * loss.item()
        with torch.no_grad():
            for p, q in zip(model.parameters(), replica.parameters()):
                p.grad = frac * q.grad
                p -= lr * p.grad
    return loss_total
""",
        "start from the same weights",
    ),
    Mistake(
        "ex2_data_parallel_step",
        "runs_the_empty_shards",
        """
import copy

import torch


def data_parallel_step(model, shards, loss_fn, lr):
    sizes = [len(y) for _, y in shards]
    B = sum(sizes)
    new_grads = [torch.zeros_like(p) for p in model.parameters()]
    loss_value = 0.0
    for (x, y), size in zip(shards, sizes):
        rep = copy.deepcopy(model)
        l = loss_fn(rep(x), y)
        rep_grads = torch.autograd.grad(l, tuple(rep.parameters()))
        for acc, g in zip(new_grads, rep_grads):
            acc.add_(g, alpha=size / B)
        loss_value += l.item() * size / B
    for p, g in zip(model.parameters(), new_grads):
        p.grad = g
        p.data.add_(g, alpha=-lr)
    return loss_value
""",
        "replicas with no data",
    ),
    Mistake(
        "ex2_data_parallel_step",
        "one_pass_over_the_whole_batch",
        """
import torch


def data_parallel_step(model, shards, loss_fn, lr):
    x = torch.cat([s[0] for s in shards])
    y = torch.cat([s[1] for s in shards])
    model.zero_grad()
    loss = loss_fn(model(x), y)
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad
    return loss.item()
""",
        "run one replica per shard",
    ),
    Mistake(
        "ex2_data_parallel_step",
        "plain_average_of_the_losses",
        """
import copy

import torch


def data_parallel_step(model, shards, loss_fn, lr):
    total = sum(len(y) for _, y in shards)
    grads = [torch.zeros_like(p) for p in model.parameters()]
    losses = []
    for x, y in shards:
        if len(y):
            replica = copy.deepcopy(model)
            loss = loss_fn(replica(x), y)
            loss.backward()
            losses.append(loss.item())
            for g, p in zip(grads, replica.parameters()):
                g += p.grad * len(y) / total
    with torch.no_grad():
        for p, g in zip(model.parameters(), grads):
            p.grad = g
            p -= lr * g
    return sum(losses) / len(losses)
""",
        "plain average of the replicas' losses",
    ),
    Mistake(
        "ex2_data_parallel_step",
        "steps_without_the_grad",
        """
import copy

import torch


def data_parallel_step(model, shards, loss_fn, lr):
    total = sum(len(y) for _, y in shards)
    grads = [torch.zeros_like(p) for p in model.parameters()]
    loss = 0.0
    for x, y in shards:
        if len(y):
            replica = copy.deepcopy(model)
            part = loss_fn(replica(x), y) * len(y) / total
            part.backward()
            loss += part.item()
            for g, p in zip(grads, replica.parameters()):
                g += p.grad
    with torch.no_grad():
        for p, g in zip(model.parameters(), grads):
            p -= lr * g
    return loss
""",
        "still holds the gradient the model arrived with",
    ),
    Mistake(
        "ex2_data_parallel_step",
        "returns_the_loss_as_a_tensor",  # right numbers, but a tensor where a float is promised
        """
import copy

import torch


def data_parallel_step(model, shards, loss_fn, lr):
    total = sum(len(yk) for _, yk in shards)
    summed = [torch.zeros_like(p) for p in model.parameters()]
    loss = torch.zeros(())
    for xk, yk in shards:
        if len(yk) == 0:
            continue
        replica = copy.deepcopy(model)
        part = loss_fn(replica(xk), yk) * (len(yk) / total)
        part.backward()
        loss = loss + part.detach()
        for acc, p in zip(summed, replica.parameters()):
            acc += p.grad
    with torch.no_grad():
        for p, g in zip(model.parameters(), summed):
            p.grad = g
            p -= lr * g
    return loss
""",
        "the docstring promises a float",
    ),
]

MISTAKES = [*_EX1, *_EX2, *EX3, *EX4, *EX5]
