"""Lab 8 exercise 3 (``make_compress_hook`` in ``compress.py``), instructor only: what the
grader adds to the kit's judge, the typical mistakes, and the solution cell.

- ``HIDDEN``: ``check`` replays the first step in the judge's own process (each rank's
  gradient at the initial parameters, their average in float64): every rank's first averaged
  gradient lies within the compressed dtype's rounding of it, and the first SGD step moved
  the parameters by it (so that a job whose run of torch's hook was tampered with cannot
  pass); ``explain`` names the mistake behind wrong numbers from their factor to torch's
  (measured in bfloat16, where nothing overflows): about 1 but not bit for bit with an
  overflow in float16 (divided after the sum), about ``n`` (summed), about ``2 / 3`` on the
  group of 2 alone (divided by the default group's size);
- ``MISTAKES``: the sample class's (divides after the all-reduce), written on its own;
  ``MORE_MISTAKES``: the others, judged on real ranks in ``tests/test_lab08_ex3.py``.

What torch's hooks do (``torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py``,
torch 2.14): ``fp16_compress_hook`` and ``bf16_compress_hook`` call ``_compress_hook(dtype,
process_group, bucket)``, which takes ``process_group`` or, when it is None,
``dist.group.WORLD``, and its ``size()``; casts ``bucket.buffer()`` to ``dtype`` (a new
tensor) and divides *that* in place by the size (``buffer.to(dtype).div_(world_size)``, so
the division rounds in ``dtype``); all-reduces it (sum) over the group with
``async_op=True``; and returns ``get_future().then(decompress)``, where ``decompress`` copies
the summed value back into the bucket's own buffer (in place, "to reduce the peak memory",
pytorch issue 45968: the copy casts back to float32) and returns that buffer. (Under
``torch.compile`` it uses ``_functional_collectives.all_reduce`` instead.) The division comes
before the all-reduce because the sum of ``n`` ranks' values may leave the compressed dtype's
range even though each value, and their mean, fit: float16 ends at 65504, so three gradients
of 40,000 sum to inf, while their thirds sum to 40,000 (torch's ``_allreduce_fut`` says it
in a comment: "Apply the division first to avoid overflow, especially for FP16."). In
bfloat16 (float32's range) nothing overflows, but the order changes the rounding: each
rank's value divided then summed is what torch's hook gives, bit for bit.
"""

from __future__ import annotations

import torch

from ddp_lab.answers import Hidden, Mistake
from ddp_lab.checks.failure import CheckFailed
from ddp_lab.checks.lab08 import ex3_compress_hook as ex3

GRADE_ID = ex3.GRADE_ID
CELL = "ex3_compress_hook"

# --- the grader's additions ------------------------------------------------------------------


def _replay_check(inputs: dict, outputs: dict) -> None:
    for spec, mine, _ in ex3._outs(inputs, outputs):  # noqa: SLF001 - the kit's own pairing
        n, dt = spec["ranks"], ex3.DTYPES[spec["dtype"]]
        local = torch.stack([ex3.local_grads(spec, spec["init"], r) for r in range(n)]).double()
        want = local.to(dt).double().mean(0)
        info = torch.finfo(dt)
        tol = (n + 1) * info.eps * local.abs().mean(0) + n * info.smallest_normal
        start = torch.cat([t.reshape(-1) for t in spec["init"]]).double()
        for rank, o in enumerate(mine):
            got = o["grads"][0].double()
            if not bool(((got - want).abs() <= tol).all()):
                raise CheckFailed(
                    f"{ex3.run_text(spec)}, step 1, rank {rank}: the averaged gradients are "
                    f"not the ranks' mean within {spec['dtype']}'s rounding (recomputed by the "
                    "grader from the inputs)"
                )
            moved = start - spec["lr"] * got
            if not bool(
                ((o["params"][0].double() - moved).abs() <= 1e-5 * (1 + moved.abs())).all()
            ):
                raise CheckFailed(
                    f"{ex3.run_text(spec)}, rank {rank}: the first SGD step did not move the "
                    "parameters by the averaged gradients"
                )


