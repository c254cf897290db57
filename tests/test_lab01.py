"""Lab 1's checks, tested directly: the solutions pass, the mistakes fail with their diagnosis.

The solution code comes from the committed solutions notebook (the source of truth), run in
this process through each exercise's ``run`` and the grader's full judge (the kit's oracle
judge, then ``ddp_lab.answers.lab01.HIDDEN``), as the grader chains them: inputs and outputs
go through ``torch.save`` / ``torch.load(weights_only=True)``. The visible checks are the
kit's part alone. The real nbgrader runs of the sample class are in ``test_grading.py``, and
every mistake's grader run in ``test_mistakes.py``.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _harness import ROOT, assert_verdicts, lab_notebook, released_sources, solution_sources

from ddp_lab.answers import full_judge, hidden, typical
from ddp_lab.answers.lab01 import MISTAKES
from ddp_lab.answers.lab01 import references as ref
from ddp_lab.checks import lab01 as checks
from ddp_lab.checks import runner
from ddp_lab.checks.contract import exercises
from ddp_lab.checks.failure import CheckFailed
from ddp_lab.checks.lab01 import ex3_data_parallel_gradients as ex3
from ddp_lab.grading import integrity
from ddp_lab.grading.notebook import is_test, nbgrader_meta, source_of

LAB = checks.LAB
SOURCES = solution_sources(LAB)
EXERCISES = exercises(LAB)
HIDDEN = hidden(LAB)
GIDS = list(EXERCISES)
SEEDS = range(8)

# test cell -> the function its solution cell defines (and its visible check is named after)
FUNCTION = {
    "test_ex1_split_batch": "split_batch",
    "test_ex2_average_gradients": "average_gradients",
    "test_ex3_data_parallel_gradients": "data_parallel_gradients",
    "test_ex4_combine_shard_stats": "combine_shard_stats",
    "test_ex5_dataparallel_step_time": "dataparallel_step_time",
}

# what each mistake's *visible* check says (the kit alone: no exact comparison, no hidden
# diagnosis); None: only the grader's exact comparison catches it
VISIBLE_SAYS = {
    "drops_the_remainder": r"2 are lost\. 10 is not a multiple of 4: the remainder 2",
    "torch_chunk": r"the sizes torch\.chunk makes, \[3, 3, 3, 1\]",
    "last_shard_takes_the_remainder": r"sizes \[2, 2, 2, 4\] differ by more than one",
    "shuffles": r"do not give back x",
    "keeps_all_targets": r"shard 0 has 3 inputs but 10 targets",
    "returns_a_tensor": r"expected a list of 4 \(x_k, y_k\) pairs, got a tensor",
    "sums": r"sum of the replicas' gradients, 4 times the mean",
    "keeps_replica_0": r"replica 0's gradients",
    "averages_over_parameters": r"expected one averaged gradient per parameter \(2\), got 4",
    "plain_average": r"expected the full-batch gradient of the mean loss\): max abs difference",
    "sums_the_shards": r"expected the full-batch gradient of the mean loss\): max abs difference",
    "shares_the_model_and_accumulates": r"expected the full-batch gradient",
    "leaves_gradients_in_the_model": r"now holds gradients.*copy\.deepcopy",
    "plain_averages": r"plain average of the shard means",
    "variance_without_the_spread_of_means": r"the \(biased\) variance of the whole batch: max",
    "unbiased_variance": r"unbiased variance",
    "ignores_the_counts": r"plain average of the shard means",
    "forgets_replication": r"returned 2 s; the docstring's example says 3\.0 s",
    "forgets_the_gil": r"4 threads take longer than one launch .*GIL",
    "gathers_outputs_once": None,
}

# other right answers, some computing in float32: every judge must accept them
RIGHT_VARIANTS = {
    "split_remainder_at_the_end": (
        "test_ex1_split_batch",
        """
