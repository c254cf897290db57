"""Exercise 4: ``fixed_train.py``, the hanging script of the notebook, fixed.

The notebook's ``hang_train.py`` trains a linear model by hand, data-parallel: each epoch
deals a shuffled order out to the ranks (rank ``r`` gets positions ``r, r + world, ...``),
each step takes the next ``batch_size`` samples of every rank, one all-reduce per step
sums the gradients, losses and counts of the global batch, and every ``log_every`` steps the
largest squared error of the global batch is logged. It hangs: the logging all-reduce runs
on rank 0 only, and with uneven shards some ranks take one more step per epoch than others,
so their all-reduces pair with the wrong partners and the last one has none.

The checker runs the student's ``train`` on every rank of a torchrun job (2 ranks, then 3),
each call under a watchdog (a hang ends the rank with one line), on data whose length is
not divisible by the world size, over several epochs. The case set, per world size: one
rank's shard needs one more step than another's (so the last step of an epoch leaves some
ranks without a sample); shards of different lengths that need the same number of steps;
fewer samples than ranks (a rank with no data at all); a length divisible by the world size
(every rank the same number of steps, the last batch short).

The judge computes the right result in one process, from the definition (each step's
global batch: the next ``batch_size`` samples of every rank's shard; the mean of the
per-sample gradients over it), and asks for: the same weights on every rank, equal to it
(float64, 1e-9); rank 0's logs equal to the global batches' mean loss and largest squared
error at the logging steps. A "fix" that drops a collective, skips samples or logs rank 0's
own numbers fails. Logging is rank 0's alone (the checker captures what each rank prints
during ``train``): rank 0 prints one line per record, every other rank returns ``[]`` as its
records and prints nothing.
"""

from __future__ import annotations

import contextlib
import datetime
import io

import torch
import torch.distributed as dist

from ddp_lab.checks import guards
from ddp_lab.checks.contract import Exercise
from ddp_lab.checks.failure import CheckFailed
from ddp_lab.checks.lab06.common import FIXED_FILE
from ddp_lab.checks.values import first, number, randint, uniform

ATOL = 1e-9
#: Seconds one call of the student's train may take on a rank before the watchdog ends it.
CALL_S = 20.0


def _run(gen: torch.Generator, n: int, b: int, kind: str) -> dict:
    d = randint(gen, 3, 5)
    x = torch.randn(n, d, generator=gen, dtype=torch.float64)
    w_true = torch.randn(d, generator=gen, dtype=torch.float64)
    y = x @ w_true + 0.1 * torch.randn(n, generator=gen, dtype=torch.float64)
    return {
        "kind": kind,
        "x": x,
        "y": y,
        "epochs": randint(gen, 2, 4),
        "batch_size": b,
        "lr": uniform(gen, 0.02, 0.1),
        "log_every": randint(gen, 1, 2),
        "seed": randint(gen, 0, 10**6),
    }


def _runs(gen: torch.Generator, world: int) -> list[dict]:
    """The case set for one world size (see the module)."""
    b = randint(gen, 2, 3)
    q = randint(gen, 2, 3)
    # shards of q*b + 1 and q*b samples: q + 1 steps against q
    extra = world * (q * b) + randint(gen, 1, world - 1)
    # shards of q*b + 2 and q*b + 1 samples: q + 1 steps each, the last batches differ
    level = world * (q * b + 2) - randint(gen, 1, world - 1)
    even = randint(gen, 3, 6)
    even = world * (even + 1 if even % b == 0 else even)
    return [
        _run(gen, extra, b, "one rank needs one more step than another"),
        _run(gen, level, b, "the same steps on every rank, last batches of different sizes"),
        _run(gen, randint(gen, 1, world - 1), b, "fewer samples than ranks"),
        _run(gen, even, b, "a length divisible by the world size"),
    ]


def make_inputs(gen: torch.Generator) -> dict:
    """Two torchrun jobs, 2 ranks and 3 ranks, four runs each."""
    return {"cases": [{"world_size": w, "runs": _runs(gen, w)} for w in (2, 3)]}


