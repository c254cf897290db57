"""Exercise 3: ``rollback_plan(history, drop)``, the seeds' rollback rule over a run.

A run evaluates its weights and then checkpoints them, every few steps; ``history`` lists
the evaluations (optimizer step, validation accuracy in percent). The student's function
says, for each evaluation, which checkpoint the run restores (if any), which checkpoint is
the best afterwards, and how many optimizer steps' updates the rollback threw away.

Accuracies are multiples of 0.25 (a validation set of 400 samples) and drops multiples of
0.25 too, so every comparison is exact in floating point: a drop exactly equal to the
threshold is exactly equal. The case set, in every run: a history with a first evaluation, a
tie with the best, a drop exactly equal to the threshold, a slow decline (each evaluation
within the threshold of the previous one but not of the best), two rollbacks in a row to the
same best, a new best after a rollback and a later rollback to it, uneven step spacing;
the same with ``drop = 0``; a random walk with random events; a history of one evaluation;
an empty one.

The judge checks each decision against the rule's properties, walking the history: a
rollback exactly when the accuracy is more than ``drop`` below the best checkpoint's; the
best is the earliest of the highest accuracies among the evaluations that did not roll
back; the steps thrown away are those since the weights in use were last restored or
taken from the best checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ddp_lab.checks.contract import Exercise
from ddp_lab.checks.failure import CheckFailed
from ddp_lab.checks.values import number, randint

KEYS = ("restore", "best", "discarded")


def _quarter(gen: torch.Generator, low: float, high: float) -> float:
    """A random multiple of 0.25 in ``[low, high]``."""
    return randint(gen, round(4 * low), round(4 * high)) / 4


def _steps(gen: torch.Generator, n: int) -> list[int]:
    """``n`` increasing optimizer steps, unevenly spaced."""
    out, step = [], 0
    for _ in range(n):
        step += randint(gen, 1, 4) * 50
        out.append(step)
    return out


def _scripted(gen: torch.Generator, drop: float) -> list[float]:
    """Accuracies with every edge case, at random levels.

    first -> a rise -> a tie with the best -> a drop of exactly ``drop`` -> a slow decline
    that ends more than ``drop`` below the best -> a second rollback in a row -> recovery
    to a new best -> a drop past it.
    """
    a0 = _quarter(gen, 30, 50)
    best = a0 + _quarter(gen, 1, 10)
    step = max(drop, 0.25)
    slow = [best - 0.5 * step, best - step, best - step - _quarter(gen, 0.25, 3)]
    again = best - drop - _quarter(gen, 0.25, 5)
    new_best = best + _quarter(gen, 0.25, 5)
    fall = new_best - drop - _quarter(gen, 0.25, 5)
    return [a0, best, best, best - drop, *slow, again, new_best, new_best - drop, fall]


def _walk(gen: torch.Generator, drop: float) -> list[float]:
    """A random walk with random jumps (rises, small dips, large drops)."""
    acc, out = _quarter(gen, 20, 60), []
    for _ in range(randint(gen, 8, 14)):
        kind = randint(gen, 0, 3)
        if kind == 0:
            acc = acc + _quarter(gen, 0, 6)
        elif kind == 1:
            acc = acc - _quarter(gen, 0, drop)
        elif kind == 2:
            acc = acc - drop - _quarter(gen, 0.25, 8)
        out.append(max(0.0, min(100.0, acc)))
    return out


def _history(gen: torch.Generator, accuracies: list[float]) -> list[dict]:
    return [
        {"step": s, "accuracy": a}
        for s, a in zip(_steps(gen, len(accuracies)), accuracies, strict=True)
    ]


def make_inputs(gen: torch.Generator) -> dict:
    """Five histories: the scripted one at ``drop = 5`` and at ``drop = 0``, a random walk
    with a random ``drop``, one evaluation, none."""
    drop = _quarter(gen, 1, 8)
    return {
        "cases": [
            {"drop": 5.0, "history": _history(gen, _scripted(gen, 5.0))},
            {"drop": 0.0, "history": _history(gen, _scripted(gen, 0.0))},
            {"drop": drop, "history": _history(gen, _walk(gen, drop))},
            {"drop": _quarter(gen, 0, 5), "history": _history(gen, [_quarter(gen, 0, 100)])},
            {"drop": 5.0, "history": []},
        ]
    }


def visible_inputs(gen: torch.Generator) -> dict:
    """The scripted history at ``drop = 5``, one evaluation, none."""
    cases = make_inputs(gen)["cases"]
    return {"cases": [cases[0], cases[3], cases[4]]}


def run(ns: dict, inputs: dict, workdir: Path) -> dict:
    """The student's plan for every history (given copies: it may not edit ours)."""
    fn = ns["rollback_plan"]
    out = []
    for case in inputs["cases"]:
        history = [dict(h) for h in case["history"]]
        out.append(fn(history, case["drop"]))
    return {"plans": out}


