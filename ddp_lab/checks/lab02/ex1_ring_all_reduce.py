"""Exercise 1: a ring all-reduce from send/recv (``ring.py``), on every rank of one torchrun job.

Oracle: every rank must end with the element-wise sum of the ranks' inputs (what
``dist.all_reduce`` gives), in place, and return ``tensor`` itself (as the docstring
promises). Then the traffic, recorded by the checker in each rank
(:mod:`~ddp_lab.checks.lab02.traffic`): rank ``r`` sends only to ``(r + 1) % n``, and sends
``2(n - 1)/n`` of the tensor in all (within one chunk). A ring that sends the other way round
reaches the right sum and still fails; so does one that passes whole tensors around.

Case set, one job of 3 ranks: a run on 2 ranks (rank 2 sits it out) and a run on 3, each with
tensors of 1 element (fewer than the ranks), ``n - 1`` (or 3), a short and a long length that
``n`` does not divide, a multiple of ``n``, two 2-D shapes; float64, the last one float32;
values ``10 * randn``. The built-in collectives raise while the student's code runs, and a
call that deadlocks ends its rank after :data:`~ddp_lab.checks.lab02.common.CALL_TIMEOUT_S`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch

from ddp_lab.checks import guards
from ddp_lab.checks.contract import Exercise
from ddp_lab.checks.failure import CheckFailed, is_close
from ddp_lab.checks.lab02 import common, traffic
from ddp_lab.checks.values import kind, randint

#: The visible check's shapes (small integers, float64).
VISIBLE_SHAPES = [(1,), (2,), (3,), (7,), (10,), (3, 5)]
HANG_HINT = (
    "Does every rank block in recv (or in a blocking send) before its own message is on its "
    "way? Post the send with dist.isend first, then recv, then wait()"
)


def _tensors(gen: torch.Generator, n: int) -> list[list[torch.Tensor]]:
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
    return [
        [
            torch.randn(s, generator=gen, dtype=torch.float64).to(d) * 10
            for s, d in zip(shapes, dtypes, strict=True)
        ]
        for _ in range(n)
    ]


def make_inputs(gen: torch.Generator) -> dict:
    """One job of 3 ranks: a run on 2 ranks, then one on 3 (seven tensors per rank each)."""
    runs = [{"ranks": n, "data": _tensors(gen, n)} for n in (2, 3)]
    return {"cases": [{"world_size": common.JOB_RANKS, "runs": runs}]}


def visible_inputs(gen: torch.Generator) -> dict:
    """One job of 3 ranks: runs on 2 and on 3 ranks, :data:`VISIBLE_SHAPES` of small integers."""
    runs = []
    for n in (2, 3):
        data = []
        for rank in range(n):
            tensors = []
            for i, shape in enumerate(VISIBLE_SHAPES):
                g = torch.Generator().manual_seed(1000 * i + rank)
                tensors.append(torch.randint(-9, 10, shape, generator=g).double())
            data.append(tensors)
        runs.append({"ranks": n, "data": data})
    return {"cases": [{"world_size": common.JOB_RANKS, "runs": runs}]}


def run_rank(ns: dict, inputs: dict, case: dict, rank: int, world_size: int) -> list:
    """The student's ``ring_all_reduce`` on each of this rank's tensors of every run it takes
    part in, with the messages it sent (recorded from before the file loads)."""
    log: list = []
    found: dict = {}

    def load() -> None:
        fn = common.student_function(common.RING_FILE, "ring_all_reduce")
        found["fn"] = common.watched(fn, "a ring all-reduce", HANG_HINT)

    def one_run(run: dict) -> list[dict]:
        out = []
        for x in run["data"][rank]:
            t, start = x.clone(), len(log)
            returned = found["fn"](t)
            other = isinstance(returned, torch.Tensor) and returned is not t
            out.append(
                {
                    "after": t,
                    "returned": returned if other else None,
                    "itself": returned is t,
                    "sent": traffic.sends(log, start),
                }
            )
        return out

    with traffic.recorded(log):
        return common.each_run(case, rank, one_run, load)


# --------------------------------------------------------------------------- the judge


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


def value_problem(xs: Sequence[torch.Tensor], afters: Sequence, returns: Sequence) -> str | None:
    """What is wrong with every rank's tensor after one call, or None (all hold the sum)."""
    n = len(xs)
    expected = torch.stack([x.double() for x in xs]).sum(0)
    tol = common.tolerance(xs[0].dtype)
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
        return f"{where}: `tensor` is unchanged on rank(s) {bad}: write the result into it"
    if all(is_close(afters[r], expected / n, *tol) for r in bad):
        return f"{where}: rank(s) {bad} hold the average: ring_all_reduce must SUM"
    rank, got = bad[0], afters[bad[0]]
    detail = _first_difference(got, expected)
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
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