def visible_inputs(gen: torch.Generator) -> dict:
    """One job on 2 ranks."""
    return {"cases": [{"world_size": 2, "runs": _runs(gen, 2)}]}


def _all_back(rank: int, world: int, run: int) -> None:
    """Wait (through the store, not a collective) until every rank's train() of this run
    returned: a rank that finished early must not start the next run, whose collectives
    would pair with the slow rank's leftover ones. A rank still stuck in a collective is
    ended by its watchdog first."""
    store = dist.distributed_c10d._get_default_store()
    store.set(f"ddp_lab/lab06/ex5/{run}/{rank}", "1")
    keys = [f"ddp_lab/lab06/ex5/{run}/{r}" for r in range(world)]
    store.wait(keys, datetime.timedelta(seconds=3 * CALL_S))


def run_rank(ns: dict, inputs: dict, case: dict, rank: int, world: int) -> list[dict]:
    """The student's ``train`` on this rank, once per run, each under a watchdog."""
    train = guards.load_student_file(FIXED_FILE)["train"]
    out = []
    for i, spec in enumerate(case["runs"]):

        def why(spec=spec, i=i) -> str:
            return (
                f"{FIXED_FILE}: train() on rank {rank} of {world} did not return within "
                f"{CALL_S:g} s (run {i}: {len(spec['y'])} samples, batch_size "
                f"{spec['batch_size']}): the ranks are waiting for each other; do they all "
                "call the same collectives, and take the same number of steps?"
            )

        printed = io.StringIO()
        with guards.call_watchdog(CALL_S, why), contextlib.redirect_stdout(printed):
            got = train(
                spec["x"].clone(),
                spec["y"].clone(),
                spec["epochs"],
                spec["batch_size"],
                spec["lr"],
                spec["log_every"],
                seed=spec["seed"],
            )
        _all_back(rank, world, i)
        lines = [line for line in printed.getvalue().splitlines() if line.strip()]
        if isinstance(got, (tuple, list)) and len(got) == 2:
            out.append({"w": got[0], "logs": got[1], "printed": lines})
        else:
            out.append({"w": got, "logs": None, "printed": lines})
    return out


# --- the oracle and the judge ---------------------------------------------------------------


