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
from _harness import ROOT, assert_verdicts, lab_notebook, released_sources, solution_sources

from ddp_lab.answers import full_judge, hidden, typical
from ddp_lab.answers.lab01 import MISTAKES
from ddp_lab.answers.lab01 import references as ref
from ddp_lab.checks import lab01 as checks
from ddp_lab.checks import runner
from ddp_lab.checks.contract import exercises
from ddp_lab.checks.failure import CheckFailed
from ddp_lab.checks.lab01 import ex5_dataparallel_step_time as ex5
from ddp_lab.grading import integrity
from ddp_lab.grading.notebook import is_test, is_written, nbgrader_meta, source_of

LAB = checks.LAB
SOURCES = solution_sources(LAB)
EXERCISES = exercises(LAB)
HIDDEN = hidden(LAB)
GIDS = list(EXERCISES)
SEEDS = range(6)

# test cell -> the function its solution cell defines (and its visible check is named after)
FUNCTION = {
    "test_ex1_split_batch": "split_batch",
    "test_ex2_data_parallel_step": "data_parallel_step",
    "test_ex3_data_parallel_forward": "data_parallel_forward",
    "test_ex4_combine_shard_stats": "combine_shard_stats",
    "test_ex5_dataparallel_step_time": "dataparallel_step_time",
}
POINTS = {"test_ex1_split_batch": 2, "test_ex2_data_parallel_step": 4}
POINTS |= {"test_ex3_data_parallel_forward": 3, "test_ex4_combine_shard_stats": 4}
POINTS |= {"test_ex5_dataparallel_step_time": 3, "w_weights": 2, "w_cost": 2}

# what each mistake's *visible* check says (the kit alone: no exact comparison, no hidden
# diagnosis); None: only the grader's exact comparison catches it
VISIBLE_SAYS = {
    "drops_the_remainder": r"2 are lost\. 10 is not a multiple of 4: the remainder 2",
    "torch_chunk": r"the sizes torch\.chunk makes, \[3, 3, 3, 1\]",
    "last_shard_takes_the_remainder": r"sizes \[2, 2, 2, 4\] differ by more than one",
    "shuffles": r"do not give back x",
    "keeps_all_targets": r"shard 0 has 3 inputs but 10 targets",
    "returns_a_tensor": r"expected a list of 4 \(x_k, y_k\) pairs, got a tensor",
    "skips_empty_shards": r"n=3\) with a batch of 2: expected 3 shards .* get an empty shard",
    "remainder_at_the_end": r"batch of 10: shard sizes \[2, 3, 2, 3\]; the first 2 shard",
    "extra_samples_to_the_last_shards": r"batch of 10: shard sizes \[2, 2, 3, 3\]; the first 2",
    "plain_average": r"\[5, 2, 1\] \(float64\): the model's 1\.weight\.grad \(expected the grad",
    "sums_the_shards": r"\[5, 2, 1\] \(float64\): the model's 1\.weight\.grad",
    "accumulates_onto_the_stale_grad": r"\[5, 2, 1\] \(float64\): the model's 1\.weight\.grad",
    "steps_after_each_shard": r"\[5, 2, 1\] \(float64\): the model's 1\.weight\.grad",
    "runs_the_empty_shards": r"\[3, 1, 0\] \(float32\): you returned the loss nan\. Shard",
    "one_pass_over_the_whole_batch": r"one forward pass saw 8 samples.*one replica per shard",
    "plain_average_of_the_losses": r"you returned the loss .* combine them like the gradients",
    "steps_without_the_grad": r"\[5, 2, 1\] \(float64\): the model's 1\.weight\.grad",
    "returns_the_loss_as_a_tensor": r"the loss as a tensor of shape \(\); the docstring promises",
    "deepcopy_replicas": r"n=4\) on a batch of 10 .* not connected to module's in autograd",
    "one_thread": r"the 4 replicas ran in 1 thread\(s\)",
    "threads_share_the_module": r"a replica ran with module's own parameter tensors",
    "drops_the_remainder_ex3": r"expected outputs of shape \(10, \d\) .* got \(8, \d\)",
    "detached_clones": r"not connected to module's in autograd",
    "replicas_share_one_copy": r"replicas 0 and 1 ran with the same parameter tensors",
    "views_of_the_parameters": r"replicas 0 and 1 ran with the same parameter tensors",
    "plain_averages": r"plain average of the shard means",
    "variance_without_the_spread_of_means": r"\(biased\) variance of the whole batch: feature",
    "unbiased_variance": r"unbiased variance",
    "ignores_the_counts": r"plain average of the shard means",
    "sum_of_squares": r"far from 0 \(\|mean\| about 2e\+04.*subtracts two large numbers",
    "sum_of_squares_in_float64": None,  # the visible inputs stop at float32 near 2e4
    "computes_in_float64": r"are torch\.float64 and torch\.float64; the docstring promises them",
    "nan_from_empty_shards": r"\[5, 2, 0\] samples .* holds NaN\. Shard\(s\) \[2\] are empty",
    "sends_a_copy_to_each_device": r"returned 4\.1 s; the docstring says 2\.6 s",
    "ignores_the_pipeline_fill": r"returned 2\.1 s; the docstring says 2\.6 s",
    "a_small_model_as_a_whole_chunk": r"returned 0\.0501748 s; with nothing to move and no",
    "forgets_the_reduce": r"returned 1\.35 s; the docstring says 2\.6 s",
    "forgets_the_gil": r"4 threads take longer than one launch .*GIL",
    "gathers_outputs_once": None,
}


