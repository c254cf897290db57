"""What the two hand-written collectives of lab 2 share: cases, the run on every rank, the
oracle judge.

Both exercises (``ring.py``: a ring all-reduce, ``ps.py``: a parameter-server average) run
the student's function on every rank of a torchrun job, on tensors whose result is known from
the inputs alone: the element-wise **sum over the ranks** (what ``dist.all_reduce`` gives),
or that sum divided by the world size. The judge compares with that oracle and, when a rank
is wrong, says where and how (not in place, unchanged, the average instead of the sum,
chunks that miss some ranks' contributions).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ddp_lab.checks import guards
from ddp_lab.checks.failure import CheckFailed, is_close
from ddp_lab.checks.values import kind, randint

#: Seconds one call of the student's collective may take on a rank (small tensors: ms).
CALL_TIMEOUT_S = 15.0
#: The visible checks: 3 ranks, these shapes, small integers (float64).
VISIBLE_WORLD_SIZE = 3
VISIBLE_SHAPES = [(1,), (2,), (3,), (7,), (10,), (3, 5)]


@dataclass(frozen=True)
class Collective:
    """One hand-written collective: where it lives and what it must equal."""

    file: str  # the file the notebook's %%writefile cell writes
    function: str  # the function it defines
    average: bool  # True: the sum over the ranks divided by their number
    equals: str  # what the result must be, in words
    hang_hint: str  # the likely cause of a deadlock


RING = Collective(
    "ring.py",
    "ring_all_reduce",
    False,
    "dist.all_reduce (the sum over the ranks)",
    "Does every rank block in recv (or in a blocking send) before its own message is on its "
    "way? Post the send with dist.isend first, then recv, then wait()",
)
SERVER = Collective(
    "ps.py",
    "parameter_server_average",
    True,
    "dist.all_reduce / world_size (the average over the ranks)",
    "Does every worker send once and receive once, and does the server receive from every "
    "worker before it sends the average back to each of them?",
)


# --------------------------------------------------------------------------- inputs


def make_cases(gen: torch.Generator, world_sizes: Sequence[int]) -> dict:
    """The graded case set: per world size, seven tensors per rank.

    Lengths 1 (fewer elements than ranks), ``n - 1``, a short and a long length that ``n``
    does not divide, a multiple of ``n``, two 2-D shapes; float64, the last one float32;
    values ``10 * randn``.
    """
    cases = []
    for n in world_sizes:
        small, big = randint(gen, n + 1, 39), randint(gen, 500, 2999)
        shapes = [
            (1,),
            (n - 1,) if n > 2 else (3,),
            (small + (small % n == 0),),
            (big + (big % n == 0),),
            (6 * n,),
            (3, 2 * n + 1),
            (5, 7),
        ]
        dtypes = [torch.float64] * (len(shapes) - 1) + [torch.float32]
        data = [
            [
                torch.randn(s, generator=gen, dtype=torch.float64).to(d) * 10
                for s, d in zip(shapes, dtypes, strict=True)
            ]
            for _ in range(n)
        ]
        cases.append({"world_size": n, "data": data})
    return {"cases": cases}


def visible_cases(world_size: int = VISIBLE_WORLD_SIZE) -> dict:
    """The visible check's case: :data:`VISIBLE_SHAPES` of small integers on every rank."""
    data = []
    for rank in range(world_size):
        tensors = []
        for i, shape in enumerate(VISIBLE_SHAPES):
            gen = torch.Generator().manual_seed(1000 * i + rank)
            tensors.append(torch.randint(-9, 10, shape, generator=gen).double())
        data.append(tensors)
    return {"cases": [{"world_size": world_size, "data": data}]}


# --------------------------------------------------------------------------- one rank


def run_rank(which: Collective) -> Callable:
    """``run_rank`` of an exercise: the student's function on each of this rank's tensors.

    The file is loaded with the built-in collectives refused; every call runs under a
    watchdog that ends the rank with a one-line reason when it deadlocks.
    """

    def run(ns: dict, inputs: dict, case: dict, rank: int, world_size: int) -> list:
        module = guards.load_student_file(which.file, forbid=guards.COLLECTIVES)
        fn = module.get(which.function)
        if not callable(fn):
            raise NameError(f"{which.file} defines no function {which.function}()")
        out = []
        for x in case["data"][rank]:
            t = x.clone()

            def hung(shape=tuple(t.shape)) -> str:
                where = f"rank {dist.get_rank()} of {dist.get_world_size()}"
                return (
                    f"{which.function}() did not return within {CALL_TIMEOUT_S:g} s on {where} "
                    f"(a tensor of shape {shape}): the ranks wait for each other. "
                    f"{which.hang_hint}"
                )

            with guards.call_watchdog(CALL_TIMEOUT_S, hung):
                returned = fn(t)
            other = isinstance(returned, torch.Tensor) and returned is not t
            out.append({"after": t, "returned": returned if other else None})
        return out

    return run


# --------------------------------------------------------------------------- the judge


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """``(atol, rtol)`` for results computed in ``dtype``."""
    return (1e-9, 1e-9) if dtype == torch.float64 else (1e-5, 1e-5)


