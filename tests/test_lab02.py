"""Lab 2's checks, tested directly: the reference passes every judge (the kit's and the
grader's) on the fixed case set, each typical mistake fails its own with a message that says
why, the verdict does not depend on the draw, and the visible checks pass the solutions,
explain mistakes and ask for unfinished exercises.

Fast tests call the judges in this process on outputs built here: the ring is simulated from
the reference's schedule (with the messages each rank sends), the parameter servers from
their protocol (where each worker computes each gradient, what the server applies). The tests
marked slow start real torchrun jobs, through the visible checks and the grader. Every
mistake also goes through the grader in ``tests/test_mistakes.py``.
"""

from __future__ import annotations

import dataclasses
import io
import os
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _harness import (
    assert_verdicts,
    new_leftovers,
    notebook_with,
    own_tmpdir,
    released_sources,
    solution_sources,
)

from ddp_lab.answers import full_judge, hidden
from ddp_lab.answers.lab02 import mistakes
from ddp_lab.answers.lab02.references import ring_schedule
from ddp_lab.checks import guards
from ddp_lab.checks import lab02 as checks
from ddp_lab.checks.contract import exercises
from ddp_lab.checks.failure import CheckFailed
from ddp_lab.checks.lab02 import server, traffic
from ddp_lab.checks.runner import namespace, split_magics
from ddp_lab.grading.verdict import judge_notebook

LAB = "lab02_collectives"
EXERCISES = exercises(LAB)
HIDDEN = hidden(LAB)
SOLUTIONS = solution_sources(LAB)
RELEASED = released_sources(LAB)
RING, SERVER = "test_ex1_ring_all_reduce", "test_ex2_parameter_server"
STALE, MODEL = "test_ex3_stale_server", "test_ex4_cost_model"
PROPERTY_SEEDS = range(100)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _inputs(grade_id: str, seed: int = 0) -> dict:
    """The inputs the grader draws: the hidden part's own draw where it has one."""
    extra = HIDDEN.get(grade_id)
    make = extra.inputs if extra and extra.inputs else EXERCISES[grade_id].make_inputs
    return make(_gen(seed))


def _full(grade_id: str):
    return full_judge(EXERCISES[grade_id], HIDDEN.get(grade_id))


