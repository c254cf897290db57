"""Exercise 5, ``activation_bytes(batch, seq, width, heads, bytes_per_number)``: the bytes
autograd keeps for the backward pass of one block of the course's transformer.

The student returns a whole number of bytes, computed from the five sizes: what a forward
pass of ``ddp_lab.gpt.Block`` (in the dtype of ``bytes_per_number``) on an input of shape
``(batch, seq, width)`` that requires a gradient leaves saved for its backward, every storage
counted once, the block's parameters not counted. The function must be arithmetic on the
sizes: it runs with PyTorch's functions refused (a function that builds a block and measures
it is no formula, and is told so).

The judge's oracle builds that block and measures it (:func:`ddp_lab.parallel.memory.saved_bytes`:
``saved_tensors_hooks``, storages counted once): on the CPU for the small cases, on the
``meta`` device (sizes without memory) for the GPT-2-sized ones.

Case set (every draw): a batch of 1 with a sequence of 1 and one head; small blocks of
several heads in float32 and float64 (batch 1 and several, sequences of 2-24 tokens); one
head with a long sequence; a GPT-2-small block (width 768, 12 heads, 1024 tokens) and a
GPT-2-XL one (width 1600, 25 heads, 2048 tokens, a batch of 8-16: 5-10 GB), batches drawn.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode

from ddp_lab.checks.contract import Exercise
from ddp_lab.checks.lab07.common import check_cases
from ddp_lab.checks.values import kind, number, randint
from ddp_lab.gpt import Block, GPTConfig
from ddp_lab.parallel.memory import saved_bytes

DTYPES = {4: torch.float32, 8: torch.float64}
KEYS = ("batch", "seq", "width", "heads", "bytes")
#: Cases at least this many bytes are measured on the meta device (no memory, no time).
META_FROM = 50_000_000


def _case(batch: int, seq: int, heads: int, head_dim: int, nbytes_each: int) -> dict:
    return {
        "batch": batch,
        "seq": seq,
        "width": heads * head_dim,
        "heads": heads,
        "bytes": nbytes_each,
    }


def make_inputs(gen: torch.Generator) -> dict:
    """The cases of the module docstring, sizes drawn from ``gen``."""
    r = functools.partial(randint, gen)
    cases = [
        _case(1, 1, 1, r(2, 8), 4),
        _case(r(2, 6), r(2, 24), r(2, 6), r(2, 8), 4),
        _case(r(2, 6), r(2, 24), r(2, 6), r(2, 8), 8),
        _case(1, r(2, 24), r(3, 8), r(2, 6), 8),
        _case(r(2, 4), r(30, 64), 1, r(4, 16), 4),
        _case(r(1, 16), 1024, 12, 64, 4),
        _case(r(8, 16), 2048, 25, 64, 4),
    ]
    return {"cases": cases}


def visible_inputs(gen: torch.Generator) -> dict:
    """Fixed small cases and one GPT-2-small block."""
    cases = [_case(2, 5, 4, 6, 4), _case(1, 1, 1, 8, 8), _case(3, 16, 8, 4, 8)]
    return {"cases": [*cases, _case(8, 1024, 12, 64, 4)]}


class _NoTorch(TorchFunctionMode):
    """Refuses every PyTorch function (and the construction of a tensor or a module)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        raise PermissionError(
            f"activation_bytes called torch's {name}: it must compute the bytes from the five "
            "sizes (arithmetic on Python numbers), not build or measure tensors"
        )


@contextmanager
def no_torch() -> Iterator[None]:
    """While the block runs, calling any PyTorch function raises ``PermissionError``."""
    with _NoTorch():
        yield


def args(case: dict) -> tuple[int, ...]:
    """The student function's arguments for a case."""
    return tuple(case[k] for k in KEYS)


def run(ns: dict, inputs: dict, workdir) -> dict:
    """The student's ``activation_bytes`` on every case, with PyTorch refused."""
    fn = ns["activation_bytes"]
    results = []
    for case in inputs["cases"]:
        with no_torch():
            got = fn(*args(case))
        results.append(got if isinstance(got, int | float) else kind(got))
    return {"results": results}


@functools.lru_cache(maxsize=64)
def measured(batch: int, seq: int, width: int, heads: int, nbytes_each: int) -> int:
    """Bytes autograd keeps for one block's backward, measured on a real forward pass (on
    the meta device when the case is large)."""
    dtype = DTYPES[nbytes_each]
    big = batch * seq * (16 * width + heads * seq) * nbytes_each >= META_FROM
    with torch.device("meta" if big else "cpu"):
        torch.manual_seed(0)
        block = Block(GPTConfig(seq_len=seq, width=width, heads=heads, layers=1)).to(dtype)
        x = torch.randn(batch, seq, width, dtype=dtype, requires_grad=True)
    return saved_bytes(block, x)


def oracle(case: dict) -> int:
    """The measured bytes of one case."""
    return measured(*args(case))


def describe(case: dict) -> str:
    """``"batch 2, seq 5, width 24, 4 heads, float32"``."""
    dtype = str(DTYPES[case["bytes"]]).removeprefix("torch.")
    heads = f"{case['heads']} head{'s' if case['heads'] > 1 else ''}"
    return f"batch {case['batch']}, seq {case['seq']}, width {case['width']}, {heads}, {dtype}"


def case_problem(case: dict, got, want: int) -> str | None:
    """What is wrong with one case's result, or None."""
    what = f"activation_bytes({', '.join(map(str, args(case)))}) (a block of {describe(case)})"
    if isinstance(got, bool) or not isinstance(got, int | float):
        said = got if isinstance(got, str) else kind(got)
        return f"{what}: expected a whole number of bytes, got {said}"
    if number(got) != want:
        return f"{what} should be {want:,} bytes (measured on a real forward pass), got {got:,}"
    return None


def judge(inputs: dict, outputs: dict) -> str:
    """Every case against the bytes measured on the block itself."""
    check_cases(inputs, outputs, oracle, case_problem)
    biggest = max(oracle(c) for c in inputs["cases"])
    return (
        f"activation_bytes matches the bytes measured on a real block in all "
        f"{len(inputs['cases'])} cases (float32 and float64, batch and sequence of 1, up to "
        f"{biggest / 1e9:.1f} GB)"
    )


EXERCISE = Exercise(
    "test_ex5_activations",
    ("ex5_activations",),
    "activation bytes of a transformer block",
    make_inputs,
    judge,
    run=run,
    visible_inputs=visible_inputs,
)
