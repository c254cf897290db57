"""What the grader adds to lab 5's kit judges: exact comparisons and named diagnoses.

- ex1: the report compared with the reference's (which casts, where the kit's oracle derives
  thresholds); a wrong report named: the share taken over every entry (zeros included),
  subnormal values counted as underflow, a scale compared with ``finfo.max`` (the cast
  rounds: up to 65519.99 stays finite), a scale one power of two too large, a scale search in
  float32 that stops at 2**127 for tiny gradients, bfloat16's share measured in float16;
- ex2: a wrong run matched against typical broken scalers (never grows, grows at every step,
  keeps counting good steps across an overflow, misses NaN, never skips, unscales twice,
  forgets that a step was skipped);
- ex3: wrong weights matched against a loss not divided by the group size (k times the
  learning rate), a short last group divided by k, and a loss divided by the world size too;
- ex4: a wrong step matched against clipping before ``unscale_`` (the minGPT bug), no
  clipping, and a returned norm that is the scaled one or the one after clipping;
- ex5: a wrong norm matched against the rank's own norm, the sum of the ranks' norms, the
  mean of the squares, and an inf-norm without ``abs``.
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
from ddp_lab.checks.lab05 import ex4_amp_step as ex4
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


_SCALER_MISTAKES = [
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
    for case, got in zip(inputs["cases"], runs, strict=True):
        if not ex2.first_problem(case, got, ex2.oracle(case)):
            continue
        for cls, why in _SCALER_MISTAKES:
            twin = ex2.drive(cls(**case["scaler"]), case)
            if twin["scales"] == got["scales"] and all(
                same_bits(a, b) for a, b in zip(twin["weights"], got["weights"], strict=True)
            ):
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


def _amp_explain(inputs: dict, outputs: dict) -> str | None:
    for case, steps in zip(inputs["cases"], outputs.get("runs", []), strict=False):
        scale = 1.0 if case["init_scale"] is None else case["init_scale"]
        for i, got in enumerate(steps):
            if not ex4.step_problem(case, i, got, scale):
                scale = got["scale"]
                continue
            if ex4.overflows(case) or "error" in got:
                return None
            what = f"amp_step, {ex4.describe(case)}, step {i}"
            _, norm, unclipped = ex4.fp32_step(got["before"], case, i)
            moved = float(ex4.flat_delta(got["after"], got["before"]).norm())
            clip = min(1.0, case["max_norm"] / norm)
            if scale > 1 and norm * scale > case["max_norm"]:
                mingpt = unclipped * case["max_norm"] / (norm * scale)
                if abs(moved - mingpt) <= 0.05 * mingpt or abs(got["norm"] - norm * scale) <= (
                    0.05 * norm * scale
                ):
                    right = unclipped * clip
                    return (
                        f"{what}: you clipped the scaled gradients (clip_grad_norm_ before "
                        f"scaler.unscale_): their norm is {norm * scale:.4g}, {scale:g} times "
                        f"the true one, so clipping shrank the step to {moved / right:.2g} "
                        "times the right one (the bug of the PyTorch examples' minGPT "
                        "trainer); unscale first, then clip"
                    )
            if clip < 0.5 and abs(moved - unclipped) <= 0.05 * unclipped:
                return (
                    f"{what}: the step was not clipped: its gradient norm {norm:.4g} is above "
                    f"max_norm {case['max_norm']:.4g}; clip_grad_norm_ after unscale_, before "
                    "step"
                )
            if abs(got["norm"] - case["max_norm"]) <= 1e-3 * case["max_norm"] and clip < 1:
                return (
                    f"{what}: you returned the norm after clipping ({got['norm']:.4g} = "
                    "max_norm); return what clip_grad_norm_ returns, the norm before clipping"
                )
            return None
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
    "test_ex4_amp_step": Hidden(explain=_amp_explain),
    "test_ex5_global_grad_norm": Hidden(explain=_norm_explain),
}