def _first_step(spec: dict, mine: list, oracle: list) -> dict | None:
    """Rank 0's first averaged gradient against torch's: equal bits, overflow, factor."""
    try:
        got, want = mine[0]["grads"][0], oracle[0]["grads"][0]
        if not isinstance(got, torch.Tensor) or got.shape != want.shape:
            return None
    except (KeyError, IndexError, TypeError):
        return None
    return {
        "equal": bool(torch.equal(ex3.raw(got), ex3.raw(want))),
        "inf": bool((~torch.isfinite(got) & torch.isfinite(want)).any()),
        "k": ex3.ratio(got, want),
    }


def _near(k: float, target: float, rel: float = 0.02) -> bool:
    return abs(k - target) <= rel * target


def _explain(inputs: dict, outputs: dict) -> str | None:
    runs = {
        (s["ranks"], s["dtype"]): _first_step(s, m, o) for s, m, o in ex3._outs(inputs, outputs)
    }  # noqa: SLF001
    f3, b3, f2, b2 = (
        runs.get(k) for k in ((3, "float16"), (3, "bfloat16"), (2, "float16"), (2, "bfloat16"))
    )
    if None in (f3, b3, f2, b2):
        return None
    if f3["inf"] and _near(b3["k"], 1.0, 0.01) and not b3["equal"]:
        return (
            "you divided after the all-reduce: over 3 ranks in float16 the sum of the ranks' "
            "gradients (each near 40,000) passes 65504 and becomes inf before your division, "
            "and in bfloat16 the sum rounds before the division, differently from torch's "
            "hook, which divides each rank's compressed gradient by the group's size first "
            "(the sum of the divided values fits)"
        )
    if _near(b3["k"], 3.0) and _near(b2["k"], 2.0):
        return (
            "your hook summed the ranks' gradients and never divided: DDP does not divide a "
            "hook's result (the bucket holds this rank's gradients), so the hook must divide "
            "by the group's size itself; your gradients are n times torch's hook's (and inf "
            "in float16 over 3 ranks)"
        )
    if f3["equal"] and b3["equal"] and _near(f2["k"], 2 / 3) and _near(b2["k"], 2 / 3):
        return (
            "over the group of ranks 0 and 1 your gradients are 2/3 of torch's hook's: you "
            "divided by the default group's size (3), not by the size of process_group, the "
            "group the hook averages over (dist.get_world_size(process_group); None is the "
            "default group)"
        )
    return None


HIDDEN = {GRADE_ID: Hidden(check=_replay_check, explain=_explain)}

# --- the solution cell -----------------------------------------------------------------------

_HEAD = """%%writefile compress.py
import torch
import torch.distributed as dist
"""

SOLUTION_CELL = (
    _HEAD
    + '''

def make_compress_hook(dtype):
    """A DDP communication hook that sends every bucket of gradients compressed to `dtype`
    (torch.float16 or torch.bfloat16) and averages it over the ranks of the process group.

    Returns hook(process_group, bucket) -> torch.futures.Future[torch.Tensor], to register
    with ddp_model.register_comm_hook(process_group, hook). DDP calls it once per bucket on
    every rank, with the process_group given there (None: the default group);
    bucket.buffer() is this rank's gradients of the bucket, one flat float32 tensor.

    The hook works in `dtype` from its start: it casts the buffer to `dtype`, and its
    arithmetic and its one dist.all_reduce are on that compressed tensor (half the bytes of
    float32). The Future's value is the average over the group's ranks, as a tensor of the
    buffer's own dtype and size. It equals torch's fp16_compress_hook (float16) and
    bf16_compress_hook (bfloat16) bit for bit, also when the ranks' gradients come close to
    float16's largest number, 65504.
    """

    def hook(process_group, bucket):
        ### BEGIN SOLUTION
        n = dist.get_world_size(process_group)  # None: the default group
        buffer = bucket.buffer()
        compressed = buffer.to(dtype).div_(n)  # before the sum: n values may overflow float16
        work = dist.all_reduce(compressed, group=process_group, async_op=True)

        def decompress(fut):
            buffer.copy_(fut.value()[0])  # back into the bucket, in its own dtype
            return buffer

        return work.get_future().then(decompress)
        ### END SOLUTION

    return hook
'''
)

