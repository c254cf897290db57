"""Lab 2's checks, tested directly: the reference passes every judge (the kit's and the
grader's), each typical mistake fails its own with a message that says why, the verdict does
not depend on the draw, and the visible checks pass the solutions, explain mistakes and ask
for unfinished exercises.

Fast tests call the judges in this process on outputs built here (the ring is simulated from
the reference's schedule); the tests marked slow start real torchrun jobs, through the grader
(``judge_notebook``) and through the visible checks. Every typical mistake also goes through
the grader in ``tests/test_mistakes.py``.
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
    released_sources,
    solution_sources,
)

from ddp_lab.answers import full_judge, hidden
from ddp_lab.answers.lab02 import mistakes
from ddp_lab.answers.lab02.references import ring_allreduce_time, ring_schedule
from ddp_lab.checks import guards
from ddp_lab.checks import lab02 as checks
from ddp_lab.checks.contract import exercises
from ddp_lab.checks.failure import CheckFailed
from ddp_lab.checks.lab02 import common
from ddp_lab.checks.runner import namespace, split_magics
from ddp_lab.grading.verdict import judge_notebook
from ddp_lab.launch.messages import student_problem

LAB = "lab02_collectives"
EXERCISES = exercises(LAB)
HIDDEN = hidden(LAB)
SOLUTIONS = solution_sources(LAB)
RELEASED = released_sources(LAB)
RING, SERVER = "test_ex1_ring_all_reduce", "test_ex2_parameter_server"
TIME, FIT = "test_ex3_ring_time", "test_ex4_fit_alpha_beta"
PROPERTY_SEEDS = range(200)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _inputs(grade_id: str, seed: int = 0) -> dict:
    """The inputs the grader draws: the hidden part's own draw where it has one."""
    extra = HIDDEN.get(grade_id)
    make = extra.inputs if extra and extra.inputs else EXERCISES[grade_id].make_inputs
    return make(_gen(seed))


def _full(grade_id: str):
    return full_judge(EXERCISES[grade_id], HIDDEN.get(grade_id))


def _function(source: str, name: str):
    return namespace({"cell": source}, ["cell"])[name]


