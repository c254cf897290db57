"""Lab 2's checks, tested directly: the reference passes every judge, each typical mistake
fails its own, and the visible checks raise ``CheckFailed`` with messages that say why.

Fast tests call the judges in this process on outputs built here (the ring is simulated from
``ring_schedule``); the tests marked slow start real torchrun jobs, through the grader
(``judge_notebook``) and through the visible checks.
"""

from __future__ import annotations

from pathlib import Path

import mistakes_lab02 as mistakes
import pytest
import torch
import torch.distributed as dist

from ddp_lab import collectives
from ddp_lab.checks import CheckFailed, launch_problem
from ddp_lab.checks import lab02 as checks
from ddp_lab.grading.exercise import exercises
from ddp_lab.grading.notebook import load, nbgrader_meta, solution_sources, split_magics
from ddp_lab.grading.verdict import judge_notebook

ROOT = Path(__file__).resolve().parent.parent
LAB = "lab02_collectives"
NOTEBOOK = ROOT / "solutions" / LAB / f"{LAB}.ipynb"
EXERCISES = exercises(LAB)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _namespace(source: str) -> dict:
    code, files = split_magics(source)
    assert not files, "a %%writefile cell"
    ns: dict = {"__name__": "__student__"}
    exec(compile(code, "<cell>", "exec"), ns)  # noqa: S102 - our own reference and mistakes
    return ns


def _solution(grade_id: str) -> str:
    return solution_sources(load(NOTEBOOK))[grade_id]


# --------------------------------------------------------------------------- the ring, simulated


def simulated_ring(xs: list[torch.Tensor], skip_last_reduce_step: bool = False) -> list:
    """Every rank's tensor after a ring all-reduce, computed in one process from the schedule."""
    n = len(xs)
    chunks = [list(torch.tensor_split(x.clone().view(-1), n)) for x in xs]
    steps = collectives.ring_schedule(n)
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


def _outputs(inputs: dict, per_case) -> dict:
    """Judge outputs: ``per_case(xs_of_one_tensor) -> (afters, returns)`` for every tensor."""
    cases = []
    for case in inputs["cases"]:
        n = case["world_size"]
        ranks = [[] for _ in range(n)]
        for j in range(len(case["data"][0])):
            xs = [case["data"][r][j] for r in range(n)]
            afters, returns = per_case(xs)
            for r in range(n):
                ranks[r].append({"after": afters[r], "returned": returns[r]})
        cases.append(ranks)
    return {"cases": cases}


def _judge(grade_id: str, outputs_of) -> str:
    ex = EXERCISES[grade_id]
    inputs = ex.make_inputs(_gen(3))
    return ex.judge(inputs, _outputs(inputs, outputs_of))


def test_ring_inputs_cover_short_and_indivisible_lengths_on_2_and_3_ranks():
    inputs = EXERCISES["test_ex1_ring_all_reduce"].make_inputs(_gen())
    assert [c["world_size"] for c in inputs["cases"]] == [2, 3]
    for case in inputs["cases"]:
        n = case["world_size"]
        numels = [t.numel() for t in case["data"][0]]
        assert any(k < n for k in numels), "a tensor shorter than the world size"
        assert sum(k % n != 0 for k in numels) >= 3, "lengths the world size does not divide"
        assert any(t.dim() == 2 for t in case["data"][0])
        assert {t.dtype for t in case["data"][0]} == {torch.float32, torch.float64}


def test_inputs_are_fresh_for_every_seed():
    for ex in EXERCISES.values():
        a, b = ex.make_inputs(_gen(1)), ex.make_inputs(_gen(2))
        assert str(a) != str(b), f"{ex.grade_id} draws the same inputs for every seed"


def test_the_exercises_are_independent():
    for gid, ex in EXERCISES.items():
        assert ex.cells == (gid.removeprefix("test_"),), f"{gid} runs other exercises' cells"


def test_ring_judge_passes_the_sum_on_every_rank():
    message = _judge("test_ex1_ring_all_reduce", lambda xs: (simulated_ring(xs), [None] * len(xs)))
    assert "2 ranks" in message and "3 ranks" in message