def split_batch(x, y, n):
    b = x.shape[0]
    bounds = [k * b // n for k in range(n + 1)]
    return [(x[s:e], y[s:e]) for s, e in zip(bounds, bounds[1:])]
""",
    ),
    "average_in_float32": (
        "test_ex2_average_gradients",
        """
def average_gradients(grads_per_replica):
    n = len(grads_per_replica)
    return [sum(g.float() for g in grads) / n for grads in zip(*grads_per_replica)]
""",
    ),
    "autograd_grad_float32_accumulators": (
        "test_ex3_data_parallel_gradients",
        """
import torch
def data_parallel_gradients(model, shards, loss_fn):
    b = sum(len(yk) for _, yk in shards)
    params = list(model.parameters())
    out = [torch.zeros(p.shape) for p in params]
    for xk, yk in shards:
        grads = torch.autograd.grad(loss_fn(model(xk), yk), params)
        for acc, g in zip(out, grads):
            acc += g * len(yk) / b
    return out
""",
    ),
    "stats_with_float_counts": (
        "test_ex4_combine_shard_stats",
        """
def combine_shard_stats(means, variances, counts):
    c = counts.float()
    mean = (c[:, None] * means).sum(0) / c.sum()
    sq = (c[:, None] * (variances + means ** 2)).sum(0) / c.sum()
    return mean, sq - mean ** 2
""",
    ),
    "step_time_one_expression": (
        "test_ex5_dataparallel_step_time",
        """
def dataparallel_step_time(n, *, compute_s, param_bytes, batch_bytes, output_bytes,
                           bandwidth, host_s):
    moved = 2 * (n - 1) * param_bytes + (n - 1) / n * (batch_bytes + 2 * output_bytes)
    return compute_s / n + moved / bandwidth + n * host_s
""",
    ),
}

# the instructor's references, called as a student's functions
REFERENCES = {
    "test_ex1_split_batch": ref.reference_split_batch,
    "test_ex2_average_gradients": ref.reference_average_gradients,
    "test_ex3_data_parallel_gradients": ref.reference_data_parallel_gradients,
    "test_ex4_combine_shard_stats": ref.reference_combine_shard_stats,
    "test_ex5_dataparallel_step_time": ref.reference_step_time,
}


def cell_of(gid: str) -> str:
    (cell,) = EXERCISES[gid].cells
    return cell


def student(gid: str, source: str) -> dict:
    """The namespace the grader's student process builds from one solution cell's source."""
    return runner.namespace({cell_of(gid): source}, [cell_of(gid)])


def judge_of(gid: str):
    """The grader's judge: the kit's oracle judge, then the hidden check and diagnoses."""
    return full_judge(EXERCISES[gid], HIDDEN.get(gid))


def draw(gid: str, seed: int) -> dict:
    """The inputs the grader draws with ``seed`` (the hidden ones where the lab has any)."""
    extra = HIDDEN.get(gid)
    make = extra.inputs if extra and extra.inputs else EXERCISES[gid].make_inputs
    return make(torch.Generator().manual_seed(seed))


def through_disk(value, path: Path):
    """Save and reload as the grader does (``weights_only=True``)."""
    torch.save(value, path)
    return torch.load(path, weights_only=True)


def grade(gid: str, ns: dict, seed: int, tmp_path: Path) -> str:
    """Draw inputs with ``seed``, run the student's namespace on them, fully judge."""
    ex = EXERCISES[gid]
    inputs = through_disk(draw(gid, seed), tmp_path / "in.pt")
    outputs = runner.run_here(ex, ns, inputs, tmp_path)
    return judge_of(gid)(inputs, through_disk(outputs, tmp_path / "out.pt"))


def mistakes_of(gid: str) -> list:
    return [m for m in MISTAKES if m.cell == cell_of(gid)]


# --- the lab's shape ------------------------------------------------------------------------


def test_five_independent_exercises_worth_fifteen_points():
    cells = lab_notebook(LAB)["cells"]
    points = {nbgrader_meta(c)["grade_id"]: nbgrader_meta(c)["points"] for c in cells if is_test(c)}
    assert list(points) == GIDS == list(FUNCTION)
    assert sum(points.values()) == 15 and all(p >= 2 for p in points.values())
    for gid, ex in EXERCISES.items():
        assert ex.cells == (gid.removeprefix("test_"),), f"{gid} must judge its own cell only"
        assert ex.run is not None and ex.timeout <= 60
    assert list(typical(MISTAKES)) == [cell_of(g) for g in GIDS], "a typical mistake each"
    assert set(VISIBLE_SAYS) == {m.name for m in MISTAKES}


def test_solution_cells_import_what_they_use():
    """The grader runs each solution cell alone: it may not lean on the setup cell."""
    for gid, name in FUNCTION.items():
        assert callable(student(gid, SOURCES[cell_of(gid)])[name])


def test_test_cells_call_their_visible_check_and_hidden_test():
    cells = {nbgrader_meta(c).get("grade_id"): source_of(c) for c in lab_notebook(LAB)["cells"]}
    for gid, name in FUNCTION.items():
        visible, hidden_part = cells[gid].split("### BEGIN HIDDEN TESTS")
        assert f"checks.{name}({name})" in visible
        assert f'hidden_test("{gid}")' in hidden_part


def test_kit_checks_import_nothing_of_the_instructors_part():
    for path in (ROOT / "ddp_lab" / "checks" / "lab01").glob("*.py"):
        text = path.read_text()
        for module in ("ddp_lab.answers", "ddp_lab.grading", "ddp_lab.bench"):
            assert module not in text, f"{path.name} names {module}"


def test_kit_holds_no_solution_region_of_the_lab():
    """Token-normalised, robust to renamed variables: the measure of the student-kit test."""
    kit = [*(ROOT / "ddp_lab" / "checks" / "lab01").glob("*.py")]
    kit += [ROOT / "ddp_lab" / "figures" / "lab01.py"]
    prints = {p.name: integrity.fingerprints(p.read_text()) for p in kit}
    released = released_sources(LAB)
    for cell, source in SOURCES.items():
        region = integrity.without(
            integrity.fingerprints(integrity.solution_region(source)),
            [integrity.fingerprints(released.get(cell, ""))],
        )
        for name, fp in prints.items():
            assert integrity.containment(region, fp) < 0.25, f"{cell} leaks into {name}"


# --- the grader's judge ---------------------------------------------------------------------


@pytest.mark.parametrize("gid", GIDS)
def test_solution_passes_the_full_judge_on_fresh_inputs(gid, tmp_path):
    ns = student(gid, SOURCES[cell_of(gid)])
    for seed in SEEDS:
        message = grade(gid, ns, seed, tmp_path)
        assert isinstance(message, str) and message


@pytest.mark.parametrize("gid", GIDS)
def test_references_pass_the_full_judge(gid, tmp_path):
    ns = {FUNCTION[gid]: REFERENCES[gid]}
    for seed in SEEDS:
        grade(gid, ns, seed, tmp_path)


@pytest.mark.parametrize("case", list(RIGHT_VARIANTS))
def test_other_right_answers_pass_the_full_judge_and_the_visible_check(case, tmp_path, capsys):
    gid, right = RIGHT_VARIANTS[case]
    ns = student(gid, right)
    for seed in SEEDS:
        grade(gid, ns, seed, tmp_path)
    getattr(checks, FUNCTION[gid])(ns[FUNCTION[gid]])
    assert capsys.readouterr().out.startswith("OK: ")


@pytest.mark.parametrize("mistake", MISTAKES, ids=lambda m: m.name)
def test_each_mistake_fails_the_full_judge_with_its_diagnosis(mistake, tmp_path):
    gid = f"test_{mistake.cell}"
    ns = student(gid, mistake.source)
    for seed in SEEDS:
        with pytest.raises(CheckFailed, match=re.escape(mistake.reason)):
            grade(gid, ns, seed, tmp_path)


@pytest.mark.parametrize("gid", GIDS)
def test_no_op_stub_fails_the_full_judge(gid, tmp_path):
    """The released stub with ``pass`` (what the sample class's cheater submits)."""
    name = FUNCTION[gid]
    with pytest.raises(CheckFailed):
        grade(gid, student(gid, f"def {name}(*args, **kwargs):\n    pass\n"), 0, tmp_path)


@pytest.mark.parametrize("gid", GIDS)
def test_forged_outputs_fail_the_full_judge(gid):
    """Outputs written by hand: a constant, a wrong structure, zeros of the right kind."""
    inputs = draw(gid, 0)
    key = {
        "test_ex1_split_batch": "results",
        "test_ex2_average_gradients": "averaged",
        "test_ex3_data_parallel_gradients": "grads",
        "test_ex4_combine_shard_stats": "mean",
        "test_ex5_dataparallel_step_time": "times",
    }[gid]
    for forged in ({}, {key: "<NoneType>"}, {key: [torch.zeros(3)] * 3}, {key: []}):
        with pytest.raises(Exception):  # noqa: B017 - the judge process fails any of them
            judge_of(gid)(inputs, forged)


def test_hidden_parts_add_exact_checks_and_diagnoses():
    """What the grader adds: a mistake the kit's properties cannot see fails the full judge,
    and the kit's generic messages become the typical mistakes' names."""
    gid = "test_ex5_dataparallel_step_time"
    (once,) = [m for m in mistakes_of(gid) if m.name == "gathers_outputs_once"]
    inputs = draw(gid, 0)
    outputs = EXERCISES[gid].run(student(gid, once.source), inputs, None)
    EXERCISES[gid].judge(inputs, outputs)  # the kit's properties hold
    with pytest.raises(CheckFailed, match="their gradients go out again"):
        judge_of(gid)(inputs, outputs)
    for name, says in [
        ("plain_average", "plain average of the shard gradients"),
        ("variance_without_the_spread_of_means", "leaves out how far the shard means lie"),
    ]:
        (m,) = [m for m in MISTAKES if m.name == name]
        g = f"test_{m.cell}"
        inputs = draw(g, 0)
        outputs = EXERCISES[g].run(student(g, m.source), inputs, None)
        with pytest.raises(CheckFailed) as kit:
            EXERCISES[g].judge(inputs, outputs)
        assert says not in str(kit.value), "the kit must not hold this diagnosis"
        with pytest.raises(CheckFailed, match=says):
            judge_of(g)(inputs, outputs)


def test_judges_draw_sizes_at_grading_time():
    drawn = [{gid: draw(gid, s) for gid in GIDS} for s in SEEDS]
    batches = {
        (
            d["test_ex1_split_batch"]["batches"][0]["x"].shape[0],
            d["test_ex1_split_batch"]["batches"][0]["n"],
        )
        for d in drawn
    }
    assert len(batches) > 3 and all(b % n for b, n in batches), "B must not divide by n"
    for d in drawn:
        sizes = [len(x) for x in d["test_ex3_data_parallel_gradients"]["xs"]]
        assert len(set(sizes)) > 1, "exercise 3 needs unequal shards"
        counts = d["test_ex4_combine_shard_stats"]["counts"].tolist()
        assert len(set(counts)) > 1, "exercise 4 needs unequal counts"
        ns = [c["n"] for c in d["test_ex5_dataparallel_step_time"]["cases"]]
        assert 1 in ns and max(ns) > 2
    assert len({len(d["test_ex2_average_gradients"]["grads"]) for d in drawn}) > 1


def test_average_gradients_inputs_know_their_mean_by_construction():
    for seed in SEEDS:
        inputs = draw("test_ex2_average_gradients", seed)
        for mean, grads in zip(inputs["means"], zip(*inputs["grads"], strict=True), strict=True):
            torch.testing.assert_close(torch.stack(grads).mean(0), mean, rtol=0, atol=1e-12)
            assert (grads[0] - mean).abs().max() > 1e-3, "replica 0 must differ from the mean"


# --- the visible checks ---------------------------------------------------------------------


@pytest.mark.parametrize("gid", GIDS)
def test_visible_check_passes_the_solution(gid, capsys):
    name = FUNCTION[gid]
    getattr(checks, name)(student(gid, SOURCES[cell_of(gid)])[name])
    out = capsys.readouterr().out
    assert out.startswith("OK: ") and out.count("\n") == 1


@pytest.mark.parametrize("mistake", MISTAKES, ids=lambda m: m.name)
def test_visible_check_rejects_a_mistake_with_a_helpful_message(mistake, capsys):
    gid = f"test_{mistake.cell}"
    name = FUNCTION[gid]
    wrong = student(gid, mistake.source)[name]
    says = VISIBLE_SAYS[mistake.name]
    if says is None:  # only the exact comparison sees it: the grader's, not the kit's
        getattr(checks, name)(wrong)
        assert capsys.readouterr().out.startswith("OK: ")
        return
    with pytest.raises(CheckFailed, match=says):
        getattr(checks, name)(wrong)


@pytest.mark.parametrize("gid", GIDS)
def test_visible_check_of_the_released_stub_says_finish_this_exercise_first(gid):
    name = FUNCTION[gid]
    stub = student(gid, released_sources(LAB)[cell_of(gid)])
    with pytest.raises(CheckFailed, match="still raises NotImplementedError: finish this exercise"):
        getattr(checks, name)(stub[name])


def test_visible_check_reports_the_students_error_in_one_line():
    with pytest.raises(CheckFailed, match="your code raised ZeroDivisionError"):
        checks.average_gradients(lambda grads: 1 / 0)


# --- references and figures -----------------------------------------------------------------


def test_references_agree_with_their_definitions():
    assert ref.shard_sizes(10, 4) == [3, 3, 2, 2] and ref.shard_sizes(8, 4) == [2] * 4
    kw = dict(
        compute_s=0.5,
        param_bytes=2e9,
        batch_bytes=4e9,
        output_bytes=1e9,
        bandwidth=1e9,
        host_s=0.25,
    )
    assert ref.reference_step_time(1, **kw) == pytest.approx(0.75)
    assert ref.reference_step_time(4, **kw) == pytest.approx(
        0.125 + 6 * 2 + 0.75 * 4 + 2 * 0.75 * 1 + 1.0
    )
    g = torch.Generator().manual_seed(0)
    shards = [torch.randn(c, 3, generator=g, dtype=torch.float64) + c for c in (1, 4, 9)]
    means = torch.stack([s.mean(0) for s in shards])
    variances = torch.stack([s.var(0, unbiased=False) for s in shards])
    mean, var = ref.reference_combine_shard_stats(means, variances, torch.tensor([1, 4, 9]))
    whole = torch.cat(shards)
    torch.testing.assert_close(mean, whole.mean(0))
    torch.testing.assert_close(var, whole.var(0, unbiased=False))
    within = ref.within_shard_variance(variances, torch.tensor([1, 4, 9]))
    assert (var - within).min() > 0.1, "the spread of the shard means is the other half"
    model = ex3.make_mlp([3, 5, 2])
    x, y = torch.randn(7, 3, dtype=torch.float64), torch.tensor([0, 1, 1, 0, 1, 0, 0])
    got = ref.reference_data_parallel_gradients(
        model, ref.reference_split_batch(x, y, 3), F.cross_entropy
    )
    torch.testing.assert_close(got, ex3.full_batch_gradients(model, x, y))
    assert all(p.grad is None for p in model.parameters())


def test_each_figure_draws_one_concept():
    from matplotlib.figure import Figure

    from ddp_lab.figures import lab01 as figures

    drawn = [
        figures.data_parallel_step((3, 3, 2)),
        figures.dataparallel_timeline(4),
        figures.imbalance_error([1, 2, 3], [0.3, 0.2, 0.0], [1e-16] * 3, batch=6),
        figures.shard_statistics(torch.randn(3, 2), torch.zeros(2)),
        figures.step_time_curves([1, 2, 4], {"dp": [1.0, 0.7, 0.8]}, ideal=[1.0, 0.5, 0.25]),
    ]
    assert all(isinstance(f, Figure) for f in drawn)


# --- the notebook ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_solution_notebook_runs_top_to_bottom_within_budget(tmp_path):
    """On 2 CPU cores: every cell runs, every check says OK, in well under 3 minutes."""
    import nbformat
    from nbclient import NotebookClient

    notebook = ROOT / "solutions" / LAB / f"{LAB}.ipynb"
    copy = tmp_path / LAB / notebook.name
    copy.parent.mkdir()
    shutil.copy(notebook, copy)
    nb = nbformat.read(copy, as_version=4)
    env_before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        start = time.monotonic()
        NotebookClient(
            nb,
            timeout=120,
            kernel_name="python3",
            resources={"metadata": {"path": str(copy.parent)}},
        ).execute()
        seconds = time.monotonic() - start
    finally:
        if env_before is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env_before
    assert seconds < 150, f"the notebook took {seconds:.0f} s"
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        assert not [o for o in cell.outputs if o.output_type == "error"], cell.id
        text = "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")
        if is_test(cell):
            assert text.count("OK: ") == 2, f"{cell.id}: {text}"  # visible check + hidden test
        assert len(text.splitlines()) <= 6, f"{cell.id} prints too much"
    pictures = [
        c.id
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.outputs
        if "image/png" in o.get("data", {})
    ]
    assert len(pictures) == len(set(pictures)) >= 5, f"one figure per concept: {pictures}"
    for gpu_cell in ("dp_gpu_steps", "dp_gpu_scaling"):
        (cell,) = [c for c in nb.cells if c.id == gpu_cell]
        assert re.search(r"No GPU here|GPU\(s\)", str(cell.outputs))


