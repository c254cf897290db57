"""Typical wrong answers of lab 6, and what the grader must say about each.

Each source replaces the whole solution cell. The first mistake of each exercise is the one
the sample class's ``mistake`` student submits; every one must fail its own exercise with
its ``reason`` in the verdict: ``MISTAKES`` through the real grader
(``tests/test_mistakes.py``), ``MORE_MISTAKES`` in ``tests/test_lab06.py``.
"""

from __future__ import annotations

from ddp_lab.answers import Mistake
from ddp_lab.answers.lab06.mistakes_diagnose import DIAGNOSE_MISTAKES as _ALL_4
from ddp_lab.answers.lab06.mistakes_save import SAVE_MISTAKES as _ALL_1

# --- exercise 2: resume.py -------------------------------------------------------------------

_RESUME_HEAD = """%%writefile resume.py
import os
import random

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler


def train(ddp_model, optimizer, scheduler, dataset, *, epochs, batch_size, ckpt_every,
          ckpt_path, seed):
    rank = dist.get_rank()
    torch.manual_seed(seed + rank)
    random.seed(seed + rank)
    sampler = DistributedSampler(dataset, shuffle=True, seed=seed)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
"""

# the typical public example: model, optimizer and epoch; the epoch starts over on resume
_EPOCH_ONLY = (
    _RESUME_HEAD
    + """    start = 0
    if os.path.isfile(ckpt_path):
        checkpoint = torch.load(ckpt_path)
        ddp_model.module.load_state_dict(checkpoint["model_state_dict"])
        optimizer.load_state_dict(checkpoint["optimizer_state_dict"])
        start = checkpoint["epoch"]
    n = start * len(loader)
    for epoch in range(start, epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(ddp_model(x), y)
            loss.backward()
            optimizer.step()
            scheduler.step()
            n += 1
            if n % ckpt_every == 0 and rank == 0:
                torch.save({"epoch": epoch,
                            "model_state_dict": ddp_model.module.state_dict(),
                            "optimizer_state_dict": optimizer.state_dict()}, ckpt_path)
"""
)


def _resume(load_rng: str, restore_here: str, restore_later: str, gather: str = "all") -> str:
    """A resume that keeps the position in the epoch; where (and whose) generator states
    come back is what the mistakes change."""
    collect = (
        """                states = [None] * dist.get_world_size()
                dist.all_gather_object(states, (torch.get_rng_state(), random.getstate()))
"""
        if gather == "all"
        else """                states = [(torch.get_rng_state(), random.getstate())]
"""
    )
    return (
        _RESUME_HEAD
        + """    epoch0, skip, steps = 0, 0, 0
    rng = None
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, weights_only=True)
        ddp_model.module.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["opt"])
        scheduler.load_state_dict(ck["sched"])
        epoch0, skip, steps = ck["epoch"], ck["pos"], ck["steps"]
"""
        + load_rng
        + restore_here
        + """    for epoch in range(epoch0, epochs):
        sampler.set_epoch(epoch)
        it = iter(loader)
        pos = 0
        if epoch == epoch0:
            for _ in range(skip):
                next(it)
            pos = skip
"""
        + restore_later
        + """        for x, y in it:
            optimizer.zero_grad()
            F.cross_entropy(ddp_model(x), y).backward()
            optimizer.step()
            scheduler.step()
            steps += 1
            pos += 1
            if steps % ckpt_every == 0:
"""
        + collect
        + """                if rank == 0:
                    torch.save({"model": ddp_model.module.state_dict(),
                                "opt": optimizer.state_dict(),
                                "sched": scheduler.state_dict(),
                                "epoch": epoch, "pos": pos, "steps": steps,
                                "rng": states}, ckpt_path)
                dist.barrier()
"""
    )


_MINE = """        rng = ck["rng"][rank]
"""
_SET_NOW = """    if rng is not None:
        torch.set_rng_state(rng[0])
        random.setstate(rng[1])
"""
_SET_LATER = """            if rng is not None:
                torch.set_rng_state(rng[0])
                random.setstate(rng[1])
"""

