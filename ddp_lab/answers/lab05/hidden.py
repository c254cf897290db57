"""What the grader adds to lab 5's kit judges: exact comparisons and named diagnoses.

- ex1: the report compared with the reference's (which casts, where the kit's oracle derives
  thresholds); a wrong report named: the share taken over every entry (zeros included),
  subnormal values counted as underflow, a scale compared with ``finfo.max`` (the cast
  rounds: up to 65519.99 stays finite), a scale one power of two too large, a scale search in
  float32 that stops at 2**127 for tiny gradients, bfloat16's share measured in float16;
- ex2: a wrong run matched against typical broken scalers (never grows, grows at every step,
  keeps counting good steps across an overflow, misses NaN, never skips, unscales twice,
  forgets that a step was skipped, ignores its growth and backoff factors);
- ex3: wrong weights matched against a loss not divided by the group size (k times the
  learning rate), a short last group divided by k, and a loss divided by the world size too;
- ex4: a wrong DDP step matched against clipping before ``unscale_`` (the minGPT bug), a
  loss not divided by ``accumulate``, one divided by the world size too, and a norm summed
  over the ranks of gradients DDP had already averaged;
- ex5: a wrong norm matched against the rank's own norm, the sum of the ranks' norms, the
  mean of the squares, a sum of squares in float32 (tiny gradients), and an inf-norm
  without ``abs``.
"""

from __future__ import annotations

import math

import torch

from ddp_lab.answers import Hidden
from ddp_lab.answers.lab05 import references as ref
from ddp_lab.checks.failure import CheckFailed
from ddp_lab.checks.lab05 import ex1_fp16_report as ex1
from ddp_lab.checks.lab05 import ex2_loss_scaler as ex2
from ddp_lab.checks.lab05 import ex3_accumulation as ex3
from ddp_lab.checks.lab05 import ex4_ddp_step as ex4
from ddp_lab.checks.lab05 import ex5_global_grad_norm as ex5
from ddp_lab.checks.values import max_diff, number, same_bits

# --- exercise 1 ---------------------------------------------------------------------------


def _report_check(inputs: dict, outputs: dict) -> None:
    for grads, got in zip(inputs["cases"], outputs["reports"], strict=True):
        want = ref.fp16_report(grads)
        for key in ex1.KEYS:
            if not abs(number(got[key]) - want[key]) <= ex1.SHARE_ATOL:
                raise CheckFailed(
                    f"fp16_report on {ex1.describe(grads)}: {key} should be {want[key]:.6g}, got "
                    f"{number(got[key]):.6g}"
                )


def _report_explain(inputs: dict, outputs: dict) -> str | None:
    reports = outputs.get("reports")
    if not isinstance(reports, list) or len(reports) != len(inputs["cases"]):
        return None
    for grads, got in zip(inputs["cases"], reports, strict=True):
        if not isinstance(got, dict) or set(ex1.KEYS) - set(got):
            return None
        flat = torch.cat([g.reshape(-1).double() for g in grads])
        nz = flat[flat != 0].abs()
        want = ex1.oracle(grads)
        what = f"fp16_report on {ex1.describe(grads)}"
        under, scale = number(got["underflow"]), number(got["max_scale"])
        zero16 = ex1.zero_threshold(torch.float16)
        if abs(under - want["underflow"]) > ex1.SHARE_ATOL:
            if abs(under - int((nz <= zero16).sum()) / flat.numel()) <= ex1.SHARE_ATOL:
                return (
                    f"{what}: your underflow share counts every entry, the zeros too; the share "
                    "is of the nonzero entries (an entry that is 0 in float32 cannot underflow)"
                )
            tiny = torch.finfo(torch.float16).tiny
            if abs(under - int((nz < tiny).sum()) / nz.numel()) <= ex1.SHARE_ATOL:
                return (
                    f"{what}: you counted values below float16's smallest normal number "
                    f"({tiny:.3g}) as underflow; they become subnormal numbers, which are not "
                    "0: a value underflows when the cast gives exactly 0"
                )
        if scale != want["max_scale"]:
            top = float(nz.max())
            if scale == want["max_scale"] / 2 and top * want["max_scale"] > 65504:
                return (
                    f"{what}: max_scale {scale:g} is half the answer: at {want['max_scale']:g} "
                    f"the largest entry is {top * want['max_scale']:.2f}, above finfo.max = "
                    "65504 but still finite in float16 (the cast rounds to nearest: values "
                    "below 65520 become 65504); test for inf after the cast"
                )
            if scale == 2.0**127 and want["max_scale"] > scale:
                return (
                    f"{what}: max_scale is 2**127 where it should be "
                    f"2**{math.log2(want['max_scale']):g}: 2.0**128 is already inf in float32, "
                    "so a search that multiplies float32 values by 2.0**k stops at k = 127 "
                    "(here the largest |g| is below 65520 * 2**-128, about 1.9e-34); scale in "
                    "float64, which holds every power of two such a gradient can need"
                )
            if scale == 2 * want["max_scale"]:
                return (
                    f"{what}: max_scale {scale:g} is one power of two too large: at that scale "
                    "the largest entry becomes inf in float16"
                )
        bf = number(got["bf16_underflow"])
        if (
            abs(bf - want["bf16_underflow"]) > ex1.SHARE_ATOL
            and abs(bf - want["underflow"]) <= ex1.SHARE_ATOL
        ):
            return (
                f"{what}: your bf16_underflow equals the float16 share: cast to torch.bfloat16 "
                "(its exponent range is float32's)"
            )
    return None


