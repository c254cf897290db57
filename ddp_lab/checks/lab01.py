"""Checks of lab 1 (data parallelism in one process).

Five exercises, each judged on its own solution cell (15 points):

1. ``split_batch`` (3): shards that cover every sample once, in order, sizes within one;
2. ``average_gradients`` (2): the mean over replicas, parameter by parameter;
3. ``data_parallel_gradients`` (4): replicas on unequal shards, combined with weights
   ``B_k / B`` so that they equal the full-batch gradient, the model left untouched;
4. ``combine_shard_stats`` (3): BatchNorm's batch mean and (biased) variance from
   per-shard statistics and counts;
5. ``dataparallel_step_time`` (3): the ``nn.DataParallel`` cost model of the notebook.

The visible checks run the student's function in the kernel on fixed small inputs and
reuse the judges, so the message a student sees is the message the grader gives. The
references below are float64.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ddp_lab.checks import CheckFailed, assert_close, make_verdict, passed, require
from ddp_lab.grading.exercise import Exercise

LAB = "lab01_data_parallel"
verdict = make_verdict(LAB)

# Tensors are compared with float64 references, to float32 precision: tight enough to reject
# every wrong formula (they are off by 1e-3 or more), loose enough for a right answer that
# computes in float32 somewhere (``counts.float()``, ``torch.zeros(shape)`` accumulators).
ATOL, RTOL = 1e-6, 1e-5


# --- references -----------------------------------------------------------------------


def shard_sizes(batch: int, n: int) -> list[int]:
    """The balanced split of ``batch`` samples into ``n`` shards (first ``batch % n`` larger).

    Example:
        >>> shard_sizes(10, 4)
        [3, 3, 2, 2]
    """
    base, extra = divmod(batch, n)
    return [base + 1 if k < extra else base for k in range(n)]


def reference_average_gradients(grads: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """Mean over replicas of each parameter's gradient (``grads[replica][parameter]``).

    Example:
        >>> reference_average_gradients([[torch.ones(2)], [torch.zeros(2)]])
        [tensor([0.5000, 0.5000])]
    """
    return [torch.stack(g).mean(0) for g in zip(*grads, strict=True)]


def make_mlp(dims: list[int]) -> nn.Sequential:
    """A float64 MLP ``Linear -> Tanh -> ... -> Linear`` with layer widths ``dims``.

    Example:
        >>> [tuple(p.shape) for p in make_mlp([3, 4, 2]).parameters()]
        [(4, 3), (4,), (2, 4), (2,)]
    """
    layers: list[nn.Module] = []
    for i, (d_in, d_out) in enumerate(zip(dims[:-1], dims[1:], strict=True)):
        if i:
            layers.append(nn.Tanh())
        layers.append(nn.Linear(d_in, d_out))
    return nn.Sequential(*layers).double()


def loss_gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """Gradients of the mean cross-entropy of ``model`` on ``(x, y)``; ``model`` is unchanged.

    Example:
        >>> m = make_mlp([3, 2])
        >>> x, y = torch.randn(4, 3, dtype=torch.float64), torch.tensor([0, 1, 0, 1])
        >>> g = loss_gradients(m, x, y)
        >>> len(g), m[0].weight.grad is None
        (2, True)
    """
    params = list(model.parameters())
    return list(torch.autograd.grad(F.cross_entropy(model(x), y), params))


def step_time_terms(
    n: int,
    *,
    compute_s: float,
    param_bytes: float,
    batch_bytes: float,
    output_bytes: float,
    bandwidth: float,
    host_s: float,
) -> dict[str, float]:
    """The terms of the notebook's ``nn.DataParallel`` step-time model, in seconds.

    Example:
        >>> t = step_time_terms(2, compute_s=1.0, param_bytes=1e9, batch_bytes=1e9,
        ...                     output_bytes=0.0, bandwidth=1e9, host_s=0.0)
        >>> sum(t.values())
        3.0
    """
    return {
        "compute": compute_s / n,
        "replicate": (n - 1) * param_bytes / bandwidth,
        "reduce": (n - 1) * param_bytes / bandwidth,
        "scatter": (n - 1) / n * batch_bytes / bandwidth,
        "gather": 2 * (n - 1) / n * output_bytes / bandwidth,
        "python": n * host_s,
    }


def reference_combine_shard_stats(
    means: torch.Tensor, variances: torch.Tensor, counts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and biased variance of the union of shards from their means, variances, counts.

    Example:
        >>> m, v = reference_combine_shard_stats(torch.tensor([[0.0], [2.0]]),
        ...                                      torch.zeros(2, 1), torch.tensor([1, 1]))
        >>> m.item(), v.item()
        (1.0, 1.0)
    """
    w = counts.to(means.dtype).unsqueeze(1)
    mean = (w * means).sum(0) / w.sum()
    var = (w * (variances + (means - mean) ** 2)).sum(0) / w.sum()
    return mean, var


