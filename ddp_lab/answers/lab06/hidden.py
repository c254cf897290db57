"""What the grader adds to lab 6's kit judges: exact comparisons and named diagnoses.

- ex1: a save that returned normally although the disk filled up, and left a shorter file
  under the checkpoint's name, is named: ``os.write`` may write fewer bytes than asked;
- ex2: a resumed run whose weights differ is matched against twins, runs of the oracle that
  resume with one typical flaw: no generator states, generators restored before
  ``iter(loader)``, rank 0's generators on every rank, the schedule or the optimizer not
  restored, an end-of-epoch checkpoint turned into "epoch + 1, batch 0" with the generators
  restored after the next epoch's ``iter(loader)``;
- ex3: the plans compared with the reference's; a wrong plan matched against typical
  broken rules (the drop measured from the previous evaluation, the latest checkpoint
  restored, ``>=`` for ``>``, a tie that moves the best, thrown-away steps counted from the
  best checkpoint even after an earlier rollback);
- ex4: the misreadings of ``hidden_diagnose``;
- ex5: wrong weights matched against a run that stops every epoch at the shortest shard, and
  wrong logs against rank 0's own largest error.
"""

from __future__ import annotations

import copy
import math

import torch

from ddp_lab.answers import Hidden
from ddp_lab.answers.lab06 import references as ref
from ddp_lab.answers.lab06.hidden_diagnose import diagnose_explain
from ddp_lab.checks.failure import CheckFailed
from ddp_lab.checks.lab06 import ex2_resume as ex2
from ddp_lab.checks.lab06 import ex3_rollback as ex3
from ddp_lab.checks.lab06 import ex5_fix_hang as ex5
from ddp_lab.checks.lab06 import recipe
from ddp_lab.checks.values import same_bits

# --- exercise 1 ---------------------------------------------------------------------------


def _save_explain(inputs: dict, outputs: dict) -> str | None:
    for case, out in zip(inputs["cases"], outputs.get("cases", []), strict=False):
        before = None
        for step in out.get("steps", []):
            changed = step["sha"] not in (None, before)
            before = step["sha"]
            if step["how"] == "full" and step["raised"] is None and changed:
                return (
                    f"the {case['kind']} checkpoint: when the disk filled up half-way your save "
                    "returned normally and renamed a partial file onto path: os.write may "
                    "write fewer bytes than asked (loop until every byte is written, or use "
                    "f.write, which raises)"
                )
    return None


# --- exercise 2 ---------------------------------------------------------------------------


class _Twin(recipe.Simulation):
    """The oracle, resumed at each checkpoint with one typical flaw."""

    def __init__(self, spec: dict, world: int, flaw: str):
        super().__init__(spec, world)
        self.flaw = flaw
        self._then = None

    def batches(self, epoch: int) -> list:
        out = super().batches(epoch)
        if self._then is not None:  # generators restored after this epoch's iter()
            self.rngs, self._then = self._then, None
        return out

    def restart(self, epoch: int, done: int) -> list | None:
        saved = [list(r) for r in self.rngs]
        opt_state = copy.deepcopy(self.optimizer.state_dict())
        sched_state = copy.deepcopy(self.scheduler.state_dict())
        self.optimizer, self.scheduler = recipe.make_optimizer(self.model.parameters(), self.spec)
        if self.flaw != "no_optimizer":
            self.optimizer.load_state_dict(opt_state)
        if self.flaw != "no_scheduler":
            self.scheduler.load_state_dict(sched_state)
        self.rngs = recipe.seeded(self.spec, self.world)
        if self.flaw == "rng_before_iter":
            self.rngs = saved
        if self.flaw == "epoch_end_normalized" and done == self.spec["steps_per_epoch"]:
            self._then = saved  # the next epoch's iter() runs first, on fresh generators
            return []
        its = self.batches(epoch)
        for r, it in enumerate(its):  # skipping reads the batches: the data set draws
            with recipe.as_rank(self.rngs, r):
                for _ in range(done):
                    next(it)
        if self.flaw == "rank0_rng":
            self.rngs = [list(saved[0]) for _ in saved]
        elif self.flaw not in ("no_rng", "rng_before_iter"):  # where the run had them
            self.rngs = saved
        return its


_TWINS = [
    (
        "no_rng",
        "the resumed run did not restore the generators: every rank's torch and Python "
        "random states (dropout, the data set's noise and flips) must come back from the "
        "checkpoint",
    ),
    (
        "rng_before_iter",
        "you restored the generators before this epoch's iter(loader), which then drew a "
        "seed from them (and the skipped batches drew noise): restore them after creating "
        "the iterator and skipping the batches already done",
    ),
    (
        "rank0_rng",
        "every rank restored rank 0's generator states: gather every rank's states into the "
        "checkpoint (dist.all_gather_object) and let each rank restore its own",
    ),
    (
        "no_scheduler",
        "the learning-rate schedule was not restored: save scheduler.state_dict() and load "
        "it (a fresh LambdaLR starts again at step 0)",
    ),
    (
        "no_optimizer",
        "the optimizer's state (momentum, Adam's moments, its step count) was not restored",
    ),
    (
        "epoch_end_normalized",
        "a checkpoint taken at the end of an epoch resumed wrong: the next epoch's "
        "iter(loader) drew its seed from fresh generators, restored only after it; keep "
        "(epoch, batches done = the whole epoch) and skip that epoch, or restore the "
        "generators before the next epoch's iter(loader)",
    ),
]