def _as_judged(outputs):
    """Outputs as the judge loads them (``torch.save`` then ``weights_only`` load)."""
    buf = io.BytesIO()
    torch.save(outputs, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _run(grade_id: str, source: str, inputs: dict) -> dict:
    cell = grade_id.removeprefix("test_")
    ns = namespace({cell: source}, [cell])
    return _as_judged(EXERCISES[grade_id].run(ns, inputs, Path(".")))


# --------------------------------------------------------------------------- the ring, simulated


def simulated_ring(xs: list[torch.Tensor], skip_last_reduce_step: bool = False) -> list:
    """Every rank's tensor after a ring all-reduce, computed in one process from the schedule."""
    n = len(xs)
    chunks = [list(torch.tensor_split(x.clone().view(-1), n)) for x in xs]
    steps = ring_schedule(n)
    if skip_last_reduce_step:
        del steps[n - 2]
    for k, step in enumerate(steps):
        reduce = k < len(steps) - (n - 1)
        sent = [(dst, c, chunks[src][c].clone()) for src, dst, c in step]
        for dst, c, value in sent:
            if reduce:
                chunks[dst][c] += value
            else:
                chunks[dst][c].copy_(value)
    return [torch.cat(c).view(x.shape) for c, x in zip(chunks, xs, strict=True)]


def _parameter_server(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every rank's tensor after the solution's server: rank 0 adds in order, divides, sends."""
    total = xs[0].clone()
    for x in xs[1:]:
        total += x
    total /= len(xs)
    return [total.clone() for _ in xs]


def _none(xs):
    return [None] * len(xs)


def _outputs(inputs: dict, per_case) -> dict:
    """Judge outputs: ``per_case(xs_of_one_tensor) -> (afters, returns)`` for every tensor."""
    cases = []
    for case in inputs["cases"]:
        n = case["world_size"]
        ranks = [[] for _ in range(n)]
        for j in range(len(case["data"][0])):
            afters, returns = per_case([case["data"][r][j] for r in range(n)])
            for r in range(n):
                ranks[r].append({"after": afters[r], "returned": returns[r]})
        cases.append(ranks)
    return {"cases": cases}


def _judge(grade_id: str, outputs_of, full: bool = False) -> str:
    inputs = _inputs(grade_id, 3)
    judge = _full(grade_id) if full else EXERCISES[grade_id].judge
    return judge(inputs, _outputs(inputs, outputs_of))


#: grade id -> (what a right answer leaves on every rank, {typical mistake: what it leaves})
COLLECTIVE_OUTPUTS = {
    RING: (
        lambda xs: (simulated_ring(xs), _none(xs)),
        {
            "skips a step": lambda xs: (simulated_ring(xs, skip_last_reduce_step=True), _none(xs)),
            "average": lambda xs: ([torch.stack(xs).mean(0) for _ in xs], _none(xs)),
            "returned only": lambda xs: (
                [x.clone() for x in xs],
                [torch.stack(xs).sum(0) for _ in xs],
            ),
        },
    ),
    SERVER: (
        lambda xs: (_parameter_server(xs), _none(xs)),
        {
            "sum": lambda xs: ([torch.stack(xs).sum(0) for _ in xs], _none(xs)),
            "server only": lambda xs: (
                _parameter_server(xs)[:1] + [x.clone() for x in xs[1:]],
                _none(xs),
            ),
        },
    ),
}


# --------------------------------------------------------------------------- the case sets


def test_ring_inputs_cover_short_and_indivisible_lengths_on_2_and_3_ranks():
    inputs = _inputs(RING)
    assert [c["world_size"] for c in inputs["cases"]] == [2, 3]
    for case in inputs["cases"]:
        n = case["world_size"]
        numels = [t.numel() for t in case["data"][0]]
        assert any(k < n for k in numels), "a tensor shorter than the world size"
        assert sum(k % n != 0 for k in numels) >= 3, "lengths the world size does not divide"
        assert any(t.dim() == 2 for t in case["data"][0])
        assert {t.dtype for t in case["data"][0]} == {torch.float32, torch.float64}
    assert [c["world_size"] for c in _inputs(SERVER)["cases"]] == [3]


def test_visible_collective_inputs_are_the_3_rank_shapes_of_the_test_cells():
    for gid in (RING, SERVER):
        make = EXERCISES[gid].visible_inputs
        (case,) = make(_gen())["cases"]
        assert case["world_size"] == 3
        assert [tuple(t.shape) for t in case["data"][0]] == common.VISIBLE_SHAPES
        assert str(make(_gen(1))) == str(make(_gen(2))), "the visible inputs are fixed"


def test_inputs_are_fresh_for_every_seed():
    for gid in EXERCISES:
        assert str(_inputs(gid, 1)) != str(_inputs(gid, 2)), f"{gid}: same inputs every seed"
        a, b = EXERCISES[gid].make_inputs(_gen(1)), EXERCISES[gid].make_inputs(_gen(2))
        assert str(a) != str(b), f"{gid}: the kit draws the same inputs every seed"


def test_the_exercises_are_independent():
    for gid, ex in EXERCISES.items():
        assert ex.cells == (gid.removeprefix("test_"),), f"{gid} runs other exercises' cells"


def test_model_cases_use_more_than_two_ranks_so_the_factor_matters():
    assert all(case["n"] >= 3 for case in _inputs(FIT)["cases"])
    worlds = [case["n"] for case in _inputs(TIME)["cases"]]
    assert worlds[0] >= 3 and worlds[1] == 2 and worlds[2] >= 3 and worlds[3] == 1
    assert _inputs(TIME)["cases"][2]["sizes"].numel() == 1, "one size, passed as a number"


def test_collective_exercises_refuse_every_built_in_collective():
    for gid in (RING, SERVER):
        assert EXERCISES[gid].forbid == guards.COLLECTIVES
    for name in ("all_reduce", "broadcast", "reduce_scatter", "all_gather_single", "gather"):
        assert name not in dir(dist) or name in guards.COLLECTIVES, name
    assert not {"send", "recv", "isend", "irecv"} & set(guards.COLLECTIVES)


# --------------------------------------------------------------------------- collective judges


def test_ring_judge_passes_the_sum_on_every_rank():
    message = _judge(RING, COLLECTIVE_OUTPUTS[RING][0])
    assert "2 and 3 ranks equals dist.all_reduce" in message
    assert "ring_all_reduce" in _judge(RING, COLLECTIVE_OUTPUTS[RING][0], full=True)


def test_ring_that_skips_a_step_is_told_its_wrong_chunks_and_by_the_grader_the_schedule():
    skips = COLLECTIVE_OUTPUTS[RING][1]["skips a step"]
    with pytest.raises(CheckFailed, match=r"wrong in chunk\(s\) \[.*misses rank") as kit:
        _judge(RING, skips)
    assert "(r - s) % n" not in str(kit.value), "the schedule is the grader's hint"
    with pytest.raises(CheckFailed, match=r"wrong in chunk\(s\).*\(r - s\) % n.*skips a step"):
        _judge(RING, skips, full=True)


def test_ring_judge_explains_a_result_that_is_returned_but_not_written_in_place():
    with pytest.raises(CheckFailed, match="in place"):
        _judge(RING, COLLECTIVE_OUTPUTS[RING][1]["returned only"], full=True)


def test_ring_judge_fails_an_average():
    with pytest.raises(CheckFailed, match="must SUM"):
        _judge(RING, COLLECTIVE_OUTPUTS[RING][1]["average"], full=True)


def test_parameter_server_judge_passes_the_average_and_fails_the_sum():
    assert "3 ranks" in _judge(SERVER, COLLECTIVE_OUTPUTS[SERVER][0], full=True)
    with pytest.raises(CheckFailed, match="divide by the world size"):
        _judge(SERVER, COLLECTIVE_OUTPUTS[SERVER][1]["sum"], full=True)


def test_parameter_server_judge_names_a_server_that_does_not_send_back():
    with pytest.raises(CheckFailed, match="send the average back"):
        _judge(SERVER, COLLECTIVE_OUTPUTS[SERVER][1]["server only"], full=True)


def test_collective_judges_reject_malformed_outputs():
    inputs = _inputs(RING)
    judge = _full(RING)
    wrong_shape = _outputs(inputs, lambda xs: ([torch.zeros(2, 2) for _ in xs], _none(xs)))
    with pytest.raises(CheckFailed, match="shape"):
        judge(inputs, wrong_shape)
    with pytest.raises(CheckFailed, match="expected 2 runs"):
        judge(inputs, {"cases": []})
    with pytest.raises(CheckFailed, match="expected 7 results from each of 2 ranks"):
        judge(inputs, {"cases": [[[], []], [[], [], []]]})


@pytest.mark.parametrize("grade_id", list(COLLECTIVE_OUTPUTS))
def test_property_collective_verdicts_do_not_depend_on_the_draw(grade_id):
    """200 draws: the (simulated, input-dtype) right answer passes the grader's full judge,
    each typical mistake fails it, and fails the kit's oracle judge alone too."""
    right, wrongs = COLLECTIVE_OUTPUTS[grade_id]
    for judge in (_full(grade_id), EXERCISES[grade_id].judge):
        for seed in PROPERTY_SEEDS:
            inputs = _inputs(grade_id, seed)
            assert_verdicts(
                judge,
                seed,
                inputs,
                _outputs(inputs, right),
                {name: _outputs(inputs, wrong) for name, wrong in wrongs.items()},
            )


# --------------------------------------------------------------------------- the cost model

#: grade id -> {mistake: (source, what the grader says)}
NO_FACTOR = "the bandwidth term needs the factor 2(n - 1)/n"
MODEL_MISTAKES = {
    TIME: {
        "no factor": (mistakes.RING_TIME_NO_FACTOR, NO_FACTOR),
        "alpha once": (mistakes.RING_TIME_ALPHA_ONCE, "every one of the 2(n - 1) steps pays alpha"),
    },
    FIT: {
        "no factor": (mistakes.FIT_NO_FACTOR, NO_FACTOR),
        "absolute errors": (mistakes.FIT_ABSOLUTE, "you minimised absolute errors"),
    },
}


@pytest.mark.parametrize("grade_id", [TIME, FIT])
def test_property_model_verdicts_do_not_depend_on_the_draw(grade_id):
    """200 draws of the grader's inputs: the solution passes the full judge, each typical
    mistake fails it with its own diagnosis (``run`` in this process)."""
    judge = _full(grade_id)
    solution = SOLUTIONS[grade_id.removeprefix("test_")]
    for seed in PROPERTY_SEEDS:
        inputs = _inputs(grade_id, seed)
        wrongs = {}
        for name, (source, said) in MODEL_MISTAKES[grade_id].items():
            wrongs[name] = _run(grade_id, source, inputs)
            with pytest.raises(CheckFailed, match=re.escape(said)):
                judge(inputs, wrongs[name])
        assert_verdicts(judge, seed, inputs, _run(grade_id, solution, inputs), wrongs)


def test_property_ring_time_mistakes_break_the_kits_properties_on_every_draw():
    """The kit has no formula: its properties alone fail each typical mistake."""
    solution = SOLUTIONS["ex3_ring_time"]
    for seed in PROPERTY_SEEDS:
        inputs = _inputs(TIME, seed)
        wrongs = {name: _run(TIME, src, inputs) for name, (src, _) in MODEL_MISTAKES[TIME].items()}
        assert_verdicts(EXERCISES[TIME].judge, seed, inputs, _run(TIME, solution, inputs), wrongs)


def test_property_fit_units_hold_for_the_solution_on_the_kits_and_the_graders_inputs():
    """Order and units of the fit (the kit's judge without the model): the solution passes on
    any draw, a swapped pair and 1/B do not."""
    solution = SOLUTIONS["ex4_fit_alpha_beta"]
    swapped = solution.replace(
        "return float(alpha), float(1 / inverse_bandwidth)",
        "return float(1 / inverse_bandwidth), float(alpha)",
    )
    inverse = solution.replace("float(1 / inverse_bandwidth)", "float(inverse_bandwidth)")
    assert swapped != solution and inverse != solution
    for seed in PROPERTY_SEEDS:
        for inputs in (EXERCISES[FIT].make_inputs(_gen(seed)), _inputs(FIT, seed)):
            wrongs = {"swapped": _run(FIT, swapped, inputs), "1/B": _run(FIT, inverse, inputs)}
            right = _run(FIT, solution, inputs)
            assert_verdicts(EXERCISES[FIT].judge, seed, inputs, right, wrongs)


def test_ring_time_judge_says_one_rank_costs_nothing():
    inputs = _inputs(TIME)
    outputs = _run(TIME, SOLUTIONS["ex3_ring_time"], inputs)
    outputs["cases"][3]["times"] = outputs["cases"][3]["times"] + 1e-6
    with pytest.raises(CheckFailed, match="with one rank there is nothing to send"):
        EXERCISES[TIME].judge(inputs, outputs)
    outputs["cases"][0]["times"] = None
    with pytest.raises(CheckFailed, match="returned None"):
        _full(TIME)(inputs, outputs)


def test_the_reference_model_is_the_notebooks_formula():
    assert ring_allreduce_time(1e9, 4, 1e-5, 1e10) == pytest.approx(0.15006)
    ring_time = _function(SOLUTIONS["ex3_ring_time"], "ring_time")
    assert ring_time(1e9, 4, 1e-5, 1e10) == pytest.approx(0.15006)


# --------------------------------------------------------------------------- visible, in-process


def test_visible_model_checks_pass_the_solutions(capsys):
    ring_time = _function(SOLUTIONS["ex3_ring_time"], "ring_time")
    checks.ring_time(ring_time)
    checks.fit_alpha_beta(_function(SOLUTIONS["ex4_fit_alpha_beta"], "fit_alpha_beta"), ring_time)
    out = capsys.readouterr().out
    assert out.count("OK: ") == 2
    assert "exact times recovered; relative errors minimised" in out


@pytest.mark.parametrize(
    "name, source, message",
    [
        ("ring_time", mistakes.RING_TIME_NO_FACTOR, "the cost per byte does not grow with n"),
        ("ring_time", mistakes.RING_TIME_ALPHA_ONCE, "the latency part does not grow with n"),
        ("fit_alpha_beta", mistakes.FIT_NO_FACTOR, "times made exactly by your ring_time"),
        ("fit_alpha_beta", mistakes.FIT_ABSOLUTE, "do not minimise the sum of squared relative"),
    ],
    ids=["time-no-factor", "time-alpha-once", "fit-no-factor", "fit-absolute"],
)
def test_visible_model_checks_fail_mistakes_with_a_helpful_message(name, source, message):
    ring_time = _function(SOLUTIONS["ex3_ring_time"], "ring_time")
    with pytest.raises(CheckFailed, match=message):
        if name == "ring_time":
            checks.ring_time(_function(source, name))
        else:
            checks.fit_alpha_beta(_function(source, name), ring_time)


def test_visible_model_checks_ask_to_finish_the_exercise_first():
    ring_time = _function(SOLUTIONS["ex3_ring_time"], "ring_time")
    stub_time = _function(RELEASED["ex3_ring_time"], "ring_time")
    stub_fit = _function(RELEASED["ex4_fit_alpha_beta"], "fit_alpha_beta")
    with pytest.raises(CheckFailed, match="ring_time still raises NotImplementedError: finish"):
        checks.ring_time(stub_time)
    with pytest.raises(CheckFailed, match="fit_alpha_beta still raises NotImplementedError"):
        checks.fit_alpha_beta(stub_fit, ring_time)
    fit = _function(SOLUTIONS["ex4_fit_alpha_beta"], "fit_alpha_beta")
    with pytest.raises(CheckFailed, match="finish exercise 3 first"):
        checks.fit_alpha_beta(fit, stub_time)
    wrong_time = _function(mistakes.RING_TIME_NO_FACTOR, "ring_time")
    with pytest.raises(CheckFailed, match="fails its own check.*fix exercise 3 first"):
        checks.fit_alpha_beta(fit, wrong_time)


def test_visible_collective_checks_refuse_a_missing_file_or_a_stub_without_starting(tmp_path):
    with pytest.raises(CheckFailed, match="run the cell that starts with %%writefile ring.py"):
        checks.ring_all_reduce(str(tmp_path / "ring.py"))
    for cell, check in (
        ("ex1_ring_all_reduce", checks.ring_all_reduce),
        ("ex2_parameter_server", checks.parameter_server_average),
    ):
        with pytest.raises(CheckFailed, match="finish this exercise first"):
            check(_write(tmp_path, RELEASED[cell]))


def test_distributed_visible_checks_defer_to_the_grader_under_autograde(monkeypatch, capsys):
    monkeypatch.setenv("NBGRADER_EXECUTION", "autograde")
    checks.ring_all_reduce("no-such-folder/ring.py")  # no torchrun job: the verdict decides
    checks.parameter_server_average("no-such-folder/ps.py")
    assert capsys.readouterr().out.count("run by the grader outside this kernel") == 2


def test_a_failed_rank_is_quoted_with_the_students_error_and_line():
    class Result:
        logs = {
            -1: "agent",
            0: 'Traceback...\n  File "/x/ring.py", line 17, in ring_all_reduce\n'
            "[rank0]: NotImplementedError\n",
            1: "",
        }

    class Err(Exception):
        result = Result()

    text = student_problem(Err("boom"), "ring.py")
    assert text == "ring.py failed on rank 0: NotImplementedError (ring.py line 17)"


def test_figures_draw_every_concept_from_the_students_functions():
    import numpy as np

    from ddp_lab.figures import lab02 as figures

    tour = {
        "world_size": 3,
        "ranks": [
            {
                "before": [10.0 * r, 10.0 * r + 1, 10.0 * r + 2],
                "after": {
                    "broadcast": [0.0, 1.0, 2.0],
                    "all_reduce": [30.0, 33.0, 36.0],
                    "all_gather": [0.0, 1, 2, 10, 11, 12, 20, 21, 22],
                    "reduce_scatter": [30.0 + 3 * r],
                    "all_reduce, group [0, 1]": [10.0, 12, 14] if r < 2 else [20.0, 21, 22],
                },
            }
            for r in range(3)
        ],
    }
    assert len(figures.collectives(tour).axes) == 4
    assert len(figures.collectives(tour, ["all_reduce, group [0, 1]"]).axes) == 1
    # the picture's fixed 3-rank schedule is the ring's; other sizes need a schedule
    assert [list(step) for step in figures.RING_3] == ring_schedule(3)
    assert len(figures.ring_steps(3).axes) == 5
    assert len(figures.ring_steps(4, schedule=ring_schedule(4)).axes) == 7
    with pytest.raises(ValueError, match="schedule="):
        figures.ring_steps(4)
    ring_time = _function(SOLUTIONS["ex3_ring_time"], "ring_time")
    sizes = np.array([256.0, 4096.0, 65536.0])
    seconds = ring_time(sizes, 2, 5e-5, 1e9)
    for alpha, bandwidth in [(5e-5, 1e9), (-1e-5, float("inf"))]:
        fig = figures.bandwidth_sweep(sizes, seconds, 2, alpha, bandwidth, time_fn=ring_time)
        assert len(fig.axes) == 2
    assert figures.model_scaling(ring_time).axes and figures.busiest_link().axes
    assert figures.send_recv_order().axes


# --------------------------------------------------------------------------- real processes


def _write(tmp_path: Path, source: str) -> str:
    _, files = split_magics(source)
    ((name, text),) = files.items()
    (tmp_path / name).write_text(text)
    return str(tmp_path / name)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_visible_checks_pass_the_solutions(tmp_path, capsys):
    checks.ring_all_reduce(_write(tmp_path, SOLUTIONS["ex1_ring_all_reduce"]))
    checks.parameter_server_average(_write(tmp_path, SOLUTIONS["ex2_parameter_server"]))
    out = capsys.readouterr().out
    assert "OK: ring_all_reduce() from ring.py on 3 ranks equals dist.all_reduce" in out
    assert "OK: parameter_server_average() from ps.py on 3 ranks equals" in out
    assert "tensors of 1, 2, 3, 7, 10 and 3x5 elements" in out


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "source, check, message",
    [
        (mistakes.RING_SKIPS_A_STEP, "ring_all_reduce", r"rank \d is wrong in chunk\(s\).*misses"),
        (mistakes.RING_CALLS_ALL_REDUCE, "ring_all_reduce", r"all_reduce is not allowed.*line"),
        (mistakes.RING_IMPORTS_THE_ANSWER, "ring_all_reduce", "uses ddp_lab.answers"),
        (mistakes.PS_FORGETS_TO_DIVIDE, "parameter_server_average", "not the average"),
    ],
    ids=["ring-skips-a-step", "ring-calls-all-reduce", "ring-imports-the-answer", "ps-sum"],
)
def test_visible_checks_explain_mistakes(tmp_path, source, check, message):
    with pytest.raises(CheckFailed, match=message):
        getattr(checks, check)(_write(tmp_path, source))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_visible_check_stops_a_deadlocked_ring_and_says_why(tmp_path):
    before = set(os.listdir("/proc"))
    with pytest.raises(CheckFailed, match=r"did not return within 15 s on rank \d of 3.*isend"):
        checks.ring_all_reduce(_write(tmp_path, mistakes.RING_RECV_FIRST))
    assert not new_leftovers(before, "ddp_lab.checks.rank_worker")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_visible_check_job_timeout_stops_a_hang_before_the_watchdog(tmp_path, monkeypatch):
    short = [
        dataclasses.replace(ex, timeout=8) if ex.grade_id == RING else ex for ex in checks.EXERCISES
    ]
    monkeypatch.setattr(checks, "EXERCISES", short)
    before = set(os.listdir("/proc"))
    with pytest.raises(CheckFailed, match="did not finish within 8 s on 3 ranks.*recv before"):
        checks.ring_all_reduce(_write(tmp_path, mistakes.RING_RECV_FIRST))
    assert not new_leftovers(before, "ddp_lab.checks.rank_worker")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_grader_stops_a_deadlocked_ring_says_why_and_leaves_no_process():
    before = set(os.listdir("/proc"))
    nb = notebook_with(LAB, mistakes.HANGS)
    v = judge_notebook(nb, LAB, [RING])[RING]
    assert not v.passed
    assert "did not return within 15 s" in v.message and "isend" in v.message, v.message
    assert v.seconds < 60, "the watchdog, not the exercise's timeout, should stop it"
    assert not new_leftovers(before, "ddp_lab.checks.rank_worker")
    assert mistakes.HANG_LOSES == [RING]
