"""Checks of lab 2 (processes and collectives).

Visible checks (called by the notebook's test cells, in the student's kernel):

- :func:`ring_all_reduce` and :func:`parameter_server_average` run the student's file
  (``ring.py``, ``ps.py``) on 3 processes with ``ddp_lab.launch.torchrun``; each rank runs this
  module (``python -m ddp_lab.checks.lab02 ring ring.py``), compares the student's result with
  ``dist.all_reduce`` and hands every rank's tensors back with ``write_result``;
- :func:`ring_time` and :func:`fit_alpha_beta` call the student's functions directly.

``EXERCISES`` say how the grader judges the same four test cells outside the kernel: the ring
on 2 and 3 ranks, the parameter server on 3, the cost model on data drawn at grading time.
Under ``nbgrader autograde`` the two distributed visible checks only say so and return: the
grader runs the same comparison itself, and its verdict (with the same messages) replaces the
cell's outcome, so starting two more torchrun jobs in the kernel would only cost time.
While the student's code runs, the built-in collectives (:data:`COLLECTIVES`) and the
reference implementations in :mod:`ddp_lab.collectives` raise, and a call that does not
return within :data:`CALL_TIMEOUT_S` (a deadlock) ends its rank with a one-line error that
says why, instead of waiting for the whole job's timeout.
"""

from __future__ import annotations

import gc
import math
import os
import runpy
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from ddp_lab.checks import CheckFailed, launch_problem, make_verdict, passed
from ddp_lab.grading.exercise import Exercise

LAB = "lab02_collectives"
verdict = make_verdict(LAB)

#: ``torch.distributed`` functions that move data between many ranks: refused in the exercises.
COLLECTIVES = tuple(
    name
    for name in (
        "all_reduce",
        "all_reduce_coalesced",
        "reduce",
        "broadcast",
        "broadcast_object_list",
        "all_gather",
        "all_gather_coalesced",
        "all_gather_into_tensor",
        "all_gather_object",
        "all_gather_single",
        "reduce_scatter",
        "reduce_scatter_single",
        "reduce_scatter_tensor",
        "all_to_all",
        "all_to_all_single",
        "gather",
        "gather_into_tensor",
        "gather_object",
        "gather_single",
        "scatter",
        "scatter_object_list",
        "_all_gather_base",
        "_reduce_scatter_base",
        "_broadcast_coalesced",
    )
    if hasattr(dist, name)
)
#: The reference implementations a solution must not call (``ddp_lab.collectives``).
REFERENCES = (
    "ring_all_reduce",
    "ring_reduce_scatter",
    "ring_all_gather",
    "_exchange",
    "parameter_server_average",
    "ring_allreduce_time",
    "fit_alpha_beta",
)

#: Modules a solution cell may not name (the grader refuses it before running the cell).
REFERENCE_MODULES = ("ddp_lab.collectives",)

#: The visible checks of the distributed exercises: 3 ranks, these tensor shapes.
CHECK_WORLD_SIZE = 3
CHECK_SHAPES = [(1,), (2,), (3,), (7,), (10,), (3, 5)]
#: Seconds a visible check's torchrun job may take before it is killed (a hang).
CHECK_TIMEOUT_S = 40.0
#: Seconds one call of the student's collective may take on a rank (tiny tensors: ms).
CALL_TIMEOUT_S = 15.0

KINDS = {  # kind -> (file the notebook writes, function it defines, what the result must be)
    "ring": ("ring.py", "ring_all_reduce", "dist.all_reduce"),
    "ps": ("ps.py", "parameter_server_average", "dist.all_reduce / world_size"),
}


# --------------------------------------------------------------------------- student code


def _refuse_reference(*args, **kwargs):
    raise RuntimeError(
        "this exercise calls the grader's reference in ddp_lab.collectives: write it yourself"
    )