# --- the judge: the rule's properties, evaluation by evaluation ----------------------------


def _decision(got) -> dict | None:
    """A decision as ``{"restore": int | None, "best": int, "discarded": int}``, or None."""
    if not isinstance(got, dict) or set(got) != set(KEYS):
        return None
    out = {}
    for key in KEYS:
        value = got[key]
        if key == "restore" and value is None:
            out[key] = None
            continue
        v = number(value)
        if v != v or v != int(v):
            return None
        out[key] = int(v)
    return out


def _fmt(history: list[dict], i: int) -> str:
    return f"evaluation {i} (step {history[i]['step']}, {history[i]['accuracy']:g} %)"


def plan_problem(case: dict, plan) -> str | None:
    """The first decision that breaks the rule, or None."""
    history, drop = case["history"], case["drop"]
    if not isinstance(plan, list) or len(plan) != len(history):
        n = len(plan) if isinstance(plan, list) else type(plan).__name__
        return f"{len(history)} evaluations, but the plan has {n} entries (one dict per evaluation)"
    top = None  # (accuracy, step) of the best checkpoint
    in_use_since = None  # step from which the weights in use carry their updates
    for i, (h, raw) in enumerate(zip(history, plan, strict=True)):
        got = _decision(raw)
        where = f"drop {drop:g}, {_fmt(history, i)}"
        if got is None:
            return f"{where}: expected a dict with keys {', '.join(KEYS)}, got {raw!r:.80}"
        fell = top is not None and top[0] - h["accuracy"] > drop
        if fell and got["restore"] != top[1]:
            return (
                f"{where}: {top[0] - h['accuracy']:g} points below the best checkpoint (step "
                f"{top[1]}, {top[0]:g} %), more than {drop:g}: restore step {top[1]}, got "
                f"{got['restore']}"
            )
        if not fell and got["restore"] is not None:
            below = "" if top is None else f" ({top[0] - h['accuracy']:g} points below the best)"
            return (
                f"{where}: no rollback here{below}: the rule restores only when the accuracy "
                f"is more than {drop:g} points below the best checkpoint's; got "
                f"restore={got['restore']}"
            )
        if not fell and (top is None or h["accuracy"] > top[0]):
            top = (h["accuracy"], h["step"])
        if got["best"] != top[1]:
            return (
                f"{where}: the best checkpoint afterwards is step {top[1]} ({top[0]:g} %), "
                f"got {got['best']}"
            )
        lost = h["step"] - max(top[1], in_use_since or 0) if fell else 0
        if got["discarded"] != lost:
            return (
                f"{where}: {lost} optimizer steps' updates are thrown away here, got "
                f"{got['discarded']}"
            )
        if fell:
            in_use_since = h["step"]
    return None


def judge(inputs: dict, outputs: dict) -> str:
    """Every decision of every history against the rule's properties."""
    plans = outputs.get("plans")
    if not isinstance(plans, list) or len(plans) != len(inputs["cases"]):
        raise CheckFailed("expected one plan per history")
    for case, plan in zip(inputs["cases"], plans, strict=True):
        if why := plan_problem(case, plan):
            raise CheckFailed(why)
    total = sum(len(c["history"]) for c in inputs["cases"])
    rolled = sum(
        p.get("restore") is not None for plan in plans for p in plan if isinstance(p, dict)
    )
    return (
        f"rollback_plan decided {total} evaluations of {len(plans)} histories right ({rolled} "
        "rollbacks; ties, a drop equal to the threshold, a slow decline, repeated drops, "
        "drop 0, one evaluation, none)"
    )


EXERCISE = Exercise(
    "test_ex3_rollback",
    ("ex3_rollback",),
    "the rollback rule over a run's evaluations",
    make_inputs,
    judge,
    run=run,
    timeout=30,
    visible_inputs=visible_inputs,
)