_ALL_2 = [
    Mistake("ex2_resume", "epoch_only", _EPOCH_ONLY, "position within the epoch"),
    Mistake("ex2_resume", "no_rng", _resume("", "", ""), "did not restore the generators"),
    Mistake(
        "ex2_resume",
        "rng_before_iter",
        _resume(_MINE, _SET_NOW, ""),
        "before this epoch's iter(loader)",
    ),
    Mistake(
        "ex2_resume",
        "rank0_rng",
        _resume(_MINE.replace("[rank]", "[0]"), "", _SET_LATER, gather="mine"),
        "every rank restored rank 0's generator states",
    ),
    Mistake(
        "ex2_resume",
        "no_scheduler",
        _resume(_MINE, "", _SET_LATER).replace(
            '        scheduler.load_state_dict(ck["sched"])\n', ""
        ),
        "schedule was not restored",
    ),
]

# --- exercise 3: rollback_plan ----------------------------------------------------------------

_RULE = """
def rollback_plan(history, drop):
    out = []
    best = None          # (accuracy, step) of the best checkpoint
    last = None          # (accuracy, step) of the previous evaluation
    restored = None      # step of the last rollback
    for ev in history:
        acc, step = ev["accuracy"], ev["step"]
        ref = {ref}
        if ref is not None and {fell}:
            start = {start}
            out.append({{"restore": {target}, "best": best[1], "discarded": step - start}})
            restored = step
        else:
            if best is None or {better}:
                best = (acc, step)
            out.append({{"restore": None, "best": best[1], "discarded": 0}})
        last = (acc, step)
    return out
"""


def _rule(
    ref="best",
    fell="ref[0] - acc > drop",
    target="best[1]",
    better="acc > best[0]",
    start="best[1] if restored is None else max(best[1], restored)",
) -> str:
    return _RULE.format(ref=ref, fell=fell, target=target, better=better, start=start)


_ALL_3 = [
    Mistake(
        "ex3_rollback",
        "vs_previous",  # each evaluation compared with the one before it
        """
def rollback_plan(history, drop):
    plan = []
    best_step, best_acc, prev_acc = None, None, None
    for h in history:
        if prev_acc is not None and prev_acc - h["accuracy"] > drop:
            plan.append({"restore": best_step, "best": best_step,
                         "discarded": h["step"] - best_step})
        else:
            if best_acc is None or h["accuracy"] > best_acc:
                best_step, best_acc = h["step"], h["accuracy"]
            plan.append({"restore": None, "best": best_step, "discarded": 0})
        prev_acc = h["accuracy"]
    return plan
""",
        "measured the drop from the previous evaluation",
    ),
    Mistake(
        "ex3_rollback",
        "restores_latest",
        _rule(target="last[1]"),
        "restored the latest checkpoint",
    ),
    Mistake(
        "ex3_rollback",
        "ge_threshold",
        _rule(fell="ref[0] - acc >= drop"),
        "exactly equal to the threshold",
    ),
    Mistake(
        "ex3_rollback",
        "tie_moves_best",
        _rule(better="acc >= best[0]"),
        "on a tie the best checkpoint moved",
    ),
    Mistake(
        "ex3_rollback",
        "discarded_from_best",
        _rule(start="best[1]"),
        "counted the thrown-away steps from the best checkpoint again",
    ),
]

# --- exercise 4: fixed_train.py ---------------------------------------------------------------

_FIX_HEAD = """%%writefile fixed_train.py
import math

import torch
import torch.distributed as dist


def train(x, y, epochs, batch_size, lr, log_every, seed=0):
    rank, world = dist.get_rank(), dist.get_world_size()
    w = torch.zeros(x.shape[1], dtype=torch.float64)
    logs = []
    for epoch in range(epochs):
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed + epoch))
        mine = order[rank::world]
"""

_FIX_BODY = """            idx = mine[start:start + batch_size]
            err = x[idx] @ w - y[idx]
            packed = torch.cat([2 * x[idx].T @ err, err.square().sum().view(1),
                                torch.tensor([float(len(idx))], dtype=torch.float64)])
            dist.all_reduce(packed)
            grad, loss_sum, count = packed[:-2], packed[-2], packed[-1]
            if (step + 1) % log_every == 0:
                worst = err.square().max() if len(idx) else torch.zeros((), dtype=torch.float64)
{log}
            w -= lr * grad / count
    return w, logs
"""
_STEPS = """        n_steps = math.ceil(math.ceil(len(x) / world) / batch_size)
        for step in range(n_steps):
            start = step * batch_size
"""
_LOG_ALL = """                dist.all_reduce(worst, op=dist.ReduceOp.MAX)
                if rank == 0:
                    logs.append([epoch, step, (loss_sum / count).item(), worst.item()])"""