def _refuser(name: str) -> Callable:
    def refuse(*args, **kwargs):
        raise RuntimeError(
            f"torch.distributed.{name} is not allowed in this exercise: build it from "
            "send/recv (isend/irecv) yourself"
        )

    return refuse


@contextmanager
def own_code_only(forbid: Sequence[str] = ()) -> Iterator[None]:
    """While the block runs, ``forbid``-den collectives and ``ddp_lab``'s references raise.

    The collectives are replaced in ``torch.distributed`` and in its ``distributed_c10d``
    module; the reference functions of :mod:`ddp_lab.collectives` get a body that raises, so
    that also a name imported before the block (``from ddp_lab.collectives import ...``)
    refuses to work. Everything is restored afterwards.

    Example:
        >>> with own_code_only(["all_reduce"]):
        ...     dist.all_reduce(torch.zeros(1))
        Traceback (most recent call last):
        RuntimeError: torch.distributed.all_reduce is not allowed in this exercise: ...
    """
    import torch.distributed.distributed_c10d as c10d

    import ddp_lab.collectives as reference

    saved_attrs = []
    for name in forbid:
        for module in (dist, c10d):
            if hasattr(module, name):
                saved_attrs.append((module, name, getattr(module, name)))
                setattr(module, name, _refuser(name))
    saved_codes = [(getattr(reference, n), getattr(reference, n).__code__) for n in REFERENCES]
    for fn, _ in saved_codes:
        fn.__code__ = _refuse_reference.__code__
    try:
        yield
    finally:
        for fn, code in saved_codes:
            fn.__code__ = code
        for module, name, value in reversed(saved_attrs):
            setattr(module, name, value)


def student_function(ns: dict, filename: str, name: str, folder: str | Path = ".") -> Callable:
    """The student's function ``name``: from the notebook's code, else from ``filename``.

    A ``%%writefile`` cell puts the code into a file, which is run here (with the built-in
    collectives and the references refused while it loads).
    """
    if callable(ns.get(name)):
        return ns[name]
    path = Path(folder) / filename
    if not path.is_file():
        raise FileNotFoundError(f"{filename} was not written: keep %%writefile {filename} on top")
    with own_code_only(COLLECTIVES):
        module = runpy.run_path(str(path), run_name="__student__")
    if not callable(module.get(name)):
        raise NameError(f"{filename} defines no function {name}()")
    return module[name]


@contextmanager
def exit_on_student_error(filename: str) -> Iterator[None]:
    """Turn an exception of the student's code on one rank into one line and ``exit(1)``.

    torchrun then stops the other ranks at once (they would otherwise wait for this one), and
    the last line of the rank's log, which the messages quote, is the student's error and the
    line of their file rather than a traceback through the checks.
    """
    try:
        yield
    except Exception as err:  # noqa: BLE001 - any error of the student's code
        lines = [
            f.lineno
            for f in traceback.extract_tb(err.__traceback__)
            if Path(f.filename).name == filename
        ]
        if isinstance(err, SyntaxError):  # its message names the file and line already
            lines = []
        said = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
        at = f" ({filename} line {lines[-1]})" if lines else ""
        print(f"{said}{at}", file=sys.stderr, flush=True)
        sys.exit(1)


HANG_HINTS = {
    "ring": "Does every rank block in recv (or in a blocking send) before its own message is "
    "on its way? Post the send with dist.isend first, then recv, then wait()",
    "ps": "Does every worker send once and receive once, and does the server receive from "
    "every worker before it sends the average back to each of them?",
}