def _key(m) -> str:
    """Mistake names repeat across exercises (drops_the_remainder): the key of VISIBLE_SAYS."""
    return (
        f"{m.name}_ex3" if m.cell.startswith("ex3_") and m.name == "drops_the_remainder" else m.name
    )


# other right answers, some computing differently: every judge must accept them
RIGHT_VARIANTS = {
    "step_with_autograd_grad": (
        "test_ex2_data_parallel_step",
        """
import copy
import torch
def data_parallel_step(model, shards, loss_fn, lr):
    b = sum(len(yk) for _, yk in shards)
    out, total = [torch.zeros_like(p) for p in model.parameters()], 0.0
    for xk, yk in shards:
        if len(yk):
            r = copy.deepcopy(model)
            loss = loss_fn(r(xk), yk)
            for acc, g in zip(out, torch.autograd.grad(loss, list(r.parameters()))):
                acc.add_(g, alpha=len(yk) / b)
            total += loss.item() * len(yk) / b
    for p, g in zip(model.parameters(), out):
        p.grad = g
        p.data.sub_(lr * g)
    return total
""",
    ),
    "step_accumulating_on_a_zeroed_model": (
        "test_ex2_data_parallel_step",
        """
import torch
def data_parallel_step(model, shards, loss_fn, lr):
    b = sum(len(yk) for _, yk in shards)
    model.zero_grad()
    total = 0.0
    for xk, yk in shards:
        if len(yk):
            part = loss_fn(model(xk), yk) * (len(yk) / b)
            part.backward()
            total += part.item()
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad
    return total
""",
    ),
    "forward_direct_for_one_piece": (
        "test_ex3_data_parallel_forward",
        """
import copy, threading, torch
def data_parallel_forward(module, x, n):
    pieces = x.chunk(n)
    if len(pieces) == 1:
        return module(x)
    outs = [None] * len(pieces)
    def go(k, replica, params):
        outs[k] = torch.func.functional_call(replica, params, pieces[k])
    ts = []
    for k in range(len(pieces)):
        params = {name: p * 1 for name, p in module.named_parameters()}
        ts.append(threading.Thread(target=go, args=(k, copy.deepcopy(module), params)))
        ts[-1].start()
    for t in ts:
        t.join()
    return torch.cat(outs, dim=0)
""",
    ),
    "stats_merged_pairwise": (  # Chan et al.: merge shard after shard, in the input dtype
        "test_ex4_combine_shard_stats",
        """
def combine_shard_stats(means, variances, counts):
    n_a, mean, m2 = 0, None, None
    for m, v, c in zip(means, variances, counts.tolist()):
        if c == 0:
            continue
        if mean is None:
            n_a, mean, m2 = c, m.clone(), v * c
            continue
        n = n_a + c
        delta = m - mean
        mean = mean + delta * (c / n)
        m2 = m2 + v * c + delta * delta * (n_a * c / n)
        n_a = n
    return mean, m2 / n_a
""",
    ),
    "stats_shifted_sum_of_squares": (  # E[(x - s)^2] - (m - s)^2 around a shard's mean: safe
        "test_ex4_combine_shard_stats",
        """
def combine_shard_stats(means, variances, counts):
    keep = counts > 0
    m, v, c = means[keep], variances[keep], counts[keep].to(means.dtype)
    shift = m[0]
    d = m - shift
    mean_d = (c[:, None] * d).sum(0) / c.sum()
    sq = (c[:, None] * (v + d * d)).sum(0) / c.sum()
    return shift + mean_d, sq - mean_d * mean_d
""",
    ),
    "step_time_one_expression": (
        "test_ex5_dataparallel_step_time",
        """
def dataparallel_step_time(n, *, compute_s, param_bytes, batch_bytes, output_bytes,
                           bandwidth, host_s, chunk_bytes):
    hops = max(0, n - 2) * min(chunk_bytes, param_bytes) if n > 1 else -param_bytes
    moved = 2 * (param_bytes + hops) + (n - 1) / n * (batch_bytes + 2 * output_bytes)
    return compute_s / n + moved / bandwidth + n * host_s
""",
    ),
}