def _as_judged(outputs):
    """Outputs as the judge loads them (``torch.save`` then ``weights_only`` load)."""
    buf = io.BytesIO()
    torch.save(outputs, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _runs(inputs: dict) -> list[dict]:
    return [run for case in inputs["cases"] for run in case["runs"]]


def _job(inputs: dict, per_run) -> dict:
    """Judge outputs of the one 3-rank job: ``per_run(run) -> [each rank's output]``; ranks
    that sit a run out give None, as the checker's ranks do."""
    (case,) = inputs["cases"]
    ranks: list[list] = [[] for _ in range(case["world_size"])]
    for run in case["runs"]:
        outs = per_run(run)
        for r in range(case["world_size"]):
            ranks[r].append(outs[r] if r < run["ranks"] else None)
    return _as_judged({"cases": [ranks]})


# --------------------------------------------------------------------------- the ring, simulated


def simulated_ring(xs: list[torch.Tensor], skip_step: bool = False, mirror: bool = False):
    """Every rank's tensor after a ring all-reduce, and the ``[dst, numel]`` each rank sent,
    computed in one process from the schedule (``mirror``: the ring run leftwards)."""
    n = len(xs)
    chunks = [list(torch.tensor_split(x.clone().view(-1), n)) for x in xs]
    steps = ring_schedule(n)
    if skip_step:
        del steps[n - 2]
    sent: list[list] = [[] for _ in range(n)]
    for k, step in enumerate(steps):
        reduce = k < len(steps) - (n - 1)
        if mirror:  # rank r plays rank -r: messages go to r - 1
            step = [((-src) % n, (-dst) % n, c) for src, dst, c in step]
        moving = [(src, dst, c, chunks[src][c].clone()) for src, dst, c in step]
        for src, dst, c, value in moving:
            sent[src].append([dst, value.numel()])
            if reduce:
                chunks[dst][c] += value
            else:
                chunks[dst][c].copy_(value)
    return [torch.cat(c).view(x.shape) for c, x in zip(chunks, xs, strict=True)], sent


def _whole_tensors(xs):
    n = len(xs)
    total = torch.stack(xs).sum(0)
    sent = [[[(r + 1) % n, x.numel()]] * (n - 1) for r, x in enumerate(xs)]
    return [total.clone() for _ in xs], sent


NOTHING = object()  # a ring that returned None


def _ring_outputs(inputs: dict, answer) -> dict:
    """``answer(xs) -> (afters, sent, returns)`` for every tensor of every run; a return of
    None stands for ``tensor`` itself, ``NOTHING`` for a function that returned nothing."""

    def per_run(run):
        n = run["ranks"]
        outs = [[] for _ in range(n)]
        for j in range(len(run["data"][0])):
            afters, sent, returns = answer([run["data"][r][j] for r in range(n)])
            for r in range(n):
                back = returns[r]
                outs[r].append(
                    {
                        "after": afters[r],
                        "returned": None if back is NOTHING else back,
                        "itself": back is None,
                        "sent": sent[r],
                    }
                )
        return outs

    return _job(inputs, per_run)


def _ring(**kw):
    def answer(xs):
        afters, sent = simulated_ring(xs, **kw)
        return afters, sent, [None] * len(xs)

    return answer


def _right_sent(xs):
    return simulated_ring(xs)[1]


#: what a right ring leaves, and what each typical mistake leaves
RING_RIGHT = _ring()
RING_WRONGS = {
    "skips a step": _ring(skip_step=True),
    "wrong neighbour": _ring(mirror=True),
    "whole tensors": lambda xs: (*_whole_tensors(xs), [None] * len(xs)),
    "average": lambda xs: (
        [torch.stack(xs).mean(0) for _ in xs],
        _right_sent(xs),
        [None] * len(xs),
    ),
    "returns nothing": lambda xs: (
        [torch.stack(xs).sum(0) for _ in xs],
        _right_sent(xs),
        [NOTHING] * len(xs),
    ),
    "returned only": lambda xs: (
        [x.clone() for x in xs],
        _right_sent(xs),
        [torch.stack(xs).sum(0) for _ in xs],
    ),
}
RING_SAYS = {
    "skips a step": r"wrong in chunk\(s\).*misses rank",
    "wrong neighbour": r"rank 0 sent to rank\(s\) \[2\].*right neighbour \(r \+ 1\) % n",
    "whole tensors": r"sent \d+ elements in all.*2\(n - 1\)/n.*more than a ring needs",
    "average": "must SUM",
    "returned only": "in place",
    "returns nothing": r"returned something other than `tensor` itself on rank\(s\) \[0, 1\]",
}


# --------------------------------------------------------------------------- the servers, simulated


def simulated_server(version=None, combine=None, pull=True):
    """``per_run`` of a parameter server: the protocol replayed in one process (``version``:
    the step whose parameters the gradient of step t uses; ``combine``: what the server
    applies; ``pull``: whether the workers ever receive parameters)."""

    def per_run(run):
        s, steps = run["staleness"], run["steps"]
        rule = version or (lambda t: max(0, t - s))
        want = server.trajectory(run, rule, combine)
        mean = combine or (lambda gs: sum(gs) / len(gs))
        pairs = list(zip(run["xs"], run["ys"], strict=True))
        grads = [
            mean([server.gradient(x, y, want[rule(t)]) for x, y in pairs]) for t in range(steps)
        ]
        outs = [{"grads": grads, "after": want[1:], "final": want[steps], "returned": None}]
        points = [want[rule(t)] if pull else want[0] for t in range(steps)]
        final = want[steps] if pull else want[0]
        outs += [{"points": points, "final": final, "returned": None}] * (run["ranks"] - 1)
        return outs

    return per_run


SERVER_WRONGS = {
    "never pulls": (simulated_server(version=lambda t: 0, pull=False), "the workers never pulled"),
    "sums": (simulated_server(combine=sum), "is the sum of the workers' gradients"),
    "divides by n": (
        simulated_server(combine=lambda gs: sum(gs) / (len(gs) + 1)),
        "divide by the number of workers, n - 1",
    ),
}
STALE_WRONGS = {
    "off by one": (None, "more than the staleness bound"),
    "ignores staleness": (simulated_server(version=lambda t: t), "fresher than the rule asks"),
}


def _off_by_one(run):
    return simulated_server(version=lambda t: max(0, t - run["staleness"] - 1))(run)


STALE_WRONGS["off by one"] = (_off_by_one, STALE_WRONGS["off by one"][1])


# --------------------------------------------------------------------------- the case sets


def test_the_distributed_case_sets_run_2_and_3_ranks_in_one_job_of_3():
    for gid in (RING, SERVER, STALE):
        for inputs in (_inputs(gid), EXERCISES[gid].visible_inputs(_gen())):
            (case,) = inputs["cases"]
            assert case["world_size"] == 3
            assert {run["ranks"] for run in case["runs"]} == {2, 3}


def test_ring_inputs_cover_short_and_indivisible_lengths_and_both_dtypes():
    for run in _runs(_inputs(RING)):
        n, tensors = run["ranks"], run["data"][0]
        numels = [t.numel() for t in tensors]
        assert any(k < n for k in numels), "a tensor shorter than the world size"
        assert sum(k % n != 0 for k in numels) >= 3, "lengths the world size does not divide"
        assert any(t.dim() == 2 for t in tensors)
        assert {t.dtype for t in tensors} == {torch.float32, torch.float64}


def test_server_inputs_cover_one_and_many_steps_staleness_and_both_dtypes():
    for gid, bounds in ((SERVER, {0}), (STALE, {0, 1, 2})):
        runs = _runs(_inputs(gid))
        for n in (2, 3):
            mine = [r for r in runs if r["ranks"] == n]
            assert {r["staleness"] for r in mine} == bounds
            assert {r["init"].dtype for r in mine} == {torch.float32, torch.float64}
            assert any(r["steps"] == 1 for r in mine) and any(r["steps"] > 2 for r in mine)
            assert any(r["init"].numel() == 1 for r in mine)
            assert all(len(r["xs"]) == n - 1 for r in mine)
            assert all(r["steps"] >= r["staleness"] + 3 for r in mine if r["steps"] > 1)
    workers = [len(x) for r in _runs(_inputs(SERVER)) if r["ranks"] == 3 for x in r["xs"]]
    assert len(set(workers)) > 1, "workers hold different amounts of data"


def test_inputs_are_fresh_for_every_seed_and_visible_ones_are_fixed():
    for gid, ex in EXERCISES.items():
        assert str(_inputs(gid, 1)) != str(_inputs(gid, 2)), f"{gid}: same inputs every seed"
        assert str(ex.make_inputs(_gen(1))) != str(ex.make_inputs(_gen(2)))
    for gid in (RING, MODEL):
        make = EXERCISES[gid].visible_inputs
        assert str(make(_gen(1))) == str(make(_gen(2))), f"{gid}: visible inputs change"


def test_the_exercises_are_independent():
    for gid, ex in EXERCISES.items():
        assert ex.cells == (gid.removeprefix("test_"),), f"{gid} runs other exercises' cells"


def test_distributed_exercises_refuse_every_built_in_collective():
    for gid in (RING, SERVER, STALE):
        assert EXERCISES[gid].forbid == guards.COLLECTIVES
    for name in ("all_reduce", "broadcast", "reduce_scatter", "all_gather_single", "gather"):
        assert name not in dir(dist) or name in guards.COLLECTIVES, name
    assert not {"send", "recv", "isend", "irecv"} & set(guards.COLLECTIVES)


def test_model_cases_use_more_than_two_ranks_so_the_factor_matters():
    times = _inputs(MODEL)["times"]
    assert [c["n"] >= 3 for c in times] == [True, False, True, False]
    assert [c["n"] for c in times][1::2] == [2, 1]
    assert times[2]["sizes"].numel() == 1, "one size, passed as a number"
    fits = _inputs(MODEL)["fits"]
    assert sum("noise" in c for c in fits) == 3 and sum("seconds" in c for c in fits) == 2
    assert all(c["n"] >= 3 for c in fits if "seconds" in c)


# --------------------------------------------------------------------------- the ring's judges


def test_ring_traffic_property_on_its_own():
    xs = [torch.zeros(7), torch.zeros(7), torch.zeros(7)]
    assert traffic.ring_problem((7,), simulated_ring(xs)[1], 3) is None
    assert "rank 0 sent to rank(s) [2]" in traffic.ring_problem(
        (7,), simulated_ring(xs, mirror=True)[1], 3
    )
    assert "more than a ring needs" in traffic.ring_problem((7,), _whole_tensors(xs)[1], 3)
    assert "less than a ring needs" in traffic.ring_problem((7,), [[], [], []], 3)
    assert traffic.ring_problem((7,), simulated_ring(xs[:2])[1], 2) is None


@pytest.mark.parametrize("name", list(RING_WRONGS))
def test_ring_mistakes_are_told_what_is_wrong(name):
    inputs = _inputs(RING, 3)
    with pytest.raises(CheckFailed, match=RING_SAYS[name]):
        _full(RING)(inputs, _ring_outputs(inputs, RING_WRONGS[name]))


def test_ring_judge_passes_the_sum_and_the_grader_adds_the_schedule_to_wrong_chunks():
    inputs = _inputs(RING, 3)
    message = _full(RING)(inputs, _ring_outputs(inputs, RING_RIGHT))
    assert "on 2 and 3 ranks equals dist.all_reduce" in message and "right neighbour" in message
    skips = _ring_outputs(inputs, RING_WRONGS["skips a step"])
    with pytest.raises(CheckFailed) as kit:
        EXERCISES[RING].judge(inputs, skips)
    assert "(r - s) % n" not in str(kit.value), "the schedule is the grader's hint"
    with pytest.raises(CheckFailed, match=r"wrong in chunk\(s\).*\(r - s\) % n.*skips a step"):
        _full(RING)(inputs, skips)


def test_ring_judge_rejects_malformed_outputs():
    inputs = _inputs(RING)
    wrong_shape = _ring_outputs(
        inputs, lambda xs: ([torch.zeros(2, 2) for _ in xs], _right_sent(xs), [None] * len(xs))
    )
    with pytest.raises(CheckFailed, match="shape"):
        _full(RING)(inputs, wrong_shape)
    with pytest.raises(CheckFailed, match="expected 1 jobs"):
        _full(RING)(inputs, {"cases": []})
    with pytest.raises(CheckFailed, match="expected 7 results from each of 2 ranks"):
        _full(RING)(inputs, {"cases": [[[[], []], [[], []], [None, []]]]})


def test_property_ring_verdicts_do_not_depend_on_the_draw():
    """100 draws: the simulated ring passes the grader's full judge and the kit's, and each
    mistake fails both (the wrong neighbour and the whole tensors only by their traffic)."""
    for seed in PROPERTY_SEEDS:
        inputs = _inputs(RING, seed)
        right = _ring_outputs(inputs, RING_RIGHT)
        wrongs = {name: _ring_outputs(inputs, w) for name, w in RING_WRONGS.items()}
        for judge in (_full(RING), EXERCISES[RING].judge):
            assert_verdicts(judge, seed, inputs, right, wrongs)


# --------------------------------------------------------------------------- the servers' judges


@pytest.mark.parametrize("gid, wrongs", [(SERVER, SERVER_WRONGS), (STALE, STALE_WRONGS)])
def test_property_server_verdicts_do_not_depend_on_the_draw(gid, wrongs):
    """100 draws: the simulated protocol passes the full judge; each mistake fails it with
    its own diagnosis (never pulled, the sum, n instead of n - 1, off by one, no staleness)."""
    judge = _full(gid)
    for seed in PROPERTY_SEEDS:
        inputs = _inputs(gid, seed)
        bad = {}
        for name, (per_run, said) in wrongs.items():
            bad[name] = _job(inputs, per_run)
            with pytest.raises(CheckFailed, match=re.escape(said)):
                judge(inputs, bad[name])
        assert_verdicts(judge, seed, inputs, _job(inputs, simulated_server()), bad)


def test_server_judge_names_a_missing_grad_a_worker_left_behind_and_in_place():
    inputs = _inputs(SERVER, 5)
    judge = _full(SERVER)
    right = simulated_server()

    def no_grad(run):
        outs = right(run)
        return [{**outs[0], "grads": [None] * run["steps"]}, *outs[1:]]

    def stale_final(run):
        outs = right(run)
        return [*outs[:-1], {**outs[-1], "final": outs[0]["final"] + 1.0}]

    def returned_only(run):
        outs = right(run)
        return [*outs[:-1], {**outs[-1], "final": run["init"], "returned": outs[0]["final"]}]

    for per_run, said in (
        (no_grad, "was not set"),
        (stale_final, "ends with other parameters than the server's last ones"),
        (returned_only, "not updated in place"),
    ):
        with pytest.raises(CheckFailed, match=said):
            judge(inputs, _job(inputs, per_run))


# --------------------------------------------------------------------------- the cost model


def _run_model(source: str, inputs: dict) -> dict:
    ns = namespace({"ex4_cost_model": source}, ["ex4_cost_model"])
    return _as_judged(EXERCISES[MODEL].run(ns, inputs, Path(".")))


MODEL_MISTAKES = {m.name: m for m in mistakes.MISTAKES if m.cell == "ex4_cost_model"}
MODEL_MISTAKES.pop("imports the answer")


def test_property_model_verdicts_do_not_depend_on_the_draw():
    """100 draws of the grader's inputs: the solution passes the full judge, each mistake
    fails it with its own diagnosis (``run`` in this process)."""
    judge = _full(MODEL)
    solution = SOLUTIONS["ex4_cost_model"]
    for seed in PROPERTY_SEEDS:
        inputs = _inputs(MODEL, seed)
        wrongs = {}
        for name, m in MODEL_MISTAKES.items():
            wrongs[name] = _run_model(m.source, inputs)
            with pytest.raises(CheckFailed, match=re.escape(m.reason)):
                judge(inputs, wrongs[name])
        assert_verdicts(judge, seed, inputs, _run_model(solution, inputs), wrongs)


def test_property_the_kits_properties_alone_fail_the_formula_mistakes_they_can_see():
    """The kit has no formula: its properties fail a ring without 2(n - 1)/n, alpha paid
    once, a server costed like a ring, and fits that are not the least relative errors;
    the server's one-way cost keeps every property (only the grader's formula sees it)."""
    seen = ["typical", "alpha once", "server like a ring", "fit without the factor"]
    seen += ["fit absolute errors"]
    for seed in PROPERTY_SEEDS:
        inputs = EXERCISES[MODEL].make_inputs(_gen(seed))
        wrongs = {name: _run_model(MODEL_MISTAKES[name].source, inputs) for name in seen}
        right = _run_model(SOLUTIONS["ex4_cost_model"], inputs)
        assert_verdicts(EXERCISES[MODEL].judge, seed, inputs, right, wrongs)
    one_way = _run_model(MODEL_MISTAKES["server one way"].source, inputs)
    EXERCISES[MODEL].judge(inputs, one_way)


def test_model_judge_says_one_rank_costs_nothing():
    inputs = _inputs(MODEL)
    outputs = _run_model(SOLUTIONS["ex4_cost_model"], inputs)
    outputs["server_time"][3]["times"] = outputs["server_time"][3]["times"] + 1e-6
    with pytest.raises(CheckFailed, match="server_time with one rank: there is no worker"):
        EXERCISES[MODEL].judge(inputs, outputs)
    outputs["ring_time"][0]["times"] = None
    with pytest.raises(CheckFailed, match="returned None"):
        _full(MODEL)(inputs, outputs)


def test_visible_model_check_passes_the_solution_and_explains_mistakes(capsys):
    ns = namespace(SOLUTIONS, ["ex4_cost_model"])
    checks.cost_model(ns["ring_time"], ns["server_time"], ns["fit_alpha_beta"])
    assert "exact times recovered, relative errors minimised" in capsys.readouterr().out
    for name, said in (
        ("typical", "the cost per byte does not grow with n"),
        ("alpha once", "the latency part does not grow with n"),
        ("server like a ring", "so it is at least 3/B"),
        ("fit absolute errors", "do not minimise the sum of squared relative"),
    ):
        wrong = namespace({"ex4_cost_model": MODEL_MISTAKES[name].source}, ["ex4_cost_model"])
        with pytest.raises(CheckFailed, match=re.escape(said)):
            checks.cost_model(wrong["ring_time"], wrong["server_time"], wrong["fit_alpha_beta"])


def test_visible_model_check_asks_to_finish_the_exercise_first():
    stub = namespace(RELEASED, ["ex4_cost_model"])
    with pytest.raises(CheckFailed, match=r"still raises? NotImplementedError: finish"):
        checks.cost_model(stub["ring_time"], stub["server_time"], stub["fit_alpha_beta"])


# --------------------------------------------------------------------------- the notebook's helpers


def _write(folder: Path, source: str) -> str:
    _, files = split_magics(source)
    ((name, text),) = files.items()
    (folder / name).write_text(text)
    return str(folder / name)


def test_demos_ask_for_the_unfinished_exercise_by_number(tmp_path, capsys):
    assert not checks.ready("ring.py", "ps.py", folder=tmp_path)
    assert "finish exercises 1 and 2 first: ring.py was not written" in capsys.readouterr().out
    _write(tmp_path, SOLUTIONS["ex1_ring_all_reduce"])
    _write(tmp_path, RELEASED["ex2_parameter_server"])
    assert not checks.ready("ring.py", "ps.py", folder=tmp_path)
    assert "finish exercise 2 first: ps.py still holds the stub" in capsys.readouterr().out
    _write(tmp_path, SOLUTIONS["ex2_parameter_server"])
    assert checks.ready("ring.py", "ps.py", folder=tmp_path)


def test_visible_distributed_checks_refuse_a_missing_file_or_a_stub_without_starting(tmp_path):
    with pytest.raises(CheckFailed, match="run the cell that starts with %%writefile ring.py"):
        checks.ring_all_reduce(str(tmp_path / "ring.py"))
    for cell, check in (
        ("ex1_ring_all_reduce", checks.ring_all_reduce),
        ("ex2_parameter_server", checks.parameter_server),
        ("ex3_stale_server", checks.stale_parameter_server),
    ):
        with pytest.raises(CheckFailed, match="finish this exercise first"):
            check(_write(tmp_path, RELEASED[cell]))


def test_distributed_visible_checks_defer_to_the_grader_under_autograde(monkeypatch, capsys):
    monkeypatch.setenv("NBGRADER_EXECUTION", "autograde")
    checks.ring_all_reduce("no-such-folder/ring.py")  # no torchrun job: the verdict decides
    checks.parameter_server("no-such-folder/ps.py")
    checks.stale_parameter_server("no-such-folder/ps_stale.py")
    assert capsys.readouterr().out.count("run by the grader outside this kernel") == 3


def test_figures_draw_every_concept():
    from ddp_lab.figures import lab02 as figures

    ns = namespace(SOLUTIONS, ["ex4_cost_model"])
    assert [list(step) for step in figures.RING_3] == ring_schedule(3)
    assert len(figures.ring_steps(4, schedule=ring_schedule(4)).axes) == 7
    fig = figures.model_scaling(ns["ring_time"], server_fn=ns["server_time"])
    assert len(fig.axes[0].lines) == 6
    assert figures.staleness_curves({"0": [1.0, 0.1], "1": [1.0, 0.5]}).axes
    run = {"sizes": [2**16, 2**22], "seconds": {"ring": [1e-4, 3e-3], "server": [2e-4, 9e-3]}}
    assert len(figures.ring_vs_server({"2": run, "3": run}).axes) == 2


# --------------------------------------------------------------------------- real processes


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_visible_checks_pass_the_solutions(tmp_path, capsys):
    checks.ring_all_reduce(_write(tmp_path, SOLUTIONS["ex1_ring_all_reduce"]))
    checks.parameter_server(_write(tmp_path, SOLUTIONS["ex2_parameter_server"]))
    checks.stale_parameter_server(_write(tmp_path, SOLUTIONS["ex3_stale_server"]))
    out = capsys.readouterr().out
    assert "OK: ring_all_reduce() from ring.py on 2 and 3 ranks equals dist.all_reduce" in out
    assert "tensors of 1, 2, 3, 7, 10 and 3x5 elements" in out
    assert "OK: parameter_server on 2 and 3 ranks" in out
    assert "OK: stale_parameter_server (staleness 1 and 2) on 2 and 3 ranks" in out


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    "source, check, message",
    [
        (mistakes.RING_WRONG_NEIGHBOUR, "ring_all_reduce", r"sent to rank\(s\) \[2\]"),
        (mistakes.RING_CALLS_ALL_REDUCE, "ring_all_reduce", r"all_reduce is not allowed.*line"),
        (mistakes.PS_NEVER_PULLS, "parameter_server", "the workers never pulled"),
        (mistakes.STALE_OFF_BY_ONE, "stale_parameter_server", "more than the staleness bound"),
    ],
    ids=["ring-wrong-neighbour", "ring-calls-all-reduce", "ps-never-pulls", "stale-off-by-one"],
)
def test_visible_checks_explain_mistakes(tmp_path, source, check, message):
    with pytest.raises(CheckFailed, match=message):
        getattr(checks, check)(_write(tmp_path, source))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_visible_check_stops_a_deadlocked_ring_and_says_why(tmp_path, monkeypatch):
    marker = own_tmpdir(monkeypatch, tmp_path)
    before = set(os.listdir("/proc"))
    with pytest.raises(CheckFailed, match=r"did not return within 15 s on rank \d of \d.*isend"):
        checks.ring_all_reduce(_write(tmp_path, mistakes.RING_RECV_FIRST))
    assert not new_leftovers(before, marker)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_visible_check_job_timeout_stops_a_hang_before_the_watchdog(tmp_path, monkeypatch):
    short = [
        dataclasses.replace(ex, timeout=8) if ex.grade_id == RING else ex for ex in checks.EXERCISES
    ]
    monkeypatch.setattr(checks, "EXERCISES", short)
    marker = own_tmpdir(monkeypatch, tmp_path)
    before = set(os.listdir("/proc"))
    with pytest.raises(CheckFailed, match="did not finish within 8 s on 3 ranks.*recv before"):
        checks.ring_all_reduce(_write(tmp_path, mistakes.RING_RECV_FIRST))
    assert not new_leftovers(before, marker)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_grader_stops_a_deadlocked_ring_says_why_and_leaves_no_process(tmp_path, monkeypatch):
    marker = own_tmpdir(monkeypatch, tmp_path)
    before = set(os.listdir("/proc"))
    nb = notebook_with(LAB, mistakes.HANGS)
    v = judge_notebook(nb, LAB, [RING])[RING]
    assert not v.passed
    assert "did not return within 15 s" in v.message and "isend" in v.message, v.message
    assert v.seconds < 60, "the watchdog, not the exercise's timeout, should stop it"
    assert not new_leftovers(before, marker)
    assert mistakes.HANG_LOSES == [RING]
