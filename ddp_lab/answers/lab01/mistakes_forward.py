"""Typical wrong answers of lab 1's exercise 3 (``data_parallel_forward``), written the way a
student would write them; the first is the sample class's. Collected in
:data:`ddp_lab.answers.lab01.mistakes.MISTAKES`.
"""

from __future__ import annotations

from ddp_lab.answers import Mistake

EX3 = [
    Mistake(
        "ex3_data_parallel_forward",
        "deepcopy_replicas",  # outputs right, but module never receives a gradient
        """
import copy
import threading

import torch


def data_parallel_forward(module, x, n):
    chunks = x.chunk(n)
    copies = [copy.deepcopy(module) for _ in chunks]
    results = {}

    def run(i):
        results[i] = copies[i](chunks[i])

    workers = [threading.Thread(target=run, args=(i,)) for i in range(len(chunks))]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return torch.cat([results[i] for i in range(len(chunks))])
""",
        "not connected to module's in autograd",
    ),
    Mistake(
        "ex3_data_parallel_forward",
        "one_thread",
        """
import copy

import torch


def data_parallel_forward(module, x, n):
    outs = []
    for piece in torch.chunk(x, n):
        replica = copy.deepcopy(module)
        weights = {name: w.clone() for name, w in module.named_parameters()}
        outs.append(torch.func.functional_call(replica, weights, (piece,)))
    return torch.cat(outs)
""",
        "parallel_apply starts one thread per replica",
    ),
    Mistake(
        "ex3_data_parallel_forward",
        "threads_share_the_module",
        """
import threading

import torch


def data_parallel_forward(module, x, n):
    pieces = torch.chunk(x, n)
    outs = [None] * len(pieces)

    def job(i):
        outs[i] = module(pieces[i])

    ts = [threading.Thread(target=job, args=(i,)) for i in range(len(pieces))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return torch.cat(outs)
""",
        "own parameter tensors",
    ),
    Mistake(
        "ex3_data_parallel_forward",
        "drops_the_remainder",
        """
import copy
import threading

import torch


def data_parallel_forward(module, x, n):
    size = x.shape[0] // n
    pieces = [x[i * size:(i + 1) * size] for i in range(n)]
    outs = [None] * n

    def job(i):
        params = {k: v.clone() for k, v in module.named_parameters()}
        outs[i] = torch.func.functional_call(copy.deepcopy(module), params, (pieces[i],))

    ts = [threading.Thread(target=job, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return torch.cat(outs)
""",
        "expected outputs of shape",
    ),
    Mistake(
        "ex3_data_parallel_forward",
        "detached_clones",
        """
import copy
import threading

import torch


def data_parallel_forward(module, x, n):
    pieces = torch.chunk(x, n)
    outs = [None] * len(pieces)

    def job(i):
        params = {k: v.detach().clone() for k, v in module.named_parameters()}
        outs[i] = torch.func.functional_call(copy.deepcopy(module), params, (pieces[i],))

    ts = [threading.Thread(target=job, args=(i,)) for i in range(len(pieces))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return torch.cat(outs)
""",
        "not connected to module's in autograd",
    ),
    Mistake(
        "ex3_data_parallel_forward",
        "replicas_share_one_copy",  # right numbers on one device, but one copy for all
        """
import copy
import threading

import torch


def data_parallel_forward(module, x, n):
    pieces = torch.chunk(x, n)
    params = {k: v.clone() for k, v in module.named_parameters()}
    outs = [None] * len(pieces)

    def job(i):
        outs[i] = torch.func.functional_call(copy.deepcopy(module), params, (pieces[i],))

    ts = [threading.Thread(target=job, args=(i,)) for i in range(len(pieces))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return torch.cat(outs)
""",
        "ran with the same parameter tensors",
    ),
    Mistake(
        "ex3_data_parallel_forward",
        "views_of_the_parameters",  # views share module's memory: every replica the same one
        """
import copy
import threading

import torch


def data_parallel_forward(module, x, n):
    pieces = torch.chunk(x, n)
    outs = [None] * len(pieces)

    def job(i):
        params = {k: v.view_as(v) for k, v in module.named_parameters()}
        outs[i] = torch.func.functional_call(copy.deepcopy(module), params, (pieces[i],))

    ts = [threading.Thread(target=job, args=(i,)) for i in range(len(pieces))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return torch.cat(outs)
""",
        "ran with the same parameter tensors",
    ),
]