# --- exercise 2 ---------------------------------------------------------------------------


class _NeverGrows(ref.LossScaler):
    def update(self):
        if self._found_inf:
            self._scale *= self._backoff_factor
        self._found_inf, self._unscaled = False, False


class _GrowsEveryStep(ref.LossScaler):
    def update(self):
        self._scale *= self._backoff_factor if self._found_inf else self._growth_factor
        self._found_inf, self._unscaled = False, False


class _KeepsCounting(ref.LossScaler):
    def update(self):
        if self._found_inf:
            self._scale *= self._backoff_factor
        else:
            self._good_steps += 1
            if self._good_steps % self._growth_interval == 0:
                self._scale *= self._growth_factor
        self._found_inf, self._unscaled = False, False


class _MissesNaN(ref.LossScaler):
    def unscale_(self, optimizer):
        super().unscale_(optimizer)
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        self._found_inf = any(bool(torch.isinf(t).any()) for t in grads)


class _NeverSkips(ref.LossScaler):
    def step(self, optimizer):
        if not self._unscaled:
            self.unscale_(optimizer)
        optimizer.step()


class _UnscalesTwice(ref.LossScaler):
    def step(self, optimizer):
        self.unscale_(optimizer)
        if not self._found_inf:
            optimizer.step()


class _StickyInf(ref.LossScaler):
    def unscale_(self, optimizer):
        found = self._found_inf
        super().unscale_(optimizer)
        self._found_inf = self._found_inf or found

    def update(self):
        found = self._found_inf
        super().update()
        self._found_inf = found


class _FixedGrowth(ref.LossScaler):
    def update(self):
        self._growth_factor = 2.0  # GradScaler's default, not the argument
        super().update()


class _FixedFactors(_FixedGrowth):
    def update(self):
        self._backoff_factor = 0.5
        super().update()


_SCALER_MISTAKES = [
    (
        _FixedGrowth,
        "your scale grows by 2 whatever growth_factor says: multiply by growth_factor",
    ),
    (
        _FixedFactors,
        "your scale grows by 2 and backs off by 0.5 whatever growth_factor and "
        "backoff_factor say: use the constructor's arguments",
    ),
    (
        _NeverGrows,
        "your scale never grows: after growth_interval good steps in a row, multiply "
        "it by growth_factor",
    ),
    (
        _GrowsEveryStep,
        "your scale grows after every good step: it should grow only after "
        "growth_interval good steps in a row",
    ),
    (
        _KeepsCounting,
        "your count of good steps goes on across an overflow: restart it at 0 when "
        "a step is skipped (and after each growth)",
    ),
    (_MissesNaN, "a NaN gradient went through: look for NaN as well as inf (torch.isfinite)"),
    (
        _NeverSkips,
        "your step() calls optimizer.step() even when a gradient holds an inf or a "
        "NaN: skip it then",
    ),
    (
        _UnscalesTwice,
        "when unscale_ was called before step(), your step() unscales again: the "
        "gradients are divided by the scale twice",
    ),
    (
        _StickyInf,
        "once a step was skipped, every later step is skipped too: forget the "
        "inf/NaN of a step in update()",
    ),
]


def _scaler_explain(inputs: dict, outputs: dict) -> str | None:
    runs = outputs.get("runs")
    if not isinstance(runs, list) or len(runs) != len(inputs["cases"]):
        return None

    def same_run(twin: dict, got: dict) -> bool:
        return twin["scales"] == got.get("scales") and all(
            same_bits(a, b) for a, b in zip(twin["weights"], got.get("weights", []), strict=True)
        )

    for case, got in zip(inputs["cases"], runs, strict=True):
        want = ex2.oracle(case)
        if not ex2.first_problem(case, got, want):
            continue
        if same_run(want, got):
            return None  # right values (the kit names what else is wrong: get_scale's type)
        for cls, why in _SCALER_MISTAKES:
            if same_run(ex2.drive(cls(**case["scaler"]), case), got):
                return f"{ex2.describe(case)}: {why}"
        return None
    return None