# --- property: the verdict must not depend on the draw ---------------------------------------

PROPERTY_SEEDS = range(200)


@pytest.mark.parametrize("gid", GIDS)
def test_property_verdict_does_not_depend_on_the_draw(gid):
    """On 200 fresh draws, under the grader's full judge: the solution, the references and
    every right variant pass; every mistake fails, with its own diagnosis.

    Cheap: ``run`` calls the functions in this process (no student process, no disk).
    """
    ex, judge = EXERCISES[gid], judge_of(gid)
    rights = {"solution": student(gid, SOURCES[cell_of(gid)])}
    rights["reference"] = {FUNCTION[gid]: REFERENCES[gid]}
    rights |= {k: student(gid, s) for k, (g, s) in RIGHT_VARIANTS.items() if g == gid}
    wrongs = {m.name: (m, student(gid, m.source)) for m in mistakes_of(gid)}
    assert wrongs, f"{gid} has no mistake to test"
    for seed in PROPERTY_SEEDS:
        inputs = draw(gid, seed)
        wrong_outputs = {name: ex.run(ns, inputs, None) for name, (_, ns) in wrongs.items()}
        for ns in rights.values():
            assert_verdicts(judge, seed, inputs, ex.run(ns, inputs, None), wrong_outputs)
        for name, (m, _) in wrongs.items():
            with pytest.raises(CheckFailed, match=re.escape(m.reason)):
                judge(inputs, wrong_outputs[name])