@contextmanager
def watchdog(kind: str, tensor: torch.Tensor, seconds: float | None = None) -> Iterator[None]:
    """End this rank with a clear one-line error when the student's call does not return.

    A deadlock would otherwise last until the whole job's timeout and end with a generic
    message; after ``seconds`` (default :data:`CALL_TIMEOUT_S`) this prints what hung and
    the likely cause, and exits; torchrun then stops the other ranks.
    """
    seconds = CALL_TIMEOUT_S if seconds is None else seconds
    name = KINDS[kind][1]

    def fire() -> None:
        where = (
            f"rank {dist.get_rank()} of {dist.get_world_size()}" if dist.is_initialized() else ""
        )
        print(
            f"TimeoutError: {name}() did not return within {seconds:g} s on {where} (a tensor "
            f"of shape {tuple(tensor.shape)}): the ranks wait for each other. {HANG_HINTS[kind]}",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


# --------------------------------------------------------------------------- diagnosis


def _close(got, expected: torch.Tensor, atol: float, rtol: float) -> bool:
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(expected.shape):
        return False
    got_d, exp_d = got.detach().double(), expected.double()
    return bool(torch.isfinite(got_d).all()) and bool(
        ((got_d - exp_d).abs() <= atol + rtol * exp_d.abs()).all()
    )


def _tolerance(dtype: torch.dtype) -> tuple[float, float]:
    return (1e-9, 1e-9) if dtype == torch.float64 else (1e-5, 1e-5)


def _first_difference(got, expected: torch.Tensor) -> str:
    if not isinstance(got, torch.Tensor):
        return f"expected a tensor, got {type(got).__name__}"
    if tuple(got.shape) != tuple(expected.shape):
        return f"expected shape {tuple(expected.shape)}, got {tuple(got.shape)}"
    diff = (got.detach().double() - expected.double()).abs().flatten()
    diff = torch.nan_to_num(diff, nan=math.inf)
    i = int(torch.argmax(diff))
    return (
        f"at flat index {i} expected {expected.flatten()[i].item():.6g}, "
        f"got {got.flatten()[i].item():.6g}"
    )


def collective_problem(
    kind: str,
    xs: Sequence[torch.Tensor],
    afters: Sequence,
    returns: Sequence | None = None,
    expected: torch.Tensor | None = None,
) -> str | None:
    """What is wrong with one call of a hand-written collective on every rank, or None.

    Args:
        kind: ``"ring"`` (the result must be the sum) or ``"ps"`` (the average).
        xs: each rank's tensor before the call.
        afters: each rank's tensor after the call (the function works in place).
        returns: what the function returned on each rank when that was a *different* tensor
            (None otherwise).
        expected: the correct result (default: computed from ``xs``).

    Returns:
        A message naming the world size, the shape, the ranks and what differs, with a hint
        at the typical mistake; None when every rank holds the right result.
    """
    n = len(xs)
    total = torch.stack([x.double() for x in xs]).sum(0)
    if expected is None:
        expected = total if kind == "ring" else total / n
    expected = expected.double()
    atol, rtol = _tolerance(xs[0].dtype)
    ok = [_close(a, expected, atol, rtol) for a in afters]
    if all(ok):
        return None
    bad = [r for r in range(n) if not ok[r]]
    where = f"with {n} ranks and a tensor of shape {tuple(xs[0].shape)}"
    returns = returns or [None] * n
    if all(_close(returns[r], expected, atol, rtol) for r in bad):
        return (
            f"{where}: the function returned the right values, but `tensor` itself is not "
            f"updated on rank(s) {bad}: work in place (e.g. tensor.copy_(result))"
        )
    if all(_close(afters[r], xs[r].double(), 0, 0) for r in bad):
        if kind == "ps" and 0 not in bad:
            return (
                f"{where}: rank 0 holds the average but the workers {bad} still hold their "
                "own values: the server must send the average back to every worker"
            )
        return f"{where}: `tensor` is unchanged on rank(s) {bad}: write the result into it"
    if kind == "ps" and all(_close(afters[r], total, atol, rtol) for r in bad):
        return f"{where}: rank(s) {bad} hold the sum, not the average: divide by the world size"
    if kind == "ring" and all(_close(afters[r], total / n, atol, rtol) for r in bad):
        return f"{where}: rank(s) {bad} hold the average: ring_all_reduce must SUM"
    rank = bad[0]
    detail = _first_difference(afters[rank], expected)
    if (
        kind == "ring"
        and isinstance(afters[rank], torch.Tensor)
        and afters[rank].shape == (expected.shape)
    ):
        got_flat, exp_flat = afters[rank].double().flatten(), expected.flatten()
        index = torch.arange(exp_flat.numel())
        wrong = [
            c
            for c, idx in enumerate(torch.tensor_split(index, n))
            if idx.numel() and not _close(got_flat[idx], exp_flat[idx], atol, rtol)
        ]
        return (
            f"{where}: rank {rank} is wrong in chunk(s) {wrong} of torch.tensor_split(flat, "
            f"{n}) ({detail}; wrong on rank(s) {bad}). Each phase needs n - 1 steps; in step s "
            "of the reduce-scatter rank r sends chunk (r - s) % n and adds into chunk "
            "(r - s - 1) % n. A ring that skips a step leaves partial sums"
        )
    return f"{where}: rank {rank} holds a wrong result ({detail}; wrong on rank(s) {bad})"


def ring_time_problem(got, sizes: np.ndarray, n: int, alpha: float, bandwidth: float) -> str | None:
    """What is wrong with a ``ring_time`` result, or None (the alpha-beta formula holds)."""
    from ddp_lab.collectives import ring_allreduce_time

    if got is None:
        return "ring_time returned None: return the predicted time"
    want = np.atleast_1d(np.asarray(ring_allreduce_time(sizes, n, alpha, bandwidth)))
    got = np.atleast_1d(np.asarray(got, dtype=float)).reshape(-1)
    if got.shape != want.shape:
        return f"expected {want.size} time(s), one per size, got {got.size}"
    if np.allclose(got, want, rtol=1e-6, atol=0):
        return None
    where = f"n = {n}, alpha = {alpha:.3g} s, B = {bandwidth:.3g} B/s, S = {sizes.flat[0]:.4g} B"
    said = f"{where}: expected {want[0]:.6g} s, got {got[0]:.6g} s"
    steps = 2 * (n - 1)
    hints = [
        (sizes / bandwidth + steps * alpha, "the bandwidth term needs the factor 2(n - 1)/n"),
        (steps / n * sizes / bandwidth + alpha, "every one of the 2(n - 1) steps pays alpha"),
        (steps / n * sizes / bandwidth, "the latency term 2(n - 1) * alpha is missing"),
        (steps * alpha + 8 * steps / n * sizes / bandwidth, "sizes and B are both in bytes"),
    ]
    for wrong, hint in hints:
        if np.allclose(got, np.atleast_1d(wrong), rtol=1e-6, atol=0):
            return f"{said}: {hint}"
    return f"{said}: T = 2(n - 1) * alpha + 2(n - 1)/n * S / B"


def fit_problem(got, sizes: np.ndarray, seconds: np.ndarray, n: int) -> str | None:
    """What is wrong with a ``fit_alpha_beta`` result, or None (it matches the reference)."""
    from ddp_lab.collectives import fit_alpha_beta as reference_fit

    if not isinstance(got, (tuple, list)) or len(got) != 2:
        what = type(got).__name__ if not isinstance(got, list) else f"{len(got)} values"
        return f"expected a pair (alpha, bandwidth), got {what}"
    try:
        alpha, bandwidth = float(got[0]), float(got[1])
    except (TypeError, ValueError):
        return f"expected two numbers (alpha, bandwidth), got {got!r}"[:300]
    ref_alpha, ref_bw = reference_fit(sizes, seconds, n, relative=True)

    def same(a: float, b: float) -> bool:
        return math.isfinite(a) and abs(a - b) <= 1e-3 * abs(b)

    if same(alpha, ref_alpha) and same(bandwidth, ref_bw):
        return None
    said = (
        f"n = {n}, {len(sizes)} sizes: expected alpha = {ref_alpha:.4g} s and B = "
        f"{ref_bw:.4g} B/s, got alpha = {alpha:.4g} s and B = {bandwidth:.4g} B/s"
    )
    abs_alpha, abs_bw = reference_fit(sizes, seconds, n, relative=False)
    if same(alpha, abs_alpha) and same(bandwidth, abs_bw):
        return f"{said}: you minimised absolute errors; divide each equation by its time"
    if same(alpha, ref_bw) and same(bandwidth, ref_alpha):
        return f"{said}: return (alpha, bandwidth), in that order"
    if same(bandwidth * 2 * (n - 1) / n, ref_bw):
        return f"{said}: the bandwidth term needs the factor 2(n - 1)/n"
    if same(alpha / (2 * (n - 1)), ref_alpha):
        return f"{said}: alpha is paid 2(n - 1) times; the unknown is alpha itself"
    if same(bandwidth, 1 / ref_bw):
        return f"{said}: the fit gives 1/B; return B"
    return f"{said}: fit 2(n - 1) * alpha + 2(n - 1)/n * S * (1/B) = T, each row divided by T"


# --------------------------------------------------------------------------- visible checks


def _run_visible(kind: str, path: str, world_size: int) -> dict:
    from ddp_lab.launch import LaunchError, LaunchTimeout, torchrun

    filename, _, _ = KINDS[kind]
    if not Path(path).is_file():
        raise CheckFailed(f"{path} not found in {Path.cwd()}: run the %%writefile cell first")
    try:
        res = torchrun(
            "ddp_lab.checks.lab02",
            [kind, str(Path(path).resolve())],
            nproc=world_size,
            module=True,
            timeout=CHECK_TIMEOUT_S,
            stream=False,
        )
    except LaunchTimeout:
        raise CheckFailed(
            f"{path} did not finish within {CHECK_TIMEOUT_S:g} s on {world_size} ranks and was "
            "stopped: the ranks are waiting for each other. Does every rank block in recv "
            "(or send) before its own message is on its way? Post the send with dist.isend "
            "first (see 'What goes wrong')."
        ) from None
    except LaunchError as err:
        raise CheckFailed(launch_problem(err, Path(path).name)) from None
    if not res.result:
        raise CheckFailed(f"{path}: the check's workers returned no result")
    return res.result


def _visible(kind: str, path: str, world_size: int) -> None:
    filename, name, reference = KINDS[kind]
    if os.environ.get("NBGRADER_EXECUTION") == "autograde":  # the verdict below decides
        print(f"{name}() from {Path(path).name}: checked by the grader, outside this kernel")
        return
    t0 = time.monotonic()
    result = _run_visible(kind, path, world_size)
    ranks = result["ranks"]
    for i, shape in enumerate(CHECK_SHAPES):
        recs = [ranks[r][i] for r in range(world_size)]
        xs = [torch.tensor(rec["x"], dtype=torch.float64).reshape(shape) for rec in recs]
        problem = collective_problem(
            kind,
            xs,
            [torch.tensor(rec["after"], dtype=torch.float64).reshape(shape) for rec in recs],
            [_tensor_or_none(rec["returned"], shape) for rec in recs],
            torch.tensor(recs[0]["expected"], dtype=torch.float64).reshape(shape),
        )
        if problem:
            raise CheckFailed(problem)
    sizes = ", ".join(str(math.prod(s)) for s in CHECK_SHAPES[:-1])
    passed(
        f"{name}() from {Path(path).name} on {world_size} ranks equals {reference} for "
        f"tensors of {sizes} and 3x5 elements ({time.monotonic() - t0:.1f} s)"
    )


def _tensor_or_none(values, shape) -> torch.Tensor | None:
    if values is None:
        return None
    try:
        return torch.tensor(values, dtype=torch.float64).reshape(shape)
    except (TypeError, ValueError, RuntimeError):
        return None


def ring_all_reduce(path: str = "ring.py", world_size: int = CHECK_WORLD_SIZE) -> None:
    """Run ``ring_all_reduce`` from ``path`` on ``world_size`` ranks; compare with all_reduce.

    Tensors of 1, 2, 3, 7, 10 and 3x5 elements (fewer than the ranks, not divisible by them,
    2-D). The built-in collectives raise while your function runs.

    Raises:
        CheckFailed: naming the rank, the tensor and the wrong chunks; or the error your code
            raised; or that the job hung and was stopped after ``CHECK_TIMEOUT_S`` seconds.
    """
    _visible("ring", path, world_size)


def parameter_server_average(path: str = "ps.py", world_size: int = CHECK_WORLD_SIZE) -> None:
    """Run ``parameter_server_average`` from ``path`` on ``world_size`` ranks.

    Every rank must end with ``dist.all_reduce(tensor) / world_size``.

    Raises:
        CheckFailed: naming the rank, the tensor and what differs (e.g. the sum instead of
            the average, workers that never got the average back).
    """
    _visible("ps", path, world_size)


def ring_time(fn: Callable) -> None:
    """Check ``ring_time(size_bytes, world_size, alpha, bandwidth)`` against the model.

    Raises:
        CheckFailed: with the expected and received time and a hint (e.g. a missing factor).
    """
    sizes = np.array([1e3, 1e6, 1e9])
    cases = [(sizes, 4, 1e-5, 1e10), (sizes, 2, 3e-5, 2e9), (np.array([5e8]), 8, 2e-6, 5e10)]
    for s, n, alpha, bandwidth in cases:
        with own_code_only():
            got = fn(s if s.size > 1 else float(s[0]), n, alpha, bandwidth)
        if problem := ring_time_problem(got, s, n, alpha, bandwidth):
            raise CheckFailed(problem)
    with own_code_only():
        one = fn(1e6, 1, 1e-5, 1e10)
    if not np.allclose(np.asarray(one, dtype=float), 0.0):
        raise CheckFailed(f"with one rank there is nothing to send: expected 0 s, got {one}")
    passed("ring_time follows T = 2(n - 1) * alpha + 2(n - 1)/n * S / B (arrays and numbers)")


def _synthetic_times(gen: torch.Generator, n: int, points: int, noise: float):
    from ddp_lab.collectives import ring_allreduce_time

    def log_uniform(lo: float, hi: float, k: int = 1) -> np.ndarray:
        u = torch.rand(k, generator=gen, dtype=torch.float64).numpy()
        return np.exp(np.log(lo) + u * (np.log(hi) - np.log(lo)))

    alpha, bandwidth = float(log_uniform(2e-6, 1e-4)[0]), float(log_uniform(1e8, 2e10)[0])
    sizes = np.sort(np.round(log_uniform(2**7, 2**28, points)))
    noise_factor = 1 + noise * torch.randn(points, generator=gen, dtype=torch.float64).numpy()
    seconds = ring_allreduce_time(sizes, n, alpha, bandwidth) * noise_factor
    return sizes, seconds, alpha, bandwidth


def fit_alpha_beta(fn: Callable) -> None:
    """Check ``fit_alpha_beta(sizes, seconds, world_size)`` on synthetic noisy times.

    Raises:
        CheckFailed: with the expected and fitted alpha and B and a hint at the mistake.
    """
    gen = torch.Generator().manual_seed(2)
    for n in (4, 2):
        sizes, seconds, _, _ = _synthetic_times(gen, n, 12, 0.02)
        with own_code_only():
            got = fn(sizes.copy(), seconds.copy(), n)
        if problem := fit_problem(got, sizes, seconds, n):
            raise CheckFailed(problem)
    passed("fit_alpha_beta recovers alpha and B (least squares on relative errors, n = 4, 2)")


# --------------------------------------------------------------------------- exercises


def _collective_inputs(world_sizes: Sequence[int]) -> Callable[[torch.Generator], dict]:
    def make(gen: torch.Generator) -> dict:
        cases = []
        for n in world_sizes:
            small = int(torch.randint(n + 1, 40, (1,), generator=gen))
            big = int(torch.randint(500, 3000, (1,), generator=gen))
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

    return make


def _collective_run_rank(kind: str) -> Callable:
    filename, name, _ = KINDS[kind]

    def run_rank(ns: dict, inputs: dict, case: dict, rank: int, world_size: int) -> list:
        with exit_on_student_error(filename):
            fn = student_function(ns, filename, name)
        out = []
        for x in case["data"][rank]:
            t = x.clone()
            with watchdog(kind, t), exit_on_student_error(filename), own_code_only(COLLECTIVES):
                ret = fn(t)
            other = isinstance(ret, torch.Tensor) and ret is not t
            out.append({"after": t, "returned": ret.detach().clone() if other else None})
        return out

    return run_rank


def _collective_judge(kind: str) -> Callable[[dict, dict], str]:
    _, name, reference = KINDS[kind]

    def judge(inputs: dict, outputs: dict) -> str:
        got_cases = outputs["cases"]
        if len(got_cases) != len(inputs["cases"]):
            raise CheckFailed(f"expected {len(inputs['cases'])} runs, got {len(got_cases)}")
        counts = []
        for case, got in zip(inputs["cases"], got_cases, strict=True):
            n = case["world_size"]
            for j in range(len(case["data"][0])):
                xs = [case["data"][r][j] for r in range(n)]
                recs = [got[r][j] for r in range(n)]
                problem = collective_problem(
                    kind, xs, [rec["after"] for rec in recs], [rec["returned"] for rec in recs]
                )
                if problem:
                    raise CheckFailed(problem)
            counts.append(f"{len(case['data'][0])} tensors on {n} ranks")
        return f"{name} equals {reference} ({', '.join(counts)}; lengths not divisible by n)"

    return judge


def _time_inputs(gen: torch.Generator) -> dict:
    def draw(n: int, k: int) -> dict:
        sizes = torch.exp(torch.empty(k, dtype=torch.float64).uniform_(4, 22, generator=gen))
        alpha = float(torch.empty(1).uniform_(1e-6, 1e-4, generator=gen))
        bandwidth = float(torch.empty(1).uniform_(1e8, 1e11, generator=gen))
        return {"sizes": sizes.round(), "n": n, "alpha": alpha, "bandwidth": bandwidth}

    n1, n2 = (int(v) for v in torch.randint(3, 65, (2,), generator=gen))
    return {"cases": [draw(n1, 9), draw(2, 5), draw(n2, 1), draw(1, 3)]}


def _time_run(ns: dict, inputs: dict, workdir: Path) -> dict:
    fn = ns["ring_time"]
    out = []
    for case in inputs["cases"]:
        sizes = case["sizes"].numpy()
        arg = float(sizes[0]) if sizes.size == 1 else sizes.copy()
        with own_code_only():
            got = fn(arg, case["n"], case["alpha"], case["bandwidth"])
        if got is not None:
            got = torch.as_tensor(np.asarray(got, dtype=np.float64)).reshape(-1)
        out.append(got)
    return {"times": out}


def _time_judge(inputs: dict, outputs: dict) -> str:
    for case, got in zip(inputs["cases"], outputs["times"], strict=True):
        sizes = case["sizes"].numpy()
        got = None if got is None else got.numpy()
        problem = ring_time_problem(got, sizes, case["n"], case["alpha"], case["bandwidth"])
        if problem:
            raise CheckFailed(problem)
    worlds = ", ".join(str(c["n"]) for c in inputs["cases"])
    return f"ring_time follows the alpha-beta model (n = {worlds}; arrays and a number)"


def _fit_inputs(gen: torch.Generator) -> dict:
    cases = []
    for n in (int(torch.randint(3, 9, (1,), generator=gen)), 16):
        sizes, seconds, _, _ = _synthetic_times(gen, n, 14, 0.03)
        cases.append(
            {"sizes": torch.from_numpy(sizes), "seconds": torch.from_numpy(seconds), "n": n}
        )
    return {"cases": cases}


def _fit_run(ns: dict, inputs: dict, workdir: Path) -> dict:
    fn = ns["fit_alpha_beta"]
    out = []
    for case in inputs["cases"]:
        with own_code_only():
            got = fn(case["sizes"].numpy().copy(), case["seconds"].numpy().copy(), case["n"])
        if isinstance(got, (tuple, list)):
            got = [float(v) for v in got]
        out.append(got if isinstance(got, list) else None)
    return {"fits": out}


def _fit_judge(inputs: dict, outputs: dict) -> str:
    for case, got in zip(inputs["cases"], outputs["fits"], strict=True):
        sizes, seconds = case["sizes"].numpy(), case["seconds"].numpy()
        if problem := fit_problem(got, sizes, seconds, case["n"]):
            raise CheckFailed(problem)
    worlds = " and ".join(str(c["n"]) for c in inputs["cases"])
    return f"fit_alpha_beta recovers alpha and B from noisy times (n = {worlds})"


EXERCISES = [
    Exercise(
        "test_ex1_ring_all_reduce",
        ("ex1_ring_all_reduce",),
        "ring all-reduce from send/recv",
        _collective_inputs([2, 3]),
        _collective_judge("ring"),
        run_rank=_collective_run_rank("ring"),
        forbid=COLLECTIVES,
        forbid_modules=REFERENCE_MODULES,
        timeout=90,
    ),
    Exercise(
        "test_ex2_parameter_server",
        ("ex2_parameter_server",),
        "parameter-server average",
        _collective_inputs([3]),
        _collective_judge("ps"),
        run_rank=_collective_run_rank("ps"),
        forbid=COLLECTIVES,
        forbid_modules=REFERENCE_MODULES,
        timeout=60,
    ),
    Exercise(
        "test_ex3_ring_time",
        ("ex3_ring_time",),
        "alpha-beta model of the ring",
        _time_inputs,
        _time_judge,
        run=_time_run,
        forbid_modules=REFERENCE_MODULES,
    ),
    Exercise(
        "test_ex4_fit_alpha_beta",
        ("ex4_fit_alpha_beta",),
        "fit alpha and B to measured times",
        _fit_inputs,
        _fit_judge,
        run=_fit_run,
        forbid_modules=REFERENCE_MODULES,
    ),
]


# --------------------------------------------------------------------------- the worker


def _worker(kind: str, path: str) -> None:
    """One rank of a visible check: run the student's function, compare with all_reduce."""
    filename, name, _ = KINDS[kind]
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    with exit_on_student_error(Path(path).name):
        fn = student_function({}, Path(path).name, name, Path(path).parent)
    records = []
    for i, shape in enumerate(CHECK_SHAPES):
        gen = torch.Generator().manual_seed(1000 * i + rank)
        x = torch.randint(-9, 10, shape, generator=gen).double()
        expected = x.clone()
        dist.all_reduce(expected)
        if kind == "ps":
            expected /= n
        t = x.clone()
        with watchdog(kind, t), exit_on_student_error(Path(path).name), own_code_only(COLLECTIVES):
            ret = fn(t)
        other = isinstance(ret, torch.Tensor) and ret is not t
        records.append(
            {"x": x, "after": t, "expected": expected, "returned": ret.detach() if other else None}
        )
    everyone = [None] * n
    dist.all_gather_object(everyone, records)
    from ddp_lab.launch import write_result

    write_result({"world_size": n, "ranks": everyone})
    gc.collect()  # see ddp_lab.dist.teardown
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(*sys.argv[1:3])