# --- exercise 3 ---------------------------------------------------------------------------


def _accumulation_explain(inputs: dict, outputs: dict) -> str | None:
    for case, ranks in zip(inputs["cases"], outputs.get("cases", []), strict=False):
        for r, spec in enumerate(case["runs"]):
            world = spec["ranks"]
            outs = [rank_out[r] for rank_out in ranks[:world]]
            if ex3.count_problem(spec, world, outs) or not ex3.weights_problem(spec, world, outs):
                continue
            n, k = len(spec["xs"][0]), spec["k"]
            sizes = [len(g) for g in ex3.groups(n, k)]
            twins = [  # each group's gradient, times this factor
                (
                    [float(z) for z in sizes],
                    "each micro-batch's loss is not divided by the number of micro-batches in "
                    f"its group: the step uses the sum of {k} gradients, as if the learning "
                    f"rate were {k} times larger",
                ),
                (
                    [z / k for z in sizes],
                    f"the last, shorter group ({sizes[-1]} micro-batches) "
                    f"was divided by k = {k}: divide by the size of the group itself",
                ),
                (
                    [1 / world] * len(sizes),
                    f"the loss was divided by the world size ({world}) too: "
                    "DDP averages over the ranks already",
                ),
            ]
            for factor, why in twins:
                want = ex3.big_batch_steps(spec, factor.__getitem__)
                if all(
                    max_diff(o["weights"][s], want[s]) <= ex3.ATOL
                    for o in outs
                    for s in range(len(want))
                ):
                    return f"{ex3.run_text(spec, world)}: {why}"
            return None
    return None


# --- exercise 4 ---------------------------------------------------------------------------


def _near(a: float, b: float, rel: float = 0.03) -> bool:
    return math.isfinite(a) and abs(a - b) <= rel * abs(b)


def _moved_like(after: dict, before: dict, twin: dict, rel: float = 0.03) -> bool:
    """The step ``before -> after`` is the step ``before -> twin``, to ``rel``."""
    delta = ex4.flat_delta(after, before)
    want = ex4.flat_delta(twin, before)
    return bool(torch.isfinite(delta).all()) and float((delta - want).norm()) <= rel * float(
        want.norm()
    )


def _scaled_twin(before: dict, spec: dict, s: int, factor: float) -> dict:
    """The weights after a step with ``factor`` times the true gradient, clipped at
    ``max_norm`` (the step of the true gradient clipped at ``max_norm / factor``, times
    ``factor``)."""
    clipped = ex4.fp32_step(before, spec, s, spec["max_norm"] / factor)[0]
    return {k: before[k] + factor * (clipped[k] - before[k]) for k in before}


def _step_explain(inputs: dict, outputs: dict) -> str | None:
    for case, ranks in zip(inputs["cases"], outputs.get("cases", []), strict=False):
        for r, spec in enumerate(case["runs"]):
            outs = [rank_out[r] for rank_out in ranks[: spec["ranks"]]]
            if not ex4.problem(spec, outs):
                continue
            if ex4.count_problem(spec, outs):
                return None  # the kit's message names the count
            before, scales = spec["init"], [spec["init_scale"], *ex4.expected_scales(spec)]
            for s in range(ex4.steps_of(spec)):
                if not ex4.step_problem(spec, s, before, outs):
                    before = outs[0]["updates"][s]["weights"]
                    continue
                if s == spec["overflow"]["step"]:
                    return None
                return _wrong_step(spec, s, before, outs[0], scales[s])
            return None
    return None


def _wrong_step(spec: dict, s: int, before: dict, out: dict, scale: float) -> str | None:
    """The typical mistake that gives step ``s``'s norm and weights, or None."""
    got, after = out["norms"][s], out["updates"][s]["weights"]
    right, norm = ex4.fp32_step(before, spec, s)
    k, n = spec["accumulate"], spec["ranks"]
    what = f"{ex4.run_text(spec)}, step {s}"
    if _near(got, norm * scale):  # S >= 2**6: no other factor comes near
        return (
            f"{what}: you clipped the scaled gradients (clip_grad_norm_ before "
            f"scaler.unscale_): their norm is {norm * scale:.4g}, {scale:g} times the true "
            "one, so the clip shrank the step far below the right one; unscale_ first, then "
            "clip"
        )

    def twin(factor: float) -> bool:
        return _near(got, norm * factor) and (
            _moved_like(after, before, right)
            or _moved_like(after, before, _scaled_twin(before, spec, s, factor))
        )

    if k > 1 and twin(k):
        return (
            f"{what}: your norm is {k} times the true one: each micro-batch's loss was not "
            f"divided by accumulate ({k}), so the accumulated gradient is the sum of the "
            "micro-batches' gradients, not their mean"
        )
    if twin(1 / n):
        return (
            f"{what}: your norm is the true one divided by the world size ({n}): DDP "
            "averages over the ranks already; divide by accumulate only"
        )
    clipped = ex4.fp32_step(before, spec, s, spec["max_norm"] / math.sqrt(n))[0]
    if _near(got, norm * math.sqrt(n)) and (
        _moved_like(after, before, right) or _moved_like(after, before, clipped)
    ):
        return (
            f"{what}: your norm is sqrt({n}) times the true one: the gradients were already "
            "averaged by DDP, so every rank holds the whole gradient and its own "
            "clip_grad_norm_ is the global norm; summing the ranks' squares counts every "
            f"entry {n} times"
        )
    return None