def test_ring_judge_fails_a_ring_that_skips_a_step_and_names_the_chunks():
    with pytest.raises(CheckFailed, match=r"chunk\(s\) \[.*skips a step"):
        _judge(
            "test_ex1_ring_all_reduce",
            lambda xs: (simulated_ring(xs, skip_last_reduce_step=True), [None] * len(xs)),
        )


def test_ring_judge_explains_a_result_that_is_returned_but_not_written_in_place():
    def returned_only(xs):
        total = torch.stack(xs).sum(0)
        return [x.clone() for x in xs], [total.clone() for _ in xs]

    with pytest.raises(CheckFailed, match="in place"):
        _judge("test_ex1_ring_all_reduce", returned_only)


def test_ring_judge_fails_an_average():
    def average(xs):
        return [torch.stack(xs).mean(0) for _ in xs], [None] * len(xs)

    with pytest.raises(CheckFailed, match="must SUM"):
        _judge("test_ex1_ring_all_reduce", average)


def test_parameter_server_judge_passes_the_average_and_fails_the_sum():
    def mean(xs):
        return [torch.stack(xs).sum(0) / len(xs) for _ in xs], [None] * len(xs)

    def total(xs):
        return [torch.stack(xs).sum(0) for _ in xs], [None] * len(xs)

    assert "3 ranks" in _judge("test_ex2_parameter_server", mean)
    with pytest.raises(CheckFailed, match="divide by the world size"):
        _judge("test_ex2_parameter_server", total)


def test_parameter_server_judge_names_a_server_that_does_not_send_back():
    def server_only(xs):
        mean = torch.stack(xs).sum(0) / len(xs)
        return [mean] + [x.clone() for x in xs[1:]], [None] * len(xs)

    with pytest.raises(CheckFailed, match="send the average back"):
        _judge("test_ex2_parameter_server", server_only)


def test_collective_judges_reject_malformed_outputs():
    ex = EXERCISES["test_ex1_ring_all_reduce"]
    inputs = ex.make_inputs(_gen())
    wrong_shape = _outputs(inputs, lambda xs: ([torch.zeros(2, 2) for _ in xs], [None] * len(xs)))
    with pytest.raises(CheckFailed, match="shape"):
        ex.judge(inputs, wrong_shape)
    with pytest.raises(CheckFailed, match="expected 2 runs"):
        ex.judge(inputs, {"cases": []})


# --------------------------------------------------------------------------- the cost model


def _run_and_judge(grade_id: str, source: str, seed: int = 0) -> str:
    ex = EXERCISES[grade_id]
    inputs = ex.make_inputs(_gen(seed))
    outputs = ex.run(_namespace(source), inputs, Path("."))
    outputs = torch.load(_roundtrip(outputs), weights_only=True)  # as the judge loads them
    return ex.judge(inputs, outputs)


def _roundtrip(obj):
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


@pytest.mark.parametrize("seed", range(5))
def test_reference_passes_the_model_judges(seed):
    assert "alpha-beta" in _run_and_judge("test_ex3_ring_time", _solution("ex3_ring_time"), seed)
    message = _run_and_judge("test_ex4_fit_alpha_beta", _solution("ex4_fit_alpha_beta"), seed)
    assert "recovers" in message


@pytest.mark.parametrize("seed", range(5))
def test_model_mistakes_fail_their_judges_with_a_hint(seed):
    with pytest.raises(CheckFailed, match=r"factor 2\(n - 1\)/n"):
        _run_and_judge("test_ex3_ring_time", mistakes.RING_TIME_NO_FACTOR, seed)
    with pytest.raises(CheckFailed, match=r"factor 2\(n - 1\)/n"):
        _run_and_judge("test_ex4_fit_alpha_beta", mistakes.FIT_NO_FACTOR, seed)
    with pytest.raises(CheckFailed, match="absolute errors"):
        _run_and_judge("test_ex4_fit_alpha_beta", mistakes.FIT_ABSOLUTE, seed)