def _first_difference(got, expected: torch.Tensor) -> str:
    if not isinstance(got, torch.Tensor):
        return f"expected a tensor, got {kind(got)}"
    if tuple(got.shape) != tuple(expected.shape):
        return f"expected shape {tuple(expected.shape)}, got {tuple(got.shape)}"
    diff = torch.nan_to_num((got.double() - expected).abs().flatten(), nan=math.inf)
    i = int(torch.argmax(diff))
    return (
        f"at flat index {i} expected {expected.flatten()[i].item():.6g}, "
        f"got {got.flatten()[i].item():.6g}"
    )


def _partial_sums(got: torch.Tensor, xs: Sequence[torch.Tensor], chunks: list, tol) -> str:
    """Which wrong chunks hold the sum over only some of the ranks (``""`` when none)."""
    n = len(xs)
    flats = [x.double().flatten() for x in xs]
    said = []
    for c in chunks:
        idx = torch.tensor_split(torch.arange(flats[0].numel()), n)[c]
        for size in range(1, n):
            subset = next(
                (
                    s
                    for s in itertools.combinations(range(n), size)
                    if is_close(got[idx], sum(flats[r][idx] for r in s), *tol)
                ),
                None,
            )
            if subset is not None:
                missing = sorted(set(range(n)) - set(subset))
                said.append(f"chunk {c} misses rank(s) {missing}")
                break
    if not said:
        return ""
    return f". Partial sums: {', '.join(said)}: every chunk must collect every rank's values"


def problem(which: Collective, xs: Sequence[torch.Tensor], afters: Sequence, returns) -> str | None:
    """What is wrong with one call on every rank, or None when every rank is right.

    Args:
        which: the collective.
        xs: each rank's tensor before the call.
        afters: each rank's tensor after the call (the function works in place).
        returns: what it returned on each rank when that was another tensor (else None).
    """
    n = len(xs)
    total = torch.stack([x.double() for x in xs]).sum(0)
    expected = total / n if which.average else total
    tol = tolerance(xs[0].dtype)
    ok = [is_close(a, expected, *tol) for a in afters]
    if all(ok):
        return None
    bad = [r for r in range(n) if not ok[r]]
    where = f"with {n} ranks and a tensor of shape {tuple(xs[0].shape)}"
    if all(is_close(returns[r], expected, *tol) for r in bad):
        return (
            f"{where}: the function returned the right values, but `tensor` itself is not "
            f"updated on rank(s) {bad}: work in place (e.g. tensor.copy_(result))"
        )
    if all(is_close(afters[r], xs[r].double(), 0, 0) for r in bad):
        if which.average and 0 not in bad:
            return (
                f"{where}: rank 0 holds the average but the workers {bad} still hold their "
                "own values: the server must send the average back to every worker"
            )
        return f"{where}: `tensor` is unchanged on rank(s) {bad}: write the result into it"
    if which.average and all(is_close(afters[r], total, *tol) for r in bad):
        return f"{where}: rank(s) {bad} hold the sum, not the average: divide by the world size"
    if not which.average and all(is_close(afters[r], total / n, *tol) for r in bad):
        return f"{where}: rank(s) {bad} hold the average: {which.function} must SUM"
    rank = bad[0]
    got = afters[rank]
    detail = _first_difference(got, expected)
    if which.average or not isinstance(got, torch.Tensor) or got.shape != expected.shape:
        return f"{where}: rank {rank} holds a wrong result ({detail}; wrong on rank(s) {bad})"
    flat = got.double().flatten()
    pieces = torch.tensor_split(torch.arange(flat.numel()), n)
    wrong = [
        c
        for c, idx in enumerate(pieces)
        if idx.numel() and not is_close(flat[idx], expected.flatten()[idx], *tol)
    ]
    return (
        f"{where}: rank {rank} is wrong in chunk(s) {wrong} of torch.tensor_split(flat, {n}) "
        f"({detail}; wrong on rank(s) {bad}){_partial_sums(flat, xs, wrong, tol)}"
    )


def _numbers(items) -> str:
    items = list(items)
    return ", ".join(items[:-1]) + f" and {items[-1]}" if len(items) > 1 else items[0]


def judge(which: Collective) -> Callable[[dict, dict], str]:
    """The oracle judge: every rank's tensor equals the sum (or average) of the inputs."""

    def check(inputs: dict, outputs: dict) -> str:
        got_cases = outputs.get("cases", []) if isinstance(outputs, dict) else []
        if len(got_cases) != len(inputs["cases"]):
            raise CheckFailed(f"expected {len(inputs['cases'])} runs, got {len(got_cases)}")
        for case, got in zip(inputs["cases"], got_cases, strict=True):
            n, data = case["world_size"], case["data"]
            if len(got) != n or any(len(g) != len(data[0]) for g in got):
                raise CheckFailed(f"expected {len(data[0])} results from each of {n} ranks")
            for j in range(len(data[0])):
                why = problem(
                    which,
                    [data[r][j] for r in range(n)],
                    [got[r][j]["after"] for r in range(n)],
                    [got[r][j]["returned"] for r in range(n)],
                )
                if why:
                    raise CheckFailed(why)
        worlds = _numbers(str(c["world_size"]) for c in inputs["cases"])
        tensors = inputs["cases"][0]["data"][0]
        if len(inputs["cases"]) == 1:
            sizes = _numbers("x".join(map(str, t.shape)) for t in tensors)
            what = f"for tensors of {sizes} elements"
        else:
            what = (
                f"for {len(tensors)} tensors each (float32 and float64, lengths not divisible by n)"
            )
        said = f"{which.function}() from {which.file} on {worlds} ranks"
        return f"{said} equals {which.equals} {what}"

    return check