# --- exercise 5 ---------------------------------------------------------------------------


def _local_norms(sub: dict) -> list[float]:
    p = ex5.NORMS[sub["norm"]]
    out = []
    for shard in sub["shards"]:
        flat = [g.reshape(-1).double() for g in shard]
        v = torch.cat(flat) if flat else torch.zeros(0, dtype=torch.float64)
        out.append(float(torch.linalg.vector_norm(v, p)) if v.numel() else 0.0)
    return out


def _float32_norm(sub: dict) -> float:
    """The L2 norm as a float32 sum of squares gives it (each rank's, then their sum)."""
    total = torch.zeros((), dtype=torch.float32)
    for shard in sub["shards"]:
        flat = [g.reshape(-1).float() for g in shard]
        if flat:
            mine = torch.cat(flat)
            total = total + (mine * mine).sum()
    return float(total.sqrt())


def _norm_explain(inputs: dict, outputs: dict) -> str | None:
    for case, ranks in zip(inputs["cases"], outputs.get("cases", []), strict=False):
        for s, sub in enumerate(case["subs"]):
            members = ranks[: sub["ranks"]]
            results = [number(r[s]) if len(r) > s else math.nan for r in members]
            if not ex5.sub_problem(sub, [r[s] if len(r) > s else None for r in members]):
                continue
            what = f"global_grad_norm on {ex5.sub_text(sub)}"
            local = _local_norms(sub)
            want = ex5.oracle(sub)

            def near(a: float, b: float) -> bool:
                return abs(a - b) <= 1e-6 * max(abs(b), 1e-30)

            if all(near(v, loc) for v, loc in zip(results, local, strict=True)):
                return (
                    f"{what}: each rank returned the norm of its own gradients "
                    f"({', '.join(f'{v:.4g}' for v in local)}); combine the ranks with an "
                    f"all-reduce (the global norm is {want:.6g})"
                )
            if sub["norm"] == "2" and all(near(v, sum(local)) for v in results):
                return (
                    f"{what}: you summed the ranks' norms ({sum(local):.6g}); norms do not add "
                    "up: all-reduce the sums of squares, then take the square root once"
                )
            squares = sum(v * v for v in local)
            if sub["norm"] == "2" and all(
                near(v, math.sqrt(squares / len(local))) for v in results
            ):
                return (
                    f"{what}: you averaged the sums of squares over the ranks; the norm needs "
                    "their sum (every gradient entry counts once)"
                )
            if sub["norm"] == "2" and sub["dtype"] == "float32":
                f32 = _float32_norm(sub)
                if all(abs(v - f32) <= 1e-2 * want for v in results):
                    return (
                        f"{what}: your norm ({results[0]:.6g}, expected {want:.6g}) was "
                        "accumulated in float32: these gradients are so small that their "
                        "squares underflow in float32; convert to float64 before squaring"
                    )
            if sub["norm"] == "inf":
                if all(near(v, sum(local)) for v in results):
                    return (
                        f"{what}: you summed the ranks' largest magnitudes; the inf-norm of "
                        "everything is their maximum: all_reduce with ReduceOp.MAX"
                    )
                signed = max(float(g.max()) for shard in sub["shards"] for g in shard if g.numel())
                if all(near(v, max(signed, 0.0)) or near(v, signed) for v in results):
                    return (
                        f"{what}: the inf-norm is the largest magnitude |g|; you took the "
                        f"largest value ({signed:.4g}) and missed a larger negative entry"
                    )
            return None
    return None


HIDDEN = {
    "test_ex1_fp16_report": Hidden(check=_report_check, explain=_report_explain),
    "test_ex2_loss_scaler": Hidden(explain=_scaler_explain),
    "test_ex3_accumulation": Hidden(explain=_accumulation_explain),
    "test_ex4_ddp_step": Hidden(explain=_step_explain),
    "test_ex5_global_grad_norm": Hidden(explain=_norm_explain),
}