def test_fit_judge_uses_more_than_two_ranks_so_the_factor_matters():
    inputs = EXERCISES["test_ex4_fit_alpha_beta"].make_inputs(_gen())
    assert all(case["n"] >= 3 for case in inputs["cases"])
    time_inputs = EXERCISES["test_ex3_ring_time"].make_inputs(_gen())
    assert any(case["n"] >= 3 for case in time_inputs["cases"])


def test_visible_model_checks_pass_the_reference(capsys):
    checks.ring_time(_namespace(_solution("ex3_ring_time"))["ring_time"])
    checks.fit_alpha_beta(_namespace(_solution("ex4_fit_alpha_beta"))["fit_alpha_beta"])
    out = capsys.readouterr().out
    assert out.count("OK: ") == 2


@pytest.mark.parametrize(
    "name, source, hint",
    [
        ("ring_time", mistakes.RING_TIME_NO_FACTOR, r"factor 2\(n - 1\)/n"),
        ("fit_alpha_beta", mistakes.FIT_NO_FACTOR, r"factor 2\(n - 1\)/n"),
        ("fit_alpha_beta", mistakes.FIT_ABSOLUTE, "absolute errors"),
    ],
)
def test_visible_model_checks_fail_mistakes_with_a_hint(name, source, hint):
    with pytest.raises(CheckFailed, match=hint):
        getattr(checks, name)(_namespace(source)[name])


def test_visible_model_checks_refuse_the_reference_implementation():
    with pytest.raises(RuntimeError, match="grader's reference"):
        checks.ring_time(collectives.ring_allreduce_time)
    assert collectives.ring_allreduce_time(1e9, 4, 1e-5, 1e10) == pytest.approx(0.15006)


def test_own_code_only_refuses_collectives_and_references_then_restores_them():
    import torch.distributed.distributed_c10d as c10d

    original = dist.all_reduce
    with checks.own_code_only(checks.COLLECTIVES):
        for fn in (dist.all_reduce, c10d.all_reduce, dist.broadcast, dist.reduce_scatter):
            with pytest.raises(RuntimeError, match="not allowed in this exercise"):
                fn(torch.zeros(1))
        with pytest.raises(RuntimeError, match="grader's reference"):
            collectives.ring_all_reduce(torch.zeros(1))
    assert dist.all_reduce is original and c10d.all_reduce is original
    x = torch.ones(2)
    assert collectives.ring_all_reduce(x) is x  # one process: the reference works again
    assert "send" not in checks.COLLECTIVES and "all_reduce" in checks.COLLECTIVES


# --------------------------------------------------------------------------- real processes


def _notebook_with(sources: dict[str, str]) -> dict:
    nb = load(NOTEBOOK)
    for cell in nb["cells"]:
        gid = nbgrader_meta(cell).get("grade_id")
        if gid in sources:
            cell["source"] = sources[gid]
    return nb


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_grader_fails_each_typical_mistake_with_its_reason():
    verdicts = judge_notebook(_notebook_with(mistakes.MISTAKES), LAB)
    reasons = {
        "test_ex1_ring_all_reduce": "skips a step",
        "test_ex2_parameter_server": "divide by the world size",
        "test_ex3_ring_time": "2(n - 1)/n",
        "test_ex4_fit_alpha_beta": "2(n - 1)/n",
    }
    for gid, reason in reasons.items():
        assert not verdicts[gid].passed, str(verdicts[gid])
        assert reason in verdicts[gid].message, str(verdicts[gid])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_grader_refuses_built_in_collectives():
    nb = _notebook_with({"ex1_ring_all_reduce": mistakes.RING_CALLS_ALL_REDUCE})
    v = judge_notebook(nb, LAB, ["test_ex1_ring_all_reduce"])["test_ex1_ring_all_reduce"]
    assert not v.passed
    assert "torch.distributed.all_reduce is not allowed" in v.message, v.message


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_grader_refuses_solutions_that_use_the_reference():
    sources = {
        "ex1_ring_all_reduce": mistakes.RING_IMPORTS_REFERENCE,
        "ex3_ring_time": "import ddp_lab.collectives as c\n\n\n"
        "def ring_time(size_bytes, world_size, alpha, bandwidth):\n"
        "    return c.ring_allreduce_time(size_bytes, world_size, alpha, bandwidth)\n",
    }
    verdicts = judge_notebook(_notebook_with(sources), LAB, [f"test_{g}" for g in sources])
    for v in verdicts.values():
        assert not v.passed and "ddp_lab.collectives" in v.message, str(v)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_grader_stops_a_deadlocked_ring_and_says_why():
    nb = _notebook_with({"ex1_ring_all_reduce": mistakes.RING_RECV_FIRST})
    v = judge_notebook(nb, LAB, ["test_ex1_ring_all_reduce"])["test_ex1_ring_all_reduce"]
    assert not v.passed
    assert "did not return within 15 s" in v.message and "isend" in v.message, v.message
    assert v.seconds < 60, "the watchdog, not the exercise's timeout, should stop it"