def _resume_explain(inputs: dict, outputs: dict) -> str | None:
    for spec, ranks in zip(inputs["cases"], outputs.get("cases", []), strict=False):
        want = recipe.oracle(spec)
        for i, stops in enumerate(spec["scenarios"]):
            here = [r[i] for r in ranks]
            if not ex2.problem(spec, stops, here, want):
                continue
            if ex2.count_problem(spec, stops, here[0]["attempts"]):
                return None
            finals = [r["attempts"][-1]["final"] for r in here]
            got = finals[0]
            if not all(same_bits(f, got) for f in finals) or same_bits(got, want):
                return None  # ranks that disagree: the kit's message says it
            restarts = [c for c in recipe.checkpoint_steps(spec, stops) if c > 0]
            for flaw, why in _TWINS:
                twin = _Twin(spec, spec["world_size"], flaw).run(restarts)
                if same_bits(got, twin) and not same_bits(twin, want):
                    return f"{ex2.scenario_text(spec, stops)}: {why}"
            return None
    return None


# --- exercise 3 ---------------------------------------------------------------------------


def _plan(history, drop, *, vs_previous=False, ge=False, tie_moves=False, from_best=False):
    """The rule with one typical flaw switched on (all off: the reference's rule)."""
    plan, best, prev, restored_at = [], None, None, None
    for h in history:
        step, acc = h["step"], h["accuracy"]
        base = prev if vs_previous else best
        fell = base is not None and (base[0] - acc >= drop if ge else base[0] - acc > drop)
        prev = (acc, step)
        if fell:
            since = best[1] if from_best or restored_at is None else max(best[1], restored_at)
            plan.append({"restore": best[1], "best": best[1], "discarded": step - since})
            restored_at = step
            continue
        if best is None or acc > best[0] or (tie_moves and acc == best[0]):
            best = (acc, step)
        plan.append({"restore": None, "best": best[1], "discarded": 0})
    return plan


def _rolled(plan) -> list[bool]:
    return [d is not None and d["restore"] is not None for d in plan]


def _field(plan, key: str) -> list:
    return [None if d is None else d[key] for d in plan]


#: (flaw, what of the plan it shows in, diagnosis)
_RULE_MISTAKES = [
    (
        {"vs_previous": True},
        _rolled,
        "you measured the drop from the previous evaluation; the rule compares with the best "
        "checkpoint (a slow decline, each step within the threshold, must roll back too)",
    ),
    (
        {"ge": True},
        _rolled,
        "you rolled back on a drop exactly equal to the threshold: the rule is 'more than "
        "drop points' (>, not >=)",
    ),
    (
        {"tie_moves": True},
        lambda plan: _field(plan, "best"),
        "on a tie the best checkpoint moved to the later evaluation: it stays the earlier one "
        "(a later one must be strictly better)",
    ),
    (
        {"from_best": True},
        lambda plan: _field(plan, "discarded"),
        "after a second rollback to the same checkpoint you counted the thrown-away steps from "
        "the best checkpoint again: the steps before the previous rollback were thrown away "
        "already",
    ),
]


def _rollback_check(inputs: dict, outputs: dict) -> None:
    for case, got in zip(inputs["cases"], outputs["plans"], strict=True):
        want = ref.rollback_plan(case["history"], case["drop"])
        if [ex3._decision(g) for g in got] != want:
            raise CheckFailed(f"drop {case['drop']:g}: the plan differs from the rule's: {want}")


def _restores_latest(cases: list[dict], got: list) -> bool:
    """Every rollback restored the evaluation just before it, and one of those was not the
    best checkpoint."""
    other = False
    for case, plan in zip(cases, got, strict=True):
        right = ref.rollback_plan(case["history"], case["drop"])
        for i, (d, r) in enumerate(zip(plan, right, strict=True)):
            if d is None or r["restore"] is None:
                continue
            if i == 0 or d["restore"] != case["history"][i - 1]["step"]:
                return False
            other = other or d["restore"] != r["restore"]
    return other


