"""Typical wrong answers of lab 5, and what the grader must say about each.

Each source replaces the whole solution cell. The first mistake of each exercise is the one
the sample class's ``mistake`` student submits; every one must fail its own exercise with
its ``reason`` in the verdict: ``MISTAKES`` through the real grader
(``tests/test_mistakes.py``), ``MORE_MISTAKES`` in ``tests/test_lab05.py``.
"""

from __future__ import annotations

from ddp_lab.answers import Mistake
from ddp_lab.answers.lab05.mistakes_step import STEP_MISTAKES

# exercise 1: the right scale search, on which the share mistakes below are built
_SCALE = """
    largest = values.abs().max()
    k = 0
    while torch.isinf((largest * 2.0**k).half()):
        k -= 1
    while not torch.isinf((largest * 2.0 ** (k + 1)).half()):
        k += 1
    scale = 2.0**k
"""


def _report(head: str, share: str, scale: str = _SCALE, bf16: str = "torch.bfloat16") -> str:
    return f"""
import torch


def fp16_report(grads):
{head}
    def share(x, dtype):
{share}
{scale}
    return {{
        "underflow": share(values, torch.float16),
        "max_scale": scale,
        "underflow_at_max_scale": share(values * scale, torch.float16),
        "bf16_underflow": share(values, {bf16}),
    }}
"""


_NONZERO = """    values = torch.cat([g.reshape(-1).double() for g in grads])
    values = values[values != 0]
"""
#: The same in float32, the dtype the gradients come in: right everywhere but where the
#: largest safe scale is above 2**127 (2.0**128 is inf in float32).
_NONZERO_32 = _NONZERO.replace(".double()", ".float()")
_RIGHT_SHARE = "        return (x.to(dtype) == 0).sum().item() / values.numel()"

# exercise 2: the right scaler, pieces of which the mistakes replace
_INIT = """
import torch


class LossScaler:
    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=2000):
        self.s = float(init_scale)
        self.growth, self.backoff, self.interval = growth_factor, backoff_factor, growth_interval
        self.good, self.inf, self.unscaled = 0, False, False

    def scale(self, loss):
        return loss * self.s

    def get_scale(self):
        return self.s
"""
_UNSCALE = """
    def unscale_(self, optimizer):
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(1.0 / self.s)
                    self.inf = self.inf or not bool(torch.isfinite(p.grad).all())
        self.unscaled = True
"""
_STEP = """
    def step(self, optimizer):
        if not self.unscaled:
            self.unscale_(optimizer)
        if not self.inf:
            optimizer.step()
"""
_UPDATE = """
    def update(self):
        if self.inf:
            self.s *= self.backoff
            self.good = 0
        else:
            self.good += 1
            if self.good == self.interval:
                self.s *= self.growth
                self.good = 0
        self.inf, self.unscaled = False, False
"""

# exercise 3: the accumulation loop, with the pieces the mistakes change
_ACCUM = """%%writefile accum.py
import contextlib


def train_accumulated(ddp_model, optimizer, micro_batches, k, loss_fn):
    steps = 0
    for start in range(0, len(micro_batches), k):
        group = micro_batches[start:start + k]
        for i, (x, y) in enumerate(group):
            last = i == len(group) - 1
            with {context}:
                loss = loss_fn(ddp_model(x), y){divide}
                loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        steps += 1
    return steps
"""
_SYNC_LAST = "contextlib.nullcontext() if last else ddp_model.no_sync()"

# exercise 5: the file's head
_NORM_HEAD = """%%writefile grad_norm.py
import math

import torch
import torch.distributed as dist


def global_grad_norm(local_grads, norm_type=2.0, group=None):
    flat = [g.detach().reshape(-1).double() for g in local_grads]
    mine = torch.cat(flat) if flat else torch.zeros(0, dtype=torch.float64)
"""