# the instructor's references, called as a student's functions
REFERENCES = {
    "test_ex1_split_batch": ref.reference_split_batch,
    "test_ex2_data_parallel_step": ref.reference_data_parallel_step,
    "test_ex3_data_parallel_forward": ref.reference_data_parallel_forward,
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


def test_five_exercises_and_two_written_answers_worth_twenty_points():
    cells = lab_notebook(LAB)["cells"]
    graded = [c for c in cells if is_test(c) or is_written(c)]
    points = {nbgrader_meta(c)["grade_id"]: nbgrader_meta(c)["points"] for c in graded}
    assert points == POINTS and sum(points.values()) == 20
    assert [g for g in points if g.startswith("test_")] == GIDS == list(FUNCTION)
    for gid, ex in EXERCISES.items():
        assert ex.cells == (gid.removeprefix("test_"),), f"{gid} must judge its own cell only"
        assert ex.run is not None and ex.timeout <= 60
    assert list(typical(MISTAKES)) == [cell_of(g) for g in GIDS], "a typical mistake each"
    assert set(VISIBLE_SAYS) == {_key(m) for m in MISTAKES}
    for gid in GIDS:
        assert len(mistakes_of(gid)) >= 5, f"{gid}: too few mistakes"


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


# --- the fixed case set ---------------------------------------------------------------------


def test_every_grading_run_covers_every_edge_case():
    """Whatever the seed, the case set holds the same edge cases (values differ)."""
    for seed in SEEDS:
        b = [(c["x"].shape[0], c["n"]) for c in draw("test_ex1_split_batch", seed)["batches"]]
        assert b[0][1] == 1 and b[1][1] == 2 and b[1][0] % 2 and b[2][1] == 3 and b[2][0] % 3
        assert b[3][0] % b[3][1] >= 2 and b[4][0] % b[4][1] == 0 and b[5][0] == b[5][1] + 1
        assert b[6][1] > b[6][0], "more replicas than samples"
        cases = draw("test_ex2_data_parallel_step", seed)["cases"]
        sizes = [[len(x) for x in c["xs"]] for c in cases]
        assert [len(s) for s in sizes[:3]] == [1, 2, 3] and len(sizes[3]) >= 4
        assert 1 in sizes[3] and 0 in sizes[4] and all(len(set(s)) > 1 for s in sizes[1:])
        assert {c["dtype"] for c in cases} == {"float32", "float64"}
        cases = draw("test_ex3_data_parallel_forward", seed)["cases"]
        shape = [(c["x"].shape[0], c["n"]) for c in cases]
        assert [n for _, n in shape[:3]] == [1, 2, 3] and shape[3][1] >= 4
        assert all(b % n for b, n in shape[1:4]) and shape[4][1] > shape[4][0]
        assert {c["dtype"] for c in cases} == {"float32", "float64"}
        cases = draw("test_ex4_combine_shard_stats", seed)["cases"]
        counts = [c["counts"].tolist() for c in cases]
        assert len(counts[0]) == 1 and 1 in counts[2] and 0 in counts[5] and len(counts[3]) > 3
        assert cases[3]["dtype"] == "float32" and float(cases[3]["means"].abs().min()) > 5e3
        assert cases[4]["dtype"] == "float64" and float(cases[4]["means"].abs().min()) > 5e7
        assert {c["means"].shape[1] for c in cases} & {1} and max(
            c["means"].shape[1] for c in cases
        ) > 2
        ns = [c["n"] for c in draw("test_ex5_dataparallel_step_time", seed)["cases"]]
        assert {1, 2, 3} <= set(ns) and max(ns) > 8
        small = [
            c
            for c in draw("test_ex5_dataparallel_step_time", seed)["cases"]
            if c["kwargs"]["param_bytes"] < c["kwargs"]["chunk_bytes"]
        ]
        assert small, "a model smaller than one chunk"


def test_the_typical_mistakes_fail_far_from_their_tolerance():
    """E[x^2] - m^2 is off by orders of magnitude more than a safe formula may be, on the
    far-from-0 cases: the verdict never depends on luck in the rounding."""
    from ddp_lab.checks.lab01 import ex4_combine_shard_stats as ex4

    gid = "test_ex4_combine_shard_stats"
    (naive,) = [m for m in MISTAKES if m.name == "sum_of_squares"]
    ns = student(gid, naive.source)
    for seed in range(50):
        inputs = draw(gid, seed)
        case = inputs["cases"][3]
        _, var = ex4.truth(case)
        got = ns["combine_shard_stats"](case["means"], case["variances"], case["counts"])[1]
        assert float(((got.double() - var).abs() / ex4.var_tolerance(case)).max()) > 10


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


@pytest.mark.parametrize("mistake", MISTAKES, ids=_key)
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
    with pytest.raises((CheckFailed, TypeError, AttributeError)):
        grade(gid, student(gid, f"def {name}(*args, **kwargs):\n    pass\n"), 0, tmp_path)


@pytest.mark.parametrize("gid", GIDS)
def test_forged_outputs_fail_the_full_judge(gid):
    """Outputs written by hand: a constant, a wrong structure, zeros of the right kind."""
    inputs = draw(gid, 0)
    key = {
        "test_ex1_split_batch": "results",
        "test_ex2_data_parallel_step": "cases",
        "test_ex3_data_parallel_forward": "cases",
        "test_ex4_combine_shard_stats": "cases",
        "test_ex5_dataparallel_step_time": "times",
    }[gid]
    for forged in ({}, {key: "<NoneType>"}, {key: [torch.zeros(3)] * 3}, {key: []}):
        with pytest.raises(Exception):  # noqa: B017 - the judge process fails any of them
            judge_of(gid)(inputs, forged)


def test_hidden_parts_add_exact_checks_and_diagnoses():
    """What the grader adds: a mistake the kit's properties cannot see fails the full judge,
    and the kit's generic messages become the typical mistakes' names."""
    for name, says in [
        ("gathers_outputs_once", "their gradients go out again"),
        ("plain_average", "plain average of the shard gradients"),
        ("steps_after_each_shard", "start from the same weights"),
        ("variance_without_the_spread_of_means", "leaves out how far the shard means lie"),
        ("sends_a_copy_to_each_device", "one full copy per device"),
    ]:
        (m,) = [m for m in MISTAKES if m.name == name]
        g = f"test_{m.cell}"
        inputs = draw(g, 0)
        outputs = EXERCISES[g].run(student(g, m.source), inputs, None)
        try:
            EXERCISES[g].judge(inputs, outputs)
            assert name == "gathers_outputs_once", "only the exact model sees this one"
        except CheckFailed as kit:
            assert says not in str(kit), "the kit must not hold this diagnosis"
        with pytest.raises(CheckFailed, match=says):
            judge_of(g)(inputs, outputs)


# --- the visible checks ---------------------------------------------------------------------


@pytest.mark.parametrize("gid", GIDS)
def test_visible_check_passes_the_solution(gid, capsys):
    name = FUNCTION[gid]
    getattr(checks, name)(student(gid, SOURCES[cell_of(gid)])[name])
    out = capsys.readouterr().out
    assert out.startswith("OK: ") and out.count("\n") == 1


@pytest.mark.parametrize("mistake", MISTAKES, ids=_key)
def test_visible_check_rejects_a_mistake_with_a_helpful_message(mistake, capsys):
    gid = f"test_{mistake.cell}"
    name = FUNCTION[gid]
    wrong = student(gid, mistake.source)[name]
    says = VISIBLE_SAYS[_key(mistake)]
    if says is None:  # only the grader's case set or exact comparison sees it
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
        checks.combine_shard_stats(lambda m, v, c: 1 / 0)


# --- references and figures -----------------------------------------------------------------


def test_references_agree_with_their_definitions():
    assert ref.shard_sizes(10, 4) == [3, 3, 2, 2] and ref.shard_sizes(2, 4) == [1, 1, 0, 0]
    kw = dict(
        compute_s=0.5,
        param_bytes=2e9,
        batch_bytes=4e9,
        output_bytes=1e9,
        bandwidth=1e9,
        host_s=0.25,
        chunk_bytes=5e8,
    )
    assert ref.reference_step_time(1, **kw) == pytest.approx(0.75)
    chain = (2e9 + 2 * 5e8) / 1e9  # 4 devices: the bytes, then the last chunk's 2 more hops
    assert ref.reference_step_time(4, **kw) == pytest.approx(
        0.125 + 2 * chain + 0.75 * 4 + 2 * 0.75 * 1 + 1.0
    )
    gen = torch.Generator().manual_seed(0)
    for _ in range(300):  # the closed form equals the chunk-by-chunk simulation of the kit
        n = int(torch.randint(1, 17, (1,), generator=gen))
        chunk = float(torch.rand(1, generator=gen)) + 0.01
        nbytes = float(torch.rand(1, generator=gen)) * 50 * chunk
        got = ref.chain_transfer_s(n, nbytes, chunk, 3.0)
        assert got == pytest.approx(ex5.chain_seconds(n, nbytes, chunk, 3.0), rel=1e-9, abs=1e-12)


def test_each_figure_draws_one_concept():
    from matplotlib.figure import Figure

    from ddp_lab.figures import lab01 as figures

    drawn = [
        figures.data_parallel_step((3, 3, 2)),
        figures.dataparallel_timeline(4),
        figures.chain_pipeline(4, 5),
        figures.imbalance_error([1, 2, 3], [0.3, 0.2, 0.0], [1e-16] * 3, batch=6),
        figures.shard_statistics(torch.randn(3, 2), torch.zeros(2)),
        figures.step_time_curves([1, 2, 4], {"dp": [1.0, 0.7, 0.8]}, ideal=[1.0, 0.5, 0.25]),
    ]
    assert all(isinstance(f, Figure) for f in drawn)


# --- the notebooks --------------------------------------------------------------------------


def _execute(folder: str, tmp_path: Path, allow_errors: bool = False):
    import nbformat
    from nbclient import NotebookClient

    notebook = ROOT / folder / LAB / f"{LAB}.ipynb"
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
            allow_errors=allow_errors,
            resources={"metadata": {"path": str(copy.parent)}},
        ).execute()
        seconds = time.monotonic() - start
    finally:
        if env_before is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env_before
    return nb, seconds