def _runs(inputs: dict, outputs: dict):
    """``(n, data, [rank outputs])`` of every run; raises on malformed outputs."""
    cases = outputs.get("cases", []) if isinstance(outputs, dict) else []
    if len(cases) != len(inputs["cases"]):
        raise CheckFailed(f"expected {len(inputs['cases'])} jobs, got {len(cases)}")
    for case, ranks in zip(inputs["cases"], cases, strict=True):
        for i, run in enumerate(case["runs"]):
            n, data = run["ranks"], run["data"]
            got = [ranks[r][i] if r < len(ranks) and i < len(ranks[r]) else None for r in range(n)]
            if any(not isinstance(g, list) or len(g) != len(data[0]) for g in got):
                raise CheckFailed(f"expected {len(data[0])} results from each of {n} ranks")
            yield n, data, got


def judge(inputs: dict, outputs: dict) -> str:
    """Every rank holds the sum and returns ``tensor`` itself; then every rank sent only right,
    2(n - 1)/n of the tensor."""
    for n, data, got in _runs(inputs, outputs):
        for j in range(len(data[0])):
            xs = [data[r][j] for r in range(n)]
            afters = [got[r][j]["after"] for r in range(n)]
            if why := value_problem(xs, afters, [got[r][j]["returned"] for r in range(n)]):
                raise CheckFailed(why)
        for j in range(len(data[0])):
            bad = [r for r in range(n) if got[r][j].get("itself") is not True]
            if bad:
                raise CheckFailed(
                    f"with {n} ranks and a tensor of shape {tuple(data[0][j].shape)}: the sum is "
                    f"right, but ring_all_reduce returned something other than `tensor` itself "
                    f"on rank(s) {bad}; the docstring promises `tensor`, holding the sum "
                    "(return tensor)"
                )
        for j in range(len(data[0])):
            sent = [got[r][j]["sent"] for r in range(n)]
            if why := traffic.ring_problem(tuple(data[0][j].shape), sent, n):
                raise CheckFailed(why)
    runs = inputs["cases"][0]["runs"]
    tensors = runs[0]["data"][0]
    if tensors[0].dtype == torch.float32 or any(t.dtype == torch.float32 for t in tensors):
        what = f"{len(tensors)} tensors each (float32 and float64, lengths not divisible by n)"
    else:
        what = "tensors of " + common.numbers("x".join(map(str, t.shape)) for t in tensors)
        what += " elements"
    return (
        f"ring_all_reduce() from ring.py on {common.worlds(inputs)} ranks equals "
        f"dist.all_reduce (the sum over the ranks) for {what}; every rank sent only to its "
        "right neighbour, 2(n - 1)/n of the tensor"
    )


EXERCISE = Exercise(
    "test_ex1_ring_all_reduce",
    ("ex1_ring_all_reduce",),
    "ring all-reduce from send/recv",
    make_inputs,
    judge,
    run_rank=run_rank,
    forbid=guards.COLLECTIVES,
    timeout=90,
    visible_inputs=visible_inputs,
    files=(common.RING_FILE,),
)