def _rollback_explain(inputs: dict, outputs: dict) -> str | None:
    plans = outputs.get("plans")
    cases = inputs["cases"]
    if not isinstance(plans, list) or len(plans) != len(cases):
        return None
    got = [[ex3._decision(d) for d in p] if isinstance(p, list) else None for p in plans]
    if any(g is None or len(g) != len(c["history"]) for g, c in zip(got, cases, strict=True)):
        return None
    right = [ref.rollback_plan(c["history"], c["drop"]) for c in cases]
    if all(_rolled(g) == _rolled(r) for g, r in zip(got, right, strict=True)):
        if _restores_latest(cases, got):
            return (
                "you restored the latest checkpoint; the rule restores the best one (the "
                "latest may already be on the way down)"
            )
    for flags, view, why in _RULE_MISTAKES:
        twins = [_plan(c["history"], c["drop"], **flags) for c in cases]
        differs = any(view(t) != view(r) for t, r in zip(twins, right, strict=True))
        if differs and all(view(g) == view(t) for g, t in zip(got, twins, strict=True)):
            return why
    return None


# --- exercise 4 ---------------------------------------------------------------------------


def _shortest(spec: dict, world: int) -> torch.Tensor:
    """The weights of a run that stops every epoch at the shortest shard's last step."""
    x, y, b, n = spec["x"], spec["y"], spec["batch_size"], len(spec["y"])
    w = torch.zeros(x.shape[1], dtype=torch.float64)
    for epoch in range(spec["epochs"]):
        order = torch.randperm(n, generator=torch.Generator().manual_seed(spec["seed"] + epoch))
        shards = [order[r::world] for r in range(world)]
        for k in range(math.ceil(min(len(s) for s in shards) / b)):
            idx = torch.cat([s[k * b : (k + 1) * b] for s in shards])
            err = x[idx] @ w - y[idx]
            w = w - spec["lr"] * (2 * x[idx].T @ err) / len(idx)
    return w


def _own_worst(spec: dict, world: int) -> list[float]:
    """Rank 0's own largest squared error at each logging step."""
    x, y, b, n = spec["x"], spec["y"], spec["batch_size"], len(spec["y"])
    w = torch.zeros(x.shape[1], dtype=torch.float64)
    steps = math.ceil(math.ceil(n / world) / b)
    out = []
    for epoch in range(spec["epochs"]):
        order = torch.randperm(n, generator=torch.Generator().manual_seed(spec["seed"] + epoch))
        shards = [order[r::world] for r in range(world)]
        for k in range(steps):
            idx = torch.cat([s[k * b : (k + 1) * b] for s in shards])
            mine = shards[0][k * b : (k + 1) * b]
            if (k + 1) % spec["log_every"] == 0:
                e0 = x[mine] @ w - y[mine]
                out.append(float(e0.square().max()) if len(mine) else 0.0)
            err = x[idx] @ w - y[idx]
            w = w - spec["lr"] * (2 * x[idx].T @ err) / len(idx)
    return out


def _hang_explain(inputs: dict, outputs: dict) -> str | None:
    for case, ranks in zip(inputs["cases"], outputs.get("cases", []), strict=False):
        world = case["world_size"]
        for i, spec in enumerate(case["runs"]):
            here = [r[i] for r in ranks]
            if not ex5.run_problem(spec, world, here):
                continue
            w = here[0]["w"]
            at = f"{world} ranks, {len(spec['y'])} samples ({spec['kind']})"
            if isinstance(w, torch.Tensor) and w.shape == (spec["x"].shape[1],):
                right = (w.double() - ex5.expected(spec, world)[0]).abs().max() <= ex5.ATOL
                if not right and (w.double() - _shortest(spec, world)).abs().max() <= ex5.ATOL:
                    return (
                        f"{at}: every epoch stopped at the shortest shard's last step, so the "
                        "samples of the longer shards' last step were skipped: every rank must "
                        "take the longest shard's number of steps (a rank with no sample left "
                        "joins with zeros)"
                    )
            logs = here[0]["logs"]
            if isinstance(logs, list) and logs and all(isinstance(g, list) for g in logs):
                own = _own_worst(spec, world)
                worst = [g[3] if len(g) == 4 else None for g in logs]
                if len(worst) == len(own) and all(
                    isinstance(a, (int, float)) and abs(a - b) <= 1e-9 * max(1, abs(b))
                    for a, b in zip(worst, own, strict=True)
                ):
                    return (
                        f"{at}: rank 0 logged its own largest squared error, not the global "
                        "batch's: the maximum over the ranks needs a collective "
                        "(all_reduce with ReduceOp.MAX) that every rank calls, outside the "
                        "rank-0 branch; only the print stays in it"
                    )
            return None
    return None


HIDDEN = {
    "test_ex1_atomic_save": Hidden(explain=_save_explain),
    "test_ex2_resume": Hidden(explain=_resume_explain),
    "test_ex3_rollback": Hidden(check=_rollback_check, explain=_rollback_explain),
    "test_ex4_diagnose_hang": Hidden(explain=diagnose_explain),
    "test_ex5_fix_hang": Hidden(explain=_hang_explain),
}
