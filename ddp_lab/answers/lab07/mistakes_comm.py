"""Lab 7's mistakes that give the right numbers by the wrong communication: a sharded AdamW
that all-reduces the whole gradient (DDP's exchange, then its own slice: 1.5 times ZeRO's
bytes) and a pipeline that never pipelines (each micro-batch's forward and backward in turn).

Collected into ``MISTAKES`` / ``MORE_MISTAKES`` by ``mistakes.py``, after its own (so that the
first mistakes of each exercise stay the sample class's).
"""

from __future__ import annotations

from ddp_lab.answers import Mistake

_ALL_REDUCE_GRADS = """%%writefile zero.py
import torch
import torch.distributed as dist


class ShardedAdamW:
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 max_norm=None, group=None):
        self.params = list(params)
        self.group, self.max_norm = group, max_norm
        self.n = dist.get_world_size(group)
        rank = dist.get_rank(group)
        total = sum(p.numel() for p in self.params)
        self.c = (total + self.n - 1) // self.n
        self.lo = min(rank * self.c, total)
        self.hi = min(self.lo + self.c, total)
        self.parts = []
        start = 0
        with torch.no_grad():
            for i, p in enumerate(self.params):
                a, b = max(self.lo, start), min(self.hi, start + p.numel())
                if a < b:
                    t = torch.nn.Parameter(p.reshape(-1)[a - start:b - start].clone())
                    self.parts.append((i, a - self.lo, b - self.lo, t))
                start += p.numel()
        self.opt = None
        if self.parts:
            self.opt = torch.optim.AdamW([t for *_, t in self.parts], lr=lr, betas=betas,
                                         eps=eps, weight_decay=weight_decay)

    @torch.no_grad()
    def step(self):
        g = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                       for p in self.params])
        dist.all_reduce(g, group=self.group)  # every rank gets every averaged gradient
        g /= self.n
        if self.max_norm is not None:
            coef = self.max_norm / (float(g.norm()) + 1e-6)
            if coef < 1:
                g *= coef
        mine = g[self.lo:self.hi]
        for i, a, b, t in self.parts:
            t.grad = None if self.params[i].grad is None else mine[a:b].clone()
        if self.opt is not None:
            self.opt.step()
        piece = torch.zeros(self.c, dtype=g.dtype)
        for _, a, b, t in self.parts:
            t.grad = None
            piece[a:b] = t
        full = torch.empty(self.n * self.c, dtype=g.dtype)
        dist.all_gather_single(full, piece, group=self.group)
        i = 0
        for p in self.params:
            p.copy_(full[i:i + p.numel()].view_as(p))
            i += p.numel()
"""

_ONE_AT_A_TIME = """%%writefile pipeline.py
import torch
import torch.distributed as dist


def gpipe_step(stage, n_stages, n_micro, inputs, targets, act_shape, loss_fn):
    rank = dist.get_rank()
    dtype = next(stage.parameters()).dtype
    total, outs = 0.0, []
    for i in range(n_micro):  # forward, then backward, of one micro-batch at a time
        if rank == 0:
            x = inputs[i]
        else:
            x = torch.empty(act_shape, dtype=dtype)
            dist.recv(x, src=rank - 1)
            x.requires_grad_()
        y = stage(x)
        if rank == n_stages - 1:
            loss = loss_fn(y, targets[i]) / n_micro
            loss.backward()
            total += loss.item()
            outs.append(y.detach())
        else:
            dist.send(y.detach(), dst=rank + 1)
            g = torch.empty(act_shape, dtype=dtype)
            dist.recv(g, src=rank + 1)
            y.backward(g)
        if rank > 0:
            dist.send(x.grad, dst=rank - 1)
    if rank == n_stages - 1:
        return torch.tensor(total, dtype=dtype), torch.cat(outs)
"""

COMM_MISTAKES = [
    Mistake(
        "ex2_zero",
        "all_reduce_gradients",  # the right weights, DDP's exchange: 1.5x ZeRO's bytes
        _ALL_REDUCE_GRADS,
        "a reduce-scatter gives it just",
    ),
    Mistake(
        "ex3_pipeline",
        "one_micro_batch_at_a_time",  # the right gradients, no pipeline: one stage busy
        _ONE_AT_A_TIME,
        "forwards before any",
    ),
]