def _text(cell) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_solution_notebook_runs_top_to_bottom_within_budget(tmp_path):
    """On 2 CPU cores: every cell runs, every check says OK, in well under 3 minutes."""
    nb, seconds = _execute("solutions", tmp_path)
    assert seconds < 150, f"the notebook took {seconds:.0f} s"
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        assert not [o for o in cell.outputs if o.output_type == "error"], cell.id
        text = _text(cell)
        if is_test(cell):
            assert text.count("OK: ") == 2, f"{cell.id}: {text}"  # visible check + hidden test
        assert "finish exercise" not in text, cell.id
        assert len(text.splitlines()) <= 6, f"{cell.id} prints too much"
    pictures = [
        c.id
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.outputs
        if "image/png" in o.get("data", {})
    ]
    assert len(pictures) == len(set(pictures)) >= 6, f"one figure per concept: {pictures}"
    for gpu_cell in ("dp_gpu_steps", "dp_gpu_scaling"):
        (cell,) = [c for c in nb.cells if c.id == gpu_cell]
        assert re.search(r"No GPU here|GPU\(s\)", str(cell.outputs))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_released_notebook_demos_say_which_exercise_to_finish(tmp_path):
    """The release, run as handed out: only the test cells fail (their checks say "finish
    this exercise first"); every demo that needs an exercise says which one, no traceback."""
    nb, _ = _execute("labs", tmp_path, allow_errors=True)
    said = set()
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        errors = [o for o in cell.outputs if o.output_type == "error"]
        if is_test(cell):
            assert errors and "finish this exercise first" in str(errors[0]), cell.id
        else:
            assert not errors, f"{cell.id} raised: {errors[0].get('evalue', '')}"
        said |= set(re.findall(r"finish exercises? ([\d and]+) first", _text(cell)))
    assert {"1", "2", "3", "4", "5"} <= {n for s in said for n in re.findall(r"\d", s)}


# --- property: the verdict must not depend on the draw ---------------------------------------

PROPERTY_SEEDS = range(100)
# the reference and the other right variants: every 5th draw (each run of a data-parallel
# step costs a replica per shard; the solution and every mistake see all 100 draws)
VARIANT_SEEDS = set(range(0, 100, 5))


@pytest.mark.parametrize("gid", GIDS)
def test_property_verdict_does_not_depend_on_the_draw(gid):
    """On 100 draws of the fixed case set, under the grader's full judge: the solution passes
    (the reference and every right variant on 20 of them); every mistake fails, with its own
    diagnosis.

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
        for name, ns in rights.items():
            if name != "solution" and seed not in VARIANT_SEEDS:
                continue
            # the wrong outputs are judged below, each with its own diagnosis
            assert_verdicts(judge, seed, inputs, ex.run(ns, inputs, None), {})
        for name, (m, _) in wrongs.items():
            with pytest.raises(CheckFailed, match=re.escape(m.reason)):
                judge(inputs, wrong_outputs[name])