def _write(tmp_path: Path, source: str) -> str:
    _, files = split_magics(source)
    ((name, text),) = files.items()
    (tmp_path / name).write_text(text)
    return str(tmp_path / name)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_visible_checks_pass_the_solutions(tmp_path, capsys):
    checks.ring_all_reduce(_write(tmp_path, _solution("ex1_ring_all_reduce")))
    checks.parameter_server_average(_write(tmp_path, _solution("ex2_parameter_server")))
    out = capsys.readouterr().out
    assert "OK: ring_all_reduce() from ring.py on 3 ranks equals dist.all_reduce" in out
    assert "OK: parameter_server_average() from ps.py on 3 ranks" in out


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "source, check, message",
    [
        (mistakes.RING_SKIPS_A_STEP, "ring_all_reduce", r"rank \d is wrong in chunk\(s\)"),
        (mistakes.RING_CALLS_ALL_REDUCE, "ring_all_reduce", r"all_reduce is not allowed.*line"),
        (mistakes.RING_IMPORTS_REFERENCE, "ring_all_reduce", "grader's reference"),
        (mistakes.PS_FORGETS_TO_DIVIDE, "parameter_server_average", "not the average"),
    ],
    ids=["ring-skips-a-step", "ring-calls-all-reduce", "ring-imports-reference", "ps-sum"],
)
def test_visible_checks_explain_mistakes(tmp_path, source, check, message):
    with pytest.raises(CheckFailed, match=message):
        getattr(checks, check)(_write(tmp_path, source))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_visible_check_stops_a_deadlocked_ring_and_says_why(tmp_path):
    with pytest.raises(CheckFailed, match=r"did not return within 15 s on rank \d of 3.*isend"):
        checks.ring_all_reduce(_write(tmp_path, mistakes.RING_RECV_FIRST))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_visible_check_job_timeout_stops_a_hang_before_the_watchdog(tmp_path, monkeypatch):
    monkeypatch.setattr(checks, "CHECK_TIMEOUT_S", 8.0)
    with pytest.raises(CheckFailed, match="did not finish within 8 s.*isend"):
        checks.ring_all_reduce(_write(tmp_path, mistakes.RING_RECV_FIRST))


def test_visible_checks_say_when_the_file_is_missing(tmp_path):
    with pytest.raises(CheckFailed, match="run the %%writefile cell first"):
        checks.ring_all_reduce(str(tmp_path / "ring.py"))


def test_launch_problem_quotes_the_students_error_and_line():
    class Result:
        logs = {
            -1: "agent",
            0: 'Traceback...\n  File "/x/ring.py", line 17, in ring_all_reduce\n'
            "[rank0]: NotImplementedError\n",
            1: "",
        }

    class Err(Exception):
        result = Result()

    text = launch_problem(Err("boom"), "ring.py")
    assert text == "ring.py failed on rank 0: NotImplementedError (ring.py line 17)"


def test_distributed_visible_checks_defer_to_the_grader_under_autograde(monkeypatch, capsys):
    monkeypatch.setenv("NBGRADER_EXECUTION", "autograde")
    checks.ring_all_reduce("no-such-file.py")  # no torchrun job: the verdict decides
    checks.parameter_server_average("no-such-file.py")
    assert capsys.readouterr().out.count("checked by the grader, outside this kernel") == 2