# --- helpers ----------------------------------------------------------------------------


def _plain(value):
    """A student's value made saveable: detached tensor copies, numbers, else a type tag."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (bool, int, float)):
        return value
    return f"<{type(value).__name__}>"


def _plain_list(value) -> list | str:
    if not isinstance(value, (list, tuple)):
        return f"<{type(value).__name__}>"
    return [_plain(v) for v in value]


def _kind(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, str) and value.startswith("<"):
        return f"a {value.strip('<>')}"
    return f"a {type(value).__name__}"


def _close(got, expected: list[torch.Tensor], atol: float, rtol: float) -> bool:
    if not isinstance(got, list) or len(got) != len(expected):
        return False
    for g, e in zip(got, expected, strict=True):
        if not isinstance(g, torch.Tensor) or g.shape != e.shape:
            return False
        if not torch.allclose(g.detach().double(), e.double(), atol=atol, rtol=rtol):
            return False
    return True


def _randint(gen: torch.Generator, low: int, high: int) -> int:
    """A random int in ``[low, high]`` (both ends included)."""
    return int(torch.randint(low, high + 1, (1,), generator=gen))


def _gradient_list(got, expected: list[torch.Tensor], names: list[str], what: str) -> None:
    if not isinstance(got, list):
        raise CheckFailed(
            f"{what}: expected a list of {len(expected)} gradient tensors (one per parameter, "
            f"in the order of model.parameters()), got {_kind(got)}"
        )
    require(
        len(got) == len(expected),
        f"{what}: expected one gradient per parameter ({len(expected)}: {', '.join(names)}), "
        f"got {len(got)}",
    )


# --- exercise 1: split_batch ----------------------------------------------------------


def _split_run(ns: dict, inputs: dict, workdir: Path | None) -> dict:
    fn = ns["split_batch"]
    results = []
    for b in inputs["batches"]:
        out = fn(b["x"].clone(), b["y"].clone(), b["n"])
        results.append(
            [_plain_list(p) for p in out] if isinstance(out, (list, tuple)) else _plain(out)
        )
    return {"results": results}


def _check_split(x: torch.Tensor, y: torch.Tensor, n: int, shards) -> list[int]:
    batch = x.shape[0]
    case = f"split_batch(x, y, n={n}) with a batch of {batch}"
    if not isinstance(shards, list):
        raise CheckFailed(f"{case}: expected a list of {n} (x_k, y_k) pairs, got {_kind(shards)}")
    require(len(shards) == n, f"{case}: expected {n} shards (one per replica), got {len(shards)}")
    for k, pair in enumerate(shards):
        if not (isinstance(pair, list) and len(pair) == 2):
            raise CheckFailed(f"{case}: shard {k} should be a pair (x_k, y_k), got {_kind(pair)}")
        xk, yk = pair
        for name, t, full in (("x", xk, x), ("y", yk, y)):
            if not isinstance(t, torch.Tensor):
                raise CheckFailed(f"{case}: {name}_{k} should be a tensor, got {_kind(t)}")
            require(
                t.shape[1:] == full.shape[1:],
                f"{case}: {name}_{k} has shape {tuple(t.shape)}; a shard keeps every dimension "
                f"of {name} but the first ({tuple(full.shape)} -> (B_k, "
                f"{', '.join(map(str, full.shape[1:]))}))",
            )
        require(
            xk.shape[0] == yk.shape[0],
            f"{case}: shard {k} has {xk.shape[0]} inputs but {yk.shape[0]} targets",
        )
    sizes = [int(p[0].shape[0]) for p in shards]
    total = sum(sizes)
    require(
        total >= batch,
        f"{case}: your shards (sizes {sizes}) hold {total} of the {batch} samples, so "
        f"{batch - total} are lost. {batch} is not a multiple of {n}: the remainder "
        f"{batch % n} must go into some shards, e.g. sizes {shard_sizes(batch, n)}",
    )
    require(
        total == batch,
        f"{case}: your shards (sizes {sizes}) hold {total} samples, more than the batch: "
        "some samples are in two shards",
    )
    require(
        max(sizes) - min(sizes) <= 1,
        f"{case}: shard sizes {sizes} differ by more than one (torch.chunk does this); "
        f"expected balanced sizes such as {shard_sizes(batch, n)}",
    )
    for name, full, k_of in (("x", x, 0), ("y", y, 1)):
        joined = torch.cat([p[k_of] for p in shards])
        require(
            joined.dtype == full.dtype and torch.equal(joined, full),
            f"{case}: the {name}_k, concatenated in order, do not give back {name}: every "
            "sample must land in exactly one shard, in its original order, unchanged",
        )
    return sizes


def _split_judge(inputs: dict, outputs: dict) -> str:
    results = outputs["results"]
    require(len(results) == len(inputs["batches"]), "expected one result per batch")
    seen = []
    for b, shards in zip(inputs["batches"], results, strict=True):
        sizes = _check_split(b["x"], b["y"], b["n"], shards)
        seen.append(f"{b['x'].shape[0]} into {sizes}")
    return "every sample in exactly one shard, sizes within one: " + "; ".join(seen)


def _split_batch_case(gen: torch.Generator, batch: int, n: int) -> dict:
    features = _randint(gen, 1, 4)
    return {
        "x": torch.randn(batch, features, generator=gen, dtype=torch.float64),
        "y": torch.randint(0, 10, (batch,), generator=gen),
        "n": n,
    }


def _split_inputs(gen: torch.Generator) -> dict:
    # A remainder of 2 .. n - 2: with a remainder of 1, giving it all to the last shard is
    # balanced too, and with n - 1, torch.chunk's n - 1 shards of ceil(B / n) plus a smaller
    # one are; either mistake would then pass this batch.
    n = _randint(gen, 4, 7)
    uneven = n * _randint(gen, 1, 5) + _randint(gen, 2, n - 2)
    n2 = _randint(gen, 3, 6)
    even = n2 * _randint(gen, 2, 5)
    n3 = _randint(gen, 3, 8)
    return {
        "batches": [
            _split_batch_case(gen, uneven, n),
            _split_batch_case(gen, even, n2),
            _split_batch_case(gen, n3 + 1, n3),  # torch.chunk gives fewer than n shards
        ]
    }


def split_batch(fn) -> None:
    """Visible check of exercise 1 on fixed batches (10 into 4, 8 into 4, 6 into 4, 7 into 1)."""
    gen = torch.Generator().manual_seed(1)
    inputs = {
        "batches": [_split_batch_case(gen, b, n) for b, n in ((10, 4), (8, 4), (6, 4), (7, 1))]
    }
    message = _split_judge(inputs, _split_run({"split_batch": fn}, inputs, None))
    passed(f"split_batch: {message}")


# --- exercise 2: average_gradients ---------------------------------------------------------


def _avg_run(ns: dict, inputs: dict, workdir: Path | None) -> dict:
    return {"averaged": _plain_list(ns["average_gradients"]([list(g) for g in inputs["grads"]]))}


def _avg_judge(inputs: dict, outputs: dict) -> str:
    grads = inputs["grads"]
    n = len(grads)
    expected = reference_average_gradients(grads)
    got = outputs["averaged"]
    what = f"average_gradients over {n} replicas"
    if not isinstance(got, list):
        raise CheckFailed(
            f"{what}: expected a list with one tensor per parameter ({len(expected)}), "
            f"got {_kind(got)}"
        )
    require(
        len(got) == len(expected),
        f"{what}: expected one averaged gradient per parameter ({len(expected)}), got "
        f"{len(got)} (grads_per_replica[r][i] is replica r's gradient of parameter i)",
    )
    if not _close(got, expected, ATOL, RTOL):
        summed = [torch.stack(g).sum(0) for g in zip(*grads, strict=True)]
        require(
            not _close(got, summed, ATOL, RTOL),
            f"{what}: you returned the sum of the replicas' gradients, {n} times the mean "
            "(the gradient of n times the loss): divide by the number of replicas",
        )
        first = list(grads[0])
        require(
            not _close(got, first, ATOL, RTOL),
            f"{what}: you returned replica 0's gradients; average over all {n} replicas",
        )
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert_close(g, e, f"{what}: parameter {i}'s averaged gradient", atol=ATOL, rtol=RTOL)
    return f"averaged {n} replicas' gradients of {len(expected)} parameters"


def _avg_inputs(gen: torch.Generator) -> dict:
    n = _randint(gen, 2, 6)
    shapes = [tuple(_randint(gen, 1, 5) for _ in range(_randint(gen, 1, 3))) for _ in range(3)]
    shapes = shapes[: _randint(gen, 2, 3)]
    return {
        "grads": [
            [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes] for _ in range(n)
        ]
    }


def average_gradients(fn) -> None:
    """Visible check of exercise 2: 4 replicas, 2 parameters, known values."""
    grads = [
        [torch.full((2,), float(r), dtype=torch.float64), torch.full((3, 1), 2.0 * r + 1)]
        for r in range(4)
    ]
    message = _avg_judge(
        {"grads": grads}, _avg_run({"average_gradients": fn}, {"grads": grads}, None)
    )
    passed(f"average_gradients: {message}")


# --- exercise 3: data_parallel_gradients ----------------------------------------------------


def _dpg_case(gen: torch.Generator, dims: list[int], sizes: list[int]) -> dict:
    model = make_mlp(dims)
    state = {
        k: 0.7 * torch.randn(v.shape, generator=gen, dtype=torch.float64)
        for k, v in model.state_dict().items()
    }
    return {
        "dims": dims,
        "state": state,
        "xs": [torch.randn(s, dims[0], generator=gen, dtype=torch.float64) for s in sizes],
        "ys": [torch.randint(0, dims[-1], (s,), generator=gen) for s in sizes],
    }


def _dpg_model(inputs: dict) -> nn.Sequential:
    model = make_mlp(inputs["dims"])
    model.load_state_dict(inputs["state"])
    return model


def _dpg_run(ns: dict, inputs: dict, workdir: Path | None) -> dict:
    model = _dpg_model(inputs)
    shards = [(x.clone(), y.clone()) for x, y in zip(inputs["xs"], inputs["ys"], strict=True)]
    got = ns["data_parallel_gradients"](model, shards, F.cross_entropy)
    if not isinstance(got, (list, tuple)) and hasattr(got, "__iter__"):
        got = list(got)
    return {
        "grads": _plain_list(got),
        "grad_left": [p.grad is not None and bool(p.grad.ne(0).any()) for p in model.parameters()],
        "state_after": {k: v.detach().clone() for k, v in model.state_dict().items()},
    }


def _dpg_judge(inputs: dict, outputs: dict) -> str:
    model = _dpg_model(inputs)
    names = [name for name, _ in model.named_parameters()]
    sizes = [int(x.shape[0]) for x in inputs["xs"]]
    total = sum(sizes)
    x, y = torch.cat(inputs["xs"]), torch.cat(inputs["ys"])
    expected = loss_gradients(model, x, y)
    what = f"data_parallel_gradients on shards of sizes {sizes}"
    got = outputs["grads"]
    _gradient_list(got, expected, names, what)
    if not _close(got, expected, ATOL, RTOL):
        per_shard = [
            loss_gradients(model, xk, yk) for xk, yk in zip(inputs["xs"], inputs["ys"], strict=True)
        ]
        plain = reference_average_gradients(per_shard)
        weights = ", ".join(f"{s}/{total}" for s in sizes)
        require(
            not _close(got, plain, ATOL, RTOL),
            f"{what}: you returned the plain average of the shard gradients. With unequal "
            f"shards that is not the full-batch gradient: weight shard k by B_k / B "
            f"(here {weights})",
        )
        summed = [torch.stack(g).sum(0) for g in zip(*per_shard, strict=True)]
        require(
            not _close(got, summed, ATOL, RTOL),
            f"{what}: you returned the sum of the shard gradients; weight shard k by B_k / B "
            f"(here {weights}) so that the weights add up to 1",
        )
        for i, (g, e) in enumerate(zip(got, expected, strict=True)):
            assert_close(
                g,
                e,
                f"{what}: the gradient of {names[i]} (expected the full-batch gradient of the "
                "mean loss)",
                atol=ATOL,
                rtol=RTOL,
            )
    left = [names[i] for i, flag in enumerate(outputs["grad_left"]) if flag]
    require(
        not left,
        f"{what}: the values are right, but the model you were given now holds gradients "
        f"(the .grad of {', '.join(left)}). Compute each shard's gradient on a replica "
        "(copy.deepcopy(model)) and leave the model as it was",
    )
    after = outputs["state_after"]
    require(
        set(after) == set(inputs["state"])
        and all(torch.equal(after[k], v) for k, v in inputs["state"].items()),
        f"{what}: the model's parameters changed during your call; replicas may compute, the "
        "model you were given must stay as it was",
    )
    return f"equals the full-batch gradient for shards of sizes {sizes}; model untouched"


def _dpg_inputs(gen: torch.Generator) -> dict:
    dims = [_randint(gen, 3, 8), _randint(gen, 4, 10), _randint(gen, 2, 5)]
    n = _randint(gen, 2, 5)
    while True:  # never all equal: the plain average of the shard gradients would be right
        sizes = [_randint(gen, 1, 12) for _ in range(n)]
        sizes[_randint(gen, 0, n - 1)] += _randint(gen, 4, 10)
        if len(set(sizes)) > 1:
            return _dpg_case(gen, dims, sizes)


def data_parallel_gradients(fn) -> None:
    """Visible check of exercise 3: an MLP 4-5-3, shards of 5, 2 and 1 samples."""
    inputs = _dpg_case(torch.Generator().manual_seed(3), [4, 5, 3], [5, 2, 1])
    outputs = _dpg_run({"data_parallel_gradients": fn}, inputs, None)
    passed(f"data_parallel_gradients {_dpg_judge(inputs, outputs)}")


# --- exercise 4: combine_shard_stats ---------------------------------------------------------


def _stats_case(gen: torch.Generator, counts: list[int], channels: int) -> dict:
    shards = [
        torch.randn(c, channels, generator=gen, dtype=torch.float64)
        * (0.5 + torch.rand(channels, generator=gen, dtype=torch.float64))
        + 2 * torch.randn(channels, generator=gen, dtype=torch.float64)
        for c in counts
    ]
    return {
        "means": torch.stack([s.mean(0) for s in shards]),
        "variances": torch.stack([s.var(0, unbiased=False) for s in shards]),
        "counts": torch.tensor(counts),
        "samples": torch.cat(shards),
    }


def _stats_run(ns: dict, inputs: dict, workdir: Path | None) -> dict:
    out = ns["combine_shard_stats"](
        inputs["means"].clone(), inputs["variances"].clone(), inputs["counts"].clone()
    )
    if not isinstance(out, (list, tuple)) or len(out) != 2:
        return {"mean": _plain(out), "var": "<not a (mean, var) pair>"}
    return {"mean": _plain(out[0]), "var": _plain(out[1])}


def _stats_judge(inputs: dict, outputs: dict) -> str:
    counts = [int(c) for c in inputs["counts"]]
    samples = inputs["samples"]
    means, variances = inputs["means"], inputs["variances"]
    mean, var = samples.mean(0), samples.var(0, unbiased=False)
    what = f"combine_shard_stats for shards of {counts} samples"
    got_mean, got_var = outputs["mean"], outputs["var"]
    if not isinstance(got_var, torch.Tensor) or not isinstance(got_mean, torch.Tensor):
        raise CheckFailed(
            f"{what}: expected a pair (mean, var) of tensors of shape {tuple(mean.shape)}, got "
            f"{_kind(got_mean)} and {_kind(got_var)}"
        )
    tol = {"atol": ATOL, "rtol": RTOL}
    if not _close([got_mean], [mean], **tol):
        require(
            not _close([got_mean], [means.mean(0)], **tol),
            f"{what}: your mean is the plain average of the shard means; a shard of "
            f"{max(counts)} samples must count more than one of {min(counts)}: weight each "
            "shard mean by its count",
        )
    assert_close(got_mean, mean, f"{what}: the mean of the whole batch", **tol)
    if not _close([got_var], [var], **tol):
        w = inputs["counts"].to(means.dtype).unsqueeze(1)
        within = (w * variances).sum(0) / w.sum()
        require(
            not _close([got_var], [within], **tol)
            and not _close([got_var], [variances.mean(0)], **tol),
            f"{what}: your variance averages the shard variances and leaves out how far the "
            "shard means lie from the batch mean; add sum_k B_k (mean_k - mean)^2 / B",
        )
        require(
            not _close([got_var], [samples.var(0, unbiased=True)], **tol),
            f"{what}: that is the unbiased variance (divided by B - 1); BatchNorm normalises "
            "with the biased one (divided by B)",
        )
    assert_close(got_var, var, f"{what}: the (biased) variance of the whole batch", **tol)
    return f"batch mean and variance recovered from {len(counts)} shards of {counts} samples"


def _stats_mistakes_far(inputs: dict) -> bool:
    """Whether each typical mistake of exercise 4 is far from the answer in some channel.

    Equal counts make the plain average of the shard means right, and shards whose means
    (nearly) coincide make the average of their variances right: such draws would let those
    mistakes pass by luck.
    """
    means, variances, samples = inputs["means"], inputs["variances"], inputs["samples"]
    mean, var = samples.mean(0), samples.var(0, unbiased=False)
    w = inputs["counts"].to(means.dtype).unsqueeze(1)
    within = (w * variances).sum(0) / w.sum()

    def far(wrong: torch.Tensor, right: torch.Tensor) -> bool:
        return bool(((wrong - right).abs() > 1e-3 * (1 + right.abs())).any())

    return (
        far(means.mean(0), mean)
        and far(within, var)
        and far(variances.mean(0), var)
        and far(samples.var(0, unbiased=True), var)
    )


def _stats_inputs(gen: torch.Generator) -> dict:
    while True:
        n = _randint(gen, 2, 5)
        counts = [_randint(gen, 1, 20) for _ in range(n)]
        counts[_randint(gen, 0, n - 1)] += _randint(gen, 5, 15)
        inputs = _stats_case(gen, counts, _randint(gen, 1, 6))
        if len(set(counts)) > 1 and _stats_mistakes_far(inputs):
            return inputs


def combine_shard_stats(fn) -> None:
    """Visible check of exercise 4: 3 shards of 6, 3 and 1 samples, 2 features."""
    inputs = _stats_case(torch.Generator().manual_seed(4), [6, 3, 1], 2)
    outputs = _stats_run({"combine_shard_stats": fn}, inputs, None)
    passed(f"combine_shard_stats: {_stats_judge(inputs, outputs)}")


# --- exercise 5: dataparallel_step_time ------------------------------------------------------

_TERM_HINTS = {
    "compute": "the compute term compute_s / n",
    "replicate": (
        "a parameter transfer, (n - 1) * param_bytes / bandwidth: nn.DataParallel copies the "
        "weights to every device again at every step (replicate), and the gradients come "
        "back to device 0 (reduce); count both"
    ),
    "scatter": "the scatter term (n - 1) / n * batch_bytes / bandwidth",
    "gather": (
        "the output term 2 (n - 1) / n * output_bytes / bandwidth (outputs in, and their "
        "gradients out again in backward)"
    ),
    "python": "the Python term n * host_s (the GIL serialises the n threads' launches)",
}


def _time_run(ns: dict, inputs: dict, workdir: Path | None) -> dict:
    fn = ns["dataparallel_step_time"]
    return {"times": [_plain(fn(c["n"], **c["kwargs"])) for c in inputs["cases"]]}


def _diagnose_time(got: float, n: int, terms: dict[str, float]) -> str | None:
    expected = sum(terms.values())
    partial = {  # the classic half-right terms: what is missing, and why it is wrong
        "python": (
            terms["python"] * (n - 1) / n,
            "the Python term counts one launch (host_s); the n threads launch one after "
            "another under the GIL: n * host_s",
        ),
        "gather": (
            terms["gather"] / 2,
            "the output term counts the outputs once; their gradients go out again in "
            "backward: 2 (n - 1) / n * output_bytes / bandwidth",
        ),
    }
    for delta, hint in partial.values():
        if delta > 1e-6 * expected and math.isclose(got, expected - delta, rel_tol=1e-9):
            return hint
    for name, value in terms.items():
        key = "replicate" if name == "reduce" else name
        if value > 1e-6 * expected and math.isclose(got, expected - value, rel_tol=1e-9):
            return f"your time leaves out {_TERM_HINTS[key]}"
        if value > 1e-6 * expected and math.isclose(got, expected + value, rel_tol=1e-9):
            return f"your time counts one term twice: {_TERM_HINTS[key]}"
    return None


def _time_judge(inputs: dict, outputs: dict) -> str:
    got_all = outputs["times"]
    require(
        isinstance(got_all, list) and len(got_all) == len(inputs["cases"]),
        "expected one time per call",
    )
    for case, got in zip(inputs["cases"], got_all, strict=True):
        terms = step_time_terms(case["n"], **case["kwargs"])
        expected = sum(terms.values())
        call = (
            f"dataparallel_step_time({case['n']}, "
            + ", ".join(f"{k}={v:.4g}" for k, v in case["kwargs"].items())
            + ")"
        )
        if isinstance(got, torch.Tensor) and got.numel() == 1:
            got = float(got)
        if not isinstance(got, (int, float)) or isinstance(got, bool):
            raise CheckFailed(f"{call}: expected a number of seconds, got {_kind(got)}")
        if not math.isclose(float(got), expected, rel_tol=1e-9, abs_tol=1e-15):
            hint = _diagnose_time(float(got), case["n"], terms)
            parts = ", ".join(f"{k} {v:.4g}" for k, v in terms.items())
            raise CheckFailed(
                f"{call}: expected {expected:.6g} s ({parts}), got {float(got):.6g} s"
                + (f"; {hint}" if hint else "")
            )
    return f"predicted {len(got_all)} step times (n = {sorted({c['n'] for c in inputs['cases']})})"


def _log_uniform(gen: torch.Generator, low: float, high: float) -> float:
    u = float(torch.rand(1, generator=gen, dtype=torch.float64))
    return 10 ** (math.log10(low) + u * (math.log10(high) - math.log10(low)))


def _time_inputs(gen: torch.Generator) -> dict:
    cases = []
    for n in [1, 2, *(_randint(gen, 3, 16) for _ in range(6))]:
        cases.append(
            {
                "n": n,
                "kwargs": {
                    "compute_s": _log_uniform(gen, 1e-3, 1.0),
                    "param_bytes": _log_uniform(gen, 1e6, 1e9),
                    "batch_bytes": _log_uniform(gen, 1e5, 1e9),
                    "output_bytes": _log_uniform(gen, 1e4, 1e8),
                    "bandwidth": _log_uniform(gen, 1e9, 1e11),
                    "host_s": _log_uniform(gen, 1e-5, 1e-2),
                },
            }
        )
    return {"cases": cases}


def dataparallel_step_time(fn) -> None:
    """Visible check of exercise 5: n = 1, the docstring's example, and a 4-device case."""
    base = {
        "compute_s": 0.2,
        "param_bytes": 4e8,
        "batch_bytes": 1e8,
        "output_bytes": 1e6,
        "bandwidth": 1e10,
        "host_s": 0.002,
    }
    example = {
        "compute_s": 1.0,
        "param_bytes": 1e9,
        "batch_bytes": 1e9,
        "output_bytes": 0.0,
        "bandwidth": 1e9,
        "host_s": 0.0,
    }
    inputs = {
        "cases": [{"n": 1, "kwargs": base}, {"n": 2, "kwargs": example}, {"n": 4, "kwargs": base}]
    }
    message = _time_judge(inputs, _time_run({"dataparallel_step_time": fn}, inputs, None))
    passed(f"dataparallel_step_time: {message}")


EXERCISES = [
    Exercise(
        "test_ex1_split_batch",
        ("ex1_split_batch",),
        "split a batch into balanced shards",
        _split_inputs,
        _split_judge,
        run=_split_run,
    ),
    Exercise(
        "test_ex2_average_gradients",
        ("ex2_average_gradients",),
        "average gradients over replicas",
        _avg_inputs,
        _avg_judge,
        run=_avg_run,
    ),
    Exercise(
        "test_ex3_data_parallel_gradients",
        ("ex3_data_parallel_gradients",),
        "replicas on unequal shards equal the full batch",
        _dpg_inputs,
        _dpg_judge,
        run=_dpg_run,
    ),
    Exercise(
        "test_ex4_combine_shard_stats",
        ("ex4_combine_shard_stats",),
        "batch statistics from shard statistics",
        _stats_inputs,
        _stats_judge,
        run=_stats_run,
    ),
    Exercise(
        "test_ex5_dataparallel_step_time",
        ("ex5_dataparallel_step_time",),
        "the nn.DataParallel cost model",
        _time_inputs,
        _time_judge,
        run=_time_run,
    ),
]