_ALL_5 = [
    Mistake(
        "ex5_fix_hang",
        "gathers_but_uneven",  # every rank now gathers the maxima, but the steps still differ
        """%%writefile fixed_train.py
import torch
import torch.distributed as dist


def train(x, y, epochs, batch_size, lr, log_every, seed=0):
    rank, world = dist.get_rank(), dist.get_world_size()
    w = torch.zeros(x.shape[1], dtype=torch.float64)
    logs = []
    for epoch in range(epochs):
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed + epoch))
        mine = order[rank::world]
        for step, start in enumerate(range(0, len(mine), batch_size)):
            idx = mine[start:start + batch_size]
            err = x[idx] @ w - y[idx]
            packed = torch.cat([2 * x[idx].T @ err, err.square().sum().view(1),
                                torch.tensor([float(len(idx))], dtype=torch.float64)])
            dist.all_reduce(packed)
            grad, loss_sum, count = packed[:-2], packed[-2], packed[-1]
            # every rank sends its largest error, so no rank waits alone
            maxima = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
            dist.all_gather(maxima, err.square().max().reshape(1))
            if rank == 0 and (step + 1) % log_every == 0:
                logs.append([epoch, step, (loss_sum / count).item(),
                             max(m.item() for m in maxima)])
            w -= lr * grad / count
    return w, logs
""",
        "did not return within",
    ),
    Mistake(
        "ex5_fix_hang",
        "logs_own_worst",  # the logging collective dropped: rank 0 logs its own maximum
        _FIX_HEAD
        + """        n_steps = math.ceil(math.ceil(len(x) / world) / batch_size)
        for step in range(n_steps):
            start = step * batch_size
"""
        + _FIX_BODY.format(
            log="""                if rank == 0:
                    logs.append([epoch, step, (loss_sum / count).item(), worst.item()])"""
        ),
        "rank 0 logged its own largest squared error",
    ),
    Mistake(
        "ex5_fix_hang",
        "every_rank_logs",  # the collective moved out of the rank-0 branch, the records too
        _FIX_HEAD
        + _STEPS
        + _FIX_BODY.format(
            log="""                dist.all_reduce(worst, op=dist.ReduceOp.MAX)
                logs.append([epoch, step, (loss_sum / count).item(), worst.item()])
                if rank == 0:
                    print(f"epoch {epoch} step {step}: loss {logs[-1][2]:.4f}")"""
        ),
        "only rank 0 logs, the other ranks return []",
    ),
    Mistake(
        "ex5_fix_hang",
        "shortest_shard",  # every rank stops where the shortest shard ends
        _FIX_HEAD
        + """        n_steps = math.ceil((len(x) // world) / batch_size)
        for step in range(n_steps):
            start = step * batch_size
"""
        + _FIX_BODY.format(log=_LOG_ALL),
        "stopped at the shortest shard",
    ),
    Mistake(
        "ex5_fix_hang",
        "every_rank_prints",  # the records on rank 0, but every rank prints them
        _FIX_HEAD
        + _STEPS
        + _FIX_BODY.format(
            log=_LOG_ALL
            + """
                print(f"epoch {epoch} step {step}: loss {(loss_sum / count).item():.4f}")"""
        ),
        "only rank 0 prints",
    ),
]

_ALL = _ALL_1 + _ALL_2 + _ALL_3 + _ALL_4 + _ALL_5

#: What ``tests/test_mistakes.py`` and the sample class run through the real grader: at most
#: three per exercise (each round grades one mistake per exercise, and a round costs a whole
#: grading run). The first of each exercise is the sample class's.
_ROUNDS = 3
MISTAKES = [m for m in _ALL if [x.cell for x in _ALL[: _ALL.index(m) + 1]].count(m.cell) <= _ROUNDS]
#: The others, judged in ``tests/test_lab06.py`` (each must fail its exercise with its reason).
MORE_MISTAKES = [m for m in _ALL if m not in MISTAKES]