def test_figures_draw_every_concept_and_survive_a_bad_fit():
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
    assert len(figures.ring_steps(4).axes) == 7
    sizes = np.array([256.0, 4096.0, 65536.0])
    seconds = collectives.ring_allreduce_time(sizes, 2, 5e-5, 1e9)
    for alpha, bandwidth in [(5e-5, 1e9), (-1e-5, float("inf"))]:
        assert len(figures.bandwidth_sweep(sizes, seconds, 2, alpha, bandwidth).axes) == 2
    assert figures.model_scaling().axes and figures.busiest_link().axes
    assert figures.send_recv_order().axes


# --------------------------------------------------------------------------- property: any draw

PROPERTY_SEEDS = range(200)


def _parameter_server(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every rank's tensor after the solution's server: rank 0 adds in order, divides, sends."""
    total = xs[0].clone()
    for x in xs[1:]:
        total += x
    total /= len(xs)
    return [total.clone() for _ in xs]


def _none(xs):
    return [None] * len(xs)


#: grade id -> (what a right answer leaves on every rank, [what typical mistakes leave])
COLLECTIVE_OUTPUTS = {
    "test_ex1_ring_all_reduce": (
        lambda xs: (simulated_ring(xs), _none(xs)),
        [
            lambda xs: (simulated_ring(xs, skip_last_reduce_step=True), _none(xs)),
            lambda xs: ([torch.stack(xs).mean(0) for _ in xs], _none(xs)),
            lambda xs: ([x.clone() for x in xs], [torch.stack(xs).sum(0) for _ in xs]),
        ],
    ),
    "test_ex2_parameter_server": (
        lambda xs: (_parameter_server(xs), _none(xs)),
        [
            lambda xs: ([torch.stack(xs).sum(0) for _ in xs], _none(xs)),
            lambda xs: (_parameter_server(xs)[:1] + [x.clone() for x in xs[1:]], _none(xs)),
        ],
    ),
}


@pytest.mark.parametrize("grade_id", list(COLLECTIVE_OUTPUTS))
def test_property_collective_verdicts_do_not_depend_on_the_draw(grade_id):
    """200 draws: the (simulated, input-dtype) right answer passes, each mistake fails."""
    ex = EXERCISES[grade_id]
    right, wrongs = COLLECTIVE_OUTPUTS[grade_id]
    for seed in PROPERTY_SEEDS:
        inputs = ex.make_inputs(_gen(seed))
        try:
            ex.judge(inputs, _outputs(inputs, right))
        except CheckFailed as err:
            pytest.fail(f"seed {seed}: the right answer failed: {err}")
        for k, wrong in enumerate(wrongs):
            with pytest.raises(CheckFailed):
                ex.judge(inputs, _outputs(inputs, wrong))
                pytest.fail(f"seed {seed}: mistake {k} passed")


MODEL_SOURCES = {  # grade id -> (solution cell, typical mistakes)
    "test_ex3_ring_time": ("ex3_ring_time", [mistakes.RING_TIME_NO_FACTOR]),
    "test_ex4_fit_alpha_beta": (
        "ex4_fit_alpha_beta",
        [mistakes.FIT_NO_FACTOR, mistakes.FIT_ABSOLUTE],
    ),
}


@pytest.mark.parametrize("grade_id", list(MODEL_SOURCES))
def test_property_model_verdicts_do_not_depend_on_the_draw(grade_id):
    """200 draws: the solution passes, each mistake fails (``run`` in this process)."""
    ex = EXERCISES[grade_id]
    cell, wrong_sources = MODEL_SOURCES[grade_id]
    right = _namespace(_solution(cell))
    wrongs = [_namespace(s) for s in wrong_sources]
    for seed in PROPERTY_SEEDS:
        inputs = ex.make_inputs(_gen(seed))
        try:
            ex.judge(inputs, ex.run(right, inputs, Path(".")))
        except CheckFailed as err:
            pytest.fail(f"seed {seed}: the solution failed: {err}")
        for k, ns in enumerate(wrongs):
            with pytest.raises(CheckFailed):
                ex.judge(inputs, ex.run(ns, inputs, Path(".")))
                pytest.fail(f"seed {seed}: mistake {k} passed")