_ALL = [
    # --- exercise 1: fp16_report -------------------------------------------------------------
    Mistake(
        "ex1_fp16_report",
        "share_of_all_entries",  # the zeros (ReLU, an unused layer) counted in the denominator
        _report(
            "    values = torch.cat([g.reshape(-1).double() for g in grads])\n",
            "        nonzero = x[x != 0]\n"
            "        return (nonzero.to(dtype) == 0).sum().item() / x.numel()",
            _SCALE.replace("values.abs().max()", "values[values != 0].abs().max()"),
        ),
        "counts every entry, the zeros too",
    ),
    Mistake(
        "ex1_fp16_report",
        "subnormal_is_underflow",  # below the smallest normal number is not zero yet
        _report(
            _NONZERO,
            "        return (x.abs() < torch.finfo(dtype).tiny).sum().item() / values.numel()",
        ),
        "they become subnormal numbers",
    ),
    Mistake(
        "ex1_fp16_report",
        "scale_from_finfo_max",  # 65504 is the largest value, not the overflow threshold
        _report(
            _NONZERO,
            _RIGHT_SHARE,
            """
    largest = values.abs().max().item()
    scale = 2.0 ** math.floor(math.log2(torch.finfo(torch.float16).max / largest))
""",
        ).replace("import torch\n", "import math\n\nimport torch\n", 1),
        "above finfo.max = 65504 but still finite",
    ),
    Mistake(
        "ex1_fp16_report",
        "bf16_measured_in_fp16",
        _report(_NONZERO, _RIGHT_SHARE, bf16="torch.float16"),
        "equals the float16 share",
    ),
    Mistake(
        "ex1_fp16_report",
        "scale_search_in_float32",  # the search multiplies float32 tensors by 2.0**k
        _report(_NONZERO_32, _RIGHT_SHARE),
        "is already inf in float32",
    ),
    Mistake(
        "ex1_fp16_report",
        "shares_as_tensors",  # right values, but 0-d tensors where the docstring says floats
        _report(_NONZERO, _RIGHT_SHARE.replace(".sum().item()", ".sum()")),
        "promises Python floats",
    ),
    # --- exercise 2: LossScaler ----------------------------------------------------------------
    Mistake(
        "ex2_loss_scaler",
        "never_skips",  # the inf/NaN step reaches the weights
        _INIT
        + _UNSCALE
        + """
    def step(self, optimizer):
        if not self.unscaled:
            self.unscale_(optimizer)
        optimizer.step()
"""
        + _UPDATE,
        "even when a gradient holds an inf",
    ),
    Mistake(
        "ex2_loss_scaler",
        "grows_every_step",
        _INIT
        + _UNSCALE
        + _STEP
        + """
    def update(self):
        self.s *= self.backoff if self.inf else self.growth
        self.inf, self.unscaled = False, False
""",
        "grows after every good step",
    ),
    Mistake(
        "ex2_loss_scaler",
        "never_grows",
        _INIT
        + _UNSCALE
        + _STEP
        + """
    def update(self):
        if self.inf:
            self.s *= self.backoff
        self.inf, self.unscaled = False, False
""",
        "never grows",
    ),
    Mistake(
        "ex2_loss_scaler",
        "keeps_counting",  # the good steps before an overflow still count afterwards
        _INIT
        + _UNSCALE
        + _STEP
        + _UPDATE.replace("            self.good = 0\n        else:", "        else:"),
        "goes on across an overflow",
    ),
    Mistake(
        "ex2_loss_scaler",
        "misses_nan",
        _INIT
        + _UNSCALE.replace(
            "not bool(torch.isfinite(p.grad).all())", "bool(torch.isinf(p.grad).any())"
        )
        + _STEP
        + _UPDATE,
        "a NaN gradient went through",
    ),
    Mistake(
        "ex2_loss_scaler",
        "unscales_twice",
        _INIT
        + _UNSCALE
        + """
    def step(self, optimizer):
        self.unscale_(optimizer)
        if not self.inf:
            optimizer.step()
"""
        + _UPDATE,
        "divided by the scale twice",
    ),
    Mistake(
        "ex2_loss_scaler",
        "hardcoded_growth",  # right with GradScaler's default growth_factor (2.0) only
        _INIT + _UNSCALE + _STEP + _UPDATE.replace("self.s *= self.growth", "self.s *= 2"),
        "whatever growth_factor says",
    ),
    Mistake(
        "ex2_loss_scaler",
        "scale_as_tensor",  # every value right, but get_scale() gives a tensor
        _INIT.replace("self.s = float(init_scale)", "self.s = torch.tensor(float(init_scale))")
        + _UNSCALE
        + _STEP
        + _UPDATE,
        "promises a Python float",
    ),
    # --- exercise 3: train_accumulated --------------------------------------------------------
    Mistake(
        "ex3_accumulation",
        "no_no_sync",  # right weights, one all-reduce per micro-batch
        _ACCUM.format(context="contextlib.nullcontext()", divide=" / len(group)"),
        "under ddp_model.no_sync()",
    ),
    Mistake(
        "ex3_accumulation",
        "loss_not_divided",  # k times the learning rate
        _ACCUM.format(context=_SYNC_LAST, divide=""),
        "is not divided by the number of micro-batches",
    ),
    Mistake(
        "ex3_accumulation",
        "tail_divided_by_k",
        _ACCUM.format(context=_SYNC_LAST, divide=" / k"),
        "was divided by k",
    ),
    Mistake(
        "ex3_accumulation",
        "syncs_the_first",  # the all-reduce happens before the group's gradient is complete
        _ACCUM.format(
            context="contextlib.nullcontext() if i == 0 else ddp_model.no_sync()",
            divide=" / len(group)",
        ),
        "ranks ended with different weights",
    ),
    Mistake(
        "ex3_accumulation",
        "forward_outside_no_sync",  # DDP decides in the forward: the backward syncs anyway
        """%%writefile accum.py
import contextlib


def train_accumulated(ddp_model, optimizer, micro_batches, k, loss_fn):
    steps = 0
    for start in range(0, len(micro_batches), k):
        group = micro_batches[start:start + k]
        for i, (x, y) in enumerate(group):
            loss = loss_fn(ddp_model(x), y) / len(group)
            last = i == len(group) - 1
            with contextlib.nullcontext() if last else ddp_model.no_sync():
                loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        steps += 1
    return steps
""",
        "under ddp_model.no_sync()",
    ),
    Mistake(
        "ex3_accumulation",
        "returns_floor_division",  # the right loop, but the short last group is not counted
        _ACCUM.format(context=_SYNC_LAST, divide=" / len(group)").replace(
            "    return steps\n", "    return len(micro_batches) // k\n"
        ),
        "the number of optimizer steps taken",
    ),
    *STEP_MISTAKES,  # exercise 4: train_steps (mistakes_step.py)
    # --- exercise 5: global_grad_norm ---------------------------------------------------------
    Mistake(
        "ex5_global_grad_norm",
        "sums_norms",  # norms do not add up
        _NORM_HEAD
        + """    if norm_type == math.inf:
        result = mine.abs().max() if mine.numel() else torch.zeros((), dtype=torch.float64)
        dist.all_reduce(result, op=dist.ReduceOp.MAX, group=group)
        return result
    result = mine.norm()
    dist.all_reduce(result, group=group)
    return result
""",
        "summed the ranks' norms",
    ),
    Mistake(
        "ex5_global_grad_norm",
        "squares_in_float32",  # converted to float64 after squaring: tiny squares are lost
        """%%writefile grad_norm.py
import math

import torch
import torch.distributed as dist


def global_grad_norm(local_grads, norm_type=2.0, group=None):
    result = torch.zeros((), dtype=torch.float64)
    for g in local_grads:
        if g.numel() == 0:
            continue
        if norm_type == math.inf:
            result = torch.maximum(result, g.detach().abs().max().double())
        else:
            result += (g.detach() ** 2).sum().double()  # squared and summed in g's dtype
    op = dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM
    dist.all_reduce(result, op=op, group=group)
    return result if norm_type == math.inf else result.sqrt()
""",
        "accumulated in float32",
    ),
    Mistake(
        "ex5_global_grad_norm",
        "returns_a_float",  # the right value as a Python float, not a 0-d float64 tensor
        _NORM_HEAD
        + """    if norm_type == math.inf:
        result = mine.abs().max() if mine.numel() else torch.zeros((), dtype=torch.float64)
        dist.all_reduce(result, op=dist.ReduceOp.MAX, group=group)
        return result.item()
    result = (mine * mine).sum()
    dist.all_reduce(result, group=group)
    return result.sqrt().item()
""",
        "promises a 0-d float64 tensor",
    ),
    Mistake(
        "ex5_global_grad_norm",
        "local_only",
        _NORM_HEAD
        + """    if mine.numel() == 0:
        return torch.zeros((), dtype=torch.float64)
    return torch.linalg.vector_norm(mine, norm_type)
""",
        "the norm of its own gradients",
    ),
    Mistake(
        "ex5_global_grad_norm",
        "inf_norm_summed",
        _NORM_HEAD
        + """    if norm_type == math.inf:
        result = mine.abs().max() if mine.numel() else torch.zeros((), dtype=torch.float64)
    else:
        result = (mine * mine).sum()
    dist.all_reduce(result, group=group)
    return result if norm_type == math.inf else result.sqrt()
""",
        "summed the ranks' largest magnitudes",
    ),
    Mistake(
        "ex5_global_grad_norm",
        "max_without_abs",
        _NORM_HEAD
        + """    if norm_type == math.inf:
        result = mine.max() if mine.numel() else torch.zeros((), dtype=torch.float64)
        dist.all_reduce(result, op=dist.ReduceOp.MAX, group=group)
        return result
    result = (mine * mine).sum()
    dist.all_reduce(result, group=group)
    return result.sqrt()
""",
        "missed a larger negative entry",
    ),
    Mistake(
        "ex5_global_grad_norm",
        "mean_of_squares",
        _NORM_HEAD
        + """    if norm_type == math.inf:
        result = mine.abs().max() if mine.numel() else torch.zeros((), dtype=torch.float64)
        dist.all_reduce(result, op=dist.ReduceOp.MAX, group=group)
        return result
    result = (mine * mine).sum()
    dist.all_reduce(result, group=group)
    return (result / dist.get_world_size(group)).sqrt()
""",
        "averaged the sums of squares",
    ),
    Mistake(
        "ex5_global_grad_norm",
        "ignores_group",  # all ranks' collective while rank 2 is outside the group: deadlock
        _NORM_HEAD
        + """    if norm_type == math.inf:
        result = mine.abs().max() if mine.numel() else torch.zeros((), dtype=torch.float64)
        dist.all_reduce(result, op=dist.ReduceOp.MAX)
        return result
    result = (mine * mine).sum()
    dist.all_reduce(result)
    return result.sqrt()
""",
        "pass group=group to every collective",
    ),
]

#: What ``tests/test_mistakes.py`` and the sample class run through the real grader: at most
#: three per exercise (each round of that test grades one mistake per exercise, and a round
#: costs a whole grading run). The first of each exercise is the sample class's.
_ROUNDS = 3
MISTAKES = [m for m in _ALL if [x.cell for x in _ALL[: _ALL.index(m) + 1]].count(m.cell) <= _ROUNDS]
#: The others, judged in ``tests/test_lab05.py`` (each must fail its exercise with its reason).
MORE_MISTAKES = [m for m in _ALL if m not in MISTAKES]