# --- mistakes, each a student's whole cell ---------------------------------------------------

_DIVIDES_AFTER = (
    _HEAD
    + """

def make_compress_hook(dtype):
    def hook(process_group, bucket):
        world = dist.get_world_size(group=process_group)
        small = bucket.buffer().to(dtype)        # compress
        dist.all_reduce(small, group=process_group)
        small = small / world                    # average
        done = torch.futures.Future()
        done.set_result(small.to(bucket.buffer().dtype))
        return done

    return hook
"""
)

_SUMS = (
    _HEAD
    + """

def make_compress_hook(dtype):
    def hook(process_group, bucket):
        grads = bucket.buffer()
        packed = grads.to(dtype)
        fut = dist.all_reduce(packed, group=process_group, async_op=True).get_future()

        def unpack(fut):
            grads.copy_(fut.value()[0])  # DDP averages the buckets
            return grads

        return fut.then(unpack)

    return hook
"""
)

_DEFAULT_WORLD = (
    _HEAD
    + """

def make_compress_hook(dtype):
    world = dist.get_world_size()

    def hook(process_group, bucket):
        out = bucket.buffer()
        tensor = out.to(dtype) / world
        work = dist.all_reduce(tensor, group=process_group, async_op=True)

        def back(fut):
            out.copy_(fut.value()[0])
            return out

        return work.get_future().then(back)

    return hook
"""
)

_FLOAT32_SENT = (
    _HEAD
    + """

def make_compress_hook(dtype):
    def hook(process_group, bucket):
        grads = bucket.buffer()
        n = dist.get_world_size(process_group)
        rounded = (grads / n).to(dtype)  # the compressed gradients
        grads.copy_(rounded)
        fut = dist.all_reduce(grads, group=process_group, async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])

    return hook
"""
)

_NOT_CAST_BACK = (
    _HEAD
    + """

def make_compress_hook(dtype):
    def hook(process_group, bucket):
        size = dist.get_world_size(process_group)
        c = bucket.buffer().to(dtype)
        c.div_(size)
        fut = dist.all_reduce(c, group=process_group, async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])

    return hook
"""
)

_ALWAYS_FP16 = (
    _HEAD
    + """

def make_compress_hook(dtype=torch.float16):
    def hook(process_group, bucket):
        buf = bucket.buffer()
        half = buf.half() / dist.get_world_size(process_group)
        fut = dist.all_reduce(half, group=process_group, async_op=True).get_future()

        def done(f):
            buf.copy_(f.value()[0])
            return buf

        return fut.then(done)

    return hook
"""
)

MISTAKES = [
    Mistake(CELL, "divides_after_all_reduce", _DIVIDES_AFTER, "you divided after the all-reduce")
]
#: Judged on real ranks in ``tests/test_lab08_ex3.py`` (one gloo job for all of them).
MORE_MISTAKES = [
    Mistake(CELL, "sums_without_dividing", _SUMS, "summed the ranks' gradients and never divided"),
    Mistake(CELL, "default_world_size", _DEFAULT_WORLD, "divided by the default group's size"),
    Mistake(CELL, "all_reduces_float32", _FLOAT32_SENT, "no bytes saved"),
    Mistake(CELL, "returns_compressed", _NOT_CAST_BACK, "in the bucket's own dtype"),
    Mistake(
        CELL,
        "ignores_dtype",
        _ALWAYS_FP16,
        "sent float16 where it was made with dtype=torch.bfloat16",
    ),
]