def expected(spec: dict, world: int) -> tuple[torch.Tensor, list[list[float]]]:
    """The right weights and logs, in one process, from the script's definition: position
    ``p`` of an epoch's order is rank ``p % world``'s sample number ``p // world``, so it
    belongs to the global batch of step ``(p // world) // batch_size``; there are as many
    steps as the longest share needs."""
    x, y, b = spec["x"], spec["y"], spec["batch_size"]
    n = len(y)
    longest = -(-n // world)
    batch_of = torch.div(torch.arange(n) // world, b, rounding_mode="floor")
    w = torch.zeros(x.shape[1], dtype=torch.float64)
    logs = []
    for epoch in range(spec["epochs"]):
        gen = torch.Generator()
        gen.manual_seed(spec["seed"] + epoch)
        perm = torch.randperm(n, generator=gen)
        for k in range(-(-longest // b)):
            members = perm[batch_of == k]
            residual = x[members] @ w - y[members]
            sq = residual * residual
            if (k + 1) % spec["log_every"] == 0:
                logs.append([epoch, k, float(sq.mean()), float(sq.max())])
            w = w - spec["lr"] * 2 * (x[members].T @ residual) / members.numel()
    return w, logs


def _logs_problem(got, want: list[list[float]], at: str) -> str | None:
    if not isinstance(got, list) or len(got) != len(want):
        n = len(got) if isinstance(got, list) else got
        return (
            f"{at}: rank 0 logged {n} records; expected {len(want)} (one every log_every "
            "steps of every epoch, the same steps on every rank)"
        )
    for g, e in zip(got, want, strict=True):
        vals = [number(v) for v in g] if isinstance(g, list) and len(g) == 4 else None
        if vals is None or vals[:2] != e[:2]:
            return f"{at}: log record {g!r:.80} should be (epoch, step, loss, worst) = {e[:2]}, ..."
        for j, name in ((2, "mean loss"), (3, "largest squared error")):
            if not abs(vals[j] - e[j]) <= ATOL * max(1.0, abs(e[j])):
                return (
                    f"{at}: at epoch {e[0]}, step {e[1]} rank 0 logged the {name} "
                    f"{vals[j]:.6g}; the global batch's is {e[j]:.6g} (over every rank's "
                    "samples of that step: the collective that computes it must run on every "
                    "rank)"
                )
    return None


def run_problem(spec: dict, world: int, ranks: list[dict]) -> str | None:
    """What is wrong with one run on every rank, or None."""
    n, b = len(spec["y"]), spec["batch_size"]
    at = f"{world} ranks, {n} samples, batch_size {b}, {spec['epochs']} epochs ({spec['kind']})"
    want_w, want_logs = expected(spec, world)
    for rank, got in enumerate(ranks):
        w = got["w"]
        if not isinstance(w, torch.Tensor) or w.shape != want_w.shape:
            return (
                f"{at}: rank {rank} returned {type(w).__name__} weights; expected a tensor of "
                f"shape {tuple(want_w.shape)}"
            )
        diff = (w.double() - want_w).abs().max().item()
        if not diff <= ATOL:
            return (
                f"{at}: rank {rank}'s weights differ from one process's by {diff:.3g}: every "
                "step must average the gradient over all of the global batch's samples, every "
                "rank taking part in every step (with no sample left, a rank still joins the "
                "all-reduce with zeros)"
            )
    if why := _logs_problem(ranks[0]["logs"], want_logs, at):
        return why
    return _rank0_only_problem(ranks, len(want_logs), at)


def _rank0_only_problem(ranks: list[dict], records: int, at: str) -> str | None:
    """Logging is rank 0's alone: rank 0 prints one line per record, the others return
    ``[]`` and print nothing."""
    for rank, got in enumerate(ranks[1:], start=1):
        if got.get("logs") != []:
            logs = got.get("logs")
            what = f"{len(logs)} records" if isinstance(logs, list) else repr(logs)[:40]
            return (
                f"{at}: rank {rank} returned {what} as its logs; only rank 0 logs, the other "
                "ranks return [] (they take part in every collective, but keep no records)"
            )
        if got.get("printed"):
            return (
                f"{at}: rank {rank} printed {len(got['printed'])} line(s), e.g. "
                f"{got['printed'][0]!r:.60}; only rank 0 prints (one line per record): on "
                f"{len(ranks)} ranks every line would appear {len(ranks)} times"
            )
    printed = ranks[0].get("printed") or []
    if len(printed) != records:
        return (
            f"{at}: rank 0 printed {len(printed)} line(s) for {records} records; it prints "
            "one line per record"
        )
    return None


def judge(inputs: dict, outputs: dict) -> str:
    """Weights and logs of every run on every rank against one process (see the module)."""
    runs = 0
    for case, ranks in zip(inputs["cases"], outputs["cases"], strict=True):
        world = case["world_size"]
        if len(ranks) != world:
            raise CheckFailed(f"expected the results of {world} ranks, got {len(ranks)}")
        for i, spec in enumerate(case["runs"]):
            if why := run_problem(spec, world, [r[i] for r in ranks]):
                raise CheckFailed(why)
            runs += 1
    worlds = " and ".join(str(c["world_size"]) for c in inputs["cases"])
    sizes = first(len(s["y"]) for c in inputs["cases"] for s in c["runs"])
    return (
        f"fixed_train.py finished {runs} runs on {worlds} ranks ({sizes} samples: uneven "
        "shards, empty last batches, a rank without data) with one process's weights and logs, "
        "logged by rank 0 alone"
    )


EXERCISE = Exercise(
    "test_ex5_fix_hang",
    ("ex5_fix_hang",),
    "the hanging script, fixed",
    make_inputs,
    judge,
    run_rank=run_rank,
    timeout=150,
    visible_inputs=visible_inputs,
    files=(FIXED_FILE,),
)
