"""Lab 1's checks, tested directly: the solutions pass every judge, the mistakes fail theirs.

The solution code comes from the committed solutions notebook (the source of truth), run
in this process through each exercise's ``run`` and ``judge`` exactly as the grader chains
them (inputs and outputs go through ``torch.save`` / ``torch.load(weights_only=True)``).
The real nbgrader runs of the sample class are in ``test_grading.py``.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

import mistakes_lab01
import pytest
import torch

from ddp_lab.checks import CheckFailed
from ddp_lab.checks import lab01 as checks
from ddp_lab.grading.exercise import exercises
from ddp_lab.grading.notebook import is_test, load, nbgrader_meta, solution_sources, source_of

ROOT = Path(__file__).resolve().parent.parent
LAB = mistakes_lab01.LAB
NOTEBOOK = ROOT / "solutions" / LAB / f"{LAB}.ipynb"
SOURCES = solution_sources(load(NOTEBOOK))
EXERCISES = exercises(LAB)
GIDS = list(EXERCISES)
SEEDS = range(8)

# test cell -> (the function its visible check takes, what the typical mistake's message says)
TYPICAL = {
    "test_ex1_split_batch": ("split_batch", r"are lost.*remainder"),
    "test_ex2_average_gradients": ("average_gradients", r"sum of the replicas' gradients"),
    "test_ex3_data_parallel_gradients": ("data_parallel_gradients", r"plain average.*B_k / B"),
    "test_ex4_combine_shard_stats": ("combine_shard_stats", r"plain average of the shard means"),
    "test_ex5_dataparallel_step_time": ("dataparallel_step_time", r"leaves out a parameter"),
}

# more wrong answers: (test cell, solution source, what the message must say)
OTHER_MISTAKES = {
    "split_with_torch_chunk": (
        "test_ex1_split_batch",
        """
import torch
def split_batch(x, y, n):
    return list(zip(torch.chunk(x, n), torch.chunk(y, n)))
""",
        r"expected \d+ shards|differ by more than one",
    ),
    "split_shuffles": (
        "test_ex1_split_batch",
        """
import torch
def split_batch(x, y, n):
    perm = torch.randperm(x.shape[0])
    sizes = [len(t) for t in torch.tensor_split(torch.arange(x.shape[0]), n)]
    return list(zip(torch.split(x[perm], sizes), torch.split(y[perm], sizes)))
""",
        r"do not give back x",
    ),
    "split_keeps_all_targets": (
        "test_ex1_split_batch",
        """
import torch
def split_batch(x, y, n):
    return [(xk, y) for xk in torch.tensor_split(x, n)]
""",
        r"inputs but \d+ targets",
    ),
    "split_returns_tensor": (
        "test_ex1_split_batch",
        """
import torch
def split_batch(x, y, n):
    return x  # forgot to split
""",
        r"expected a list of \d+ \(x_k, y_k\) pairs",
    ),
    "average_keeps_first_replica": (
        "test_ex2_average_gradients",
        """
def average_gradients(grads_per_replica):
    return list(grads_per_replica[0])
""",
        r"replica 0's gradients",
    ),
    "average_over_parameters": (
        "test_ex2_average_gradients",
        """
import torch
def average_gradients(grads_per_replica):
    return [sum(g.sum() for g in grads) / len(grads) for grads in grads_per_replica]
""",
        r"expected|averaged gradient",
    ),
    "replicas_share_the_model_and_accumulate": (
        "test_ex3_data_parallel_gradients",
        """
import torch
def data_parallel_gradients(model, shards, loss_fn):
    total = sum(len(xk) for xk, _ in shards)
    combined = [torch.zeros_like(p) for p in model.parameters()]
    for xk, yk in shards:
        loss_fn(model(xk), yk).backward()  # no copy, no zero_grad
        for acc, p in zip(combined, model.parameters()):
            acc += p.grad * (len(xk) / total)
    return combined
""",
        r"expected the full-batch gradient",
    ),
    "right_values_but_model_grads_left": (
        "test_ex3_data_parallel_gradients",
        """
import torch
def data_parallel_gradients(model, shards, loss_fn):
    total = sum(len(xk) for xk, _ in shards)
    combined = [torch.zeros_like(p) for p in model.parameters()]
    for xk, yk in shards:
        model.zero_grad()
        loss_fn(model(xk), yk).backward()
        for acc, p in zip(combined, model.parameters()):
            acc += p.grad * (len(xk) / total)
    return combined
""",
        r"now holds gradients.*copy\.deepcopy",
    ),
    "summed_shard_gradients": (
        "test_ex3_data_parallel_gradients",
        """
import copy
import torch
def data_parallel_gradients(model, shards, loss_fn):
    out = [torch.zeros_like(p) for p in model.parameters()]
    for xk, yk in shards:
        replica = copy.deepcopy(model)
        loss_fn(replica(xk), yk).backward()
        for acc, p in zip(out, replica.parameters()):
            acc += p.grad
    return out
""",
        r"sum of the shard gradients",
    ),
    "variance_without_the_spread_of_means": (
        "test_ex4_combine_shard_stats",
        """
import torch
def combine_shard_stats(means, variances, counts):
    w = counts.to(means.dtype).unsqueeze(1) / counts.sum()
    return (w * means).sum(0), (w * variances).sum(0)
""",
        r"leaves out how far the shard means lie",
    ),
    "unbiased_variance": (
        "test_ex4_combine_shard_stats",
        """
import torch
def combine_shard_stats(means, variances, counts):
    b = counts.sum()
    w = counts.to(means.dtype).unsqueeze(1) / b
    mean = (w * means).sum(0)
    var = (w * (variances + (means - mean) ** 2)).sum(0)
    return mean, var * b / (b - 1)
""",
        r"unbiased variance",
    ),
    "forgets_the_gil": (
        "test_ex5_dataparallel_step_time",
        """
def dataparallel_step_time(n, *, compute_s, param_bytes, batch_bytes, output_bytes,
                           bandwidth, host_s):
    return (compute_s / n + 2 * (n - 1) * param_bytes / bandwidth
            + (n - 1) / n * (batch_bytes + 2 * output_bytes) / bandwidth + host_s)
""",
        r"n threads launch one after another under the GIL: n \* host_s",
    ),
    "gathers_outputs_only_once": (
        "test_ex5_dataparallel_step_time",
        """
def dataparallel_step_time(n, *, compute_s, param_bytes, batch_bytes, output_bytes,
                           bandwidth, host_s):
    return (compute_s / n + 2 * (n - 1) * param_bytes / bandwidth
            + (n - 1) / n * (batch_bytes + output_bytes) / bandwidth + n * host_s)
""",
        r"expected [\d.e+-]+ s \(compute .*\), got .*gradients go out again",
    ),
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


def namespace(source: str) -> dict:
    """What the student process builds from one solution cell's source."""
    ns: dict = {"__name__": "__student__"}
    exec(compile(source, "<cell>", "exec"), ns)  # noqa: S102
    return ns


def through_disk(value, path: Path):
    """Save and reload as the grader does (``weights_only=True``)."""
    torch.save(value, path)
    return torch.load(path, weights_only=True)


def judge(gid: str, source: str, seed: int, tmp_path: Path) -> str:
    """Draw inputs with ``seed``, run ``source`` on them, judge the outputs."""
    ex = EXERCISES[gid]
    inputs = through_disk(ex.make_inputs(torch.Generator().manual_seed(seed)), tmp_path / "in.pt")
    outputs = ex.run(namespace(source), inputs, tmp_path)
    return ex.judge(inputs, through_disk(outputs, tmp_path / "out.pt"))


def cell_of(gid: str) -> str:
    (cell,) = EXERCISES[gid].cells
    return cell


# --- the lab's shape ------------------------------------------------------------------------


def test_five_independent_exercises_worth_fifteen_points():
    cells = load(NOTEBOOK)["cells"]
    points = {nbgrader_meta(c)["grade_id"]: nbgrader_meta(c)["points"] for c in cells if is_test(c)}
    assert list(points) == GIDS
    assert sum(points.values()) == 15 and all(p >= 2 for p in points.values())
    for gid, ex in EXERCISES.items():
        assert ex.cells == (gid.removeprefix("test_"),), f"{gid} must judge its own cell only"
        assert ex.run is not None and ex.timeout <= 60
    assert set(mistakes_lab01.MISTAKES) == {cell_of(g) for g in GIDS}


def test_solution_cells_import_what_they_use():
    """The grader runs each solution cell alone: it may not lean on the setup cell."""
    for gid in GIDS:
        ns = namespace(SOURCES[cell_of(gid)])
        assert callable(ns[TYPICAL[gid][0]])


def test_test_cells_call_their_visible_check_and_verdict():
    cells = {nbgrader_meta(c).get("grade_id"): source_of(c) for c in load(NOTEBOOK)["cells"]}
    for gid, (name, _) in TYPICAL.items():
        assert f"checks.{name}({name})" in cells[gid]
        assert f'checks.verdict("{gid}")' in cells[gid].split("### BEGIN HIDDEN TESTS")[1]


# --- the judges -----------------------------------------------------------------------------


@pytest.mark.parametrize("gid", GIDS)
def test_solution_passes_its_judge_on_fresh_inputs(gid, tmp_path):
    for seed in SEEDS:
        message = judge(gid, SOURCES[cell_of(gid)], seed, tmp_path)
        assert isinstance(message, str) and message


@pytest.mark.parametrize("case", list(RIGHT_VARIANTS))
def test_other_right_answers_pass_their_judge(case, tmp_path):
    gid, right = RIGHT_VARIANTS[case]
    for seed in SEEDS:
        judge(gid, right, seed, tmp_path)
    name = TYPICAL[gid][0]
    getattr(checks, name)(namespace(right)[name])


@pytest.mark.parametrize("gid", GIDS)
def test_typical_mistake_fails_its_judge_with_a_helpful_message(gid, tmp_path):
    wrong = mistakes_lab01.MISTAKES[cell_of(gid)]
    for seed in SEEDS:
        with pytest.raises(CheckFailed, match=TYPICAL[gid][1]):
            judge(gid, wrong, seed, tmp_path)


@pytest.mark.parametrize("case", list(OTHER_MISTAKES))
def test_other_mistakes_fail_their_judge_with_a_helpful_message(case, tmp_path):
    gid, wrong, says = OTHER_MISTAKES[case]
    for seed in SEEDS:
        with pytest.raises(CheckFailed, match=says):
            judge(gid, wrong, seed, tmp_path)


@pytest.mark.parametrize("gid", GIDS)
def test_no_op_stub_fails_its_judge(gid, tmp_path):
    """The released stub with ``pass`` (what the sample class's cheater submits)."""
    name = TYPICAL[gid][0]
    stub = f"def {name}(*args, **kwargs):\n    pass\n"
    with pytest.raises(CheckFailed):
        judge(gid, stub, 0, tmp_path)


@pytest.mark.parametrize("gid", GIDS)
def test_forged_outputs_fail_its_judge(gid):
    """Outputs written by hand: a constant, a wrong structure, zeros of the right kind."""
    ex = EXERCISES[gid]
    inputs = ex.make_inputs(torch.Generator().manual_seed(0))
    key = {
        "test_ex1_split_batch": "results",
        "test_ex2_average_gradients": "averaged",
        "test_ex3_data_parallel_gradients": "grads",
        "test_ex4_combine_shard_stats": "mean",
        "test_ex5_dataparallel_step_time": "times",
    }[gid]
    for forged in ({}, {key: "<NoneType>"}, {key: [torch.zeros(3)] * 3}, {key: []}):
        with pytest.raises(Exception):  # noqa: B017 - the judge process fails any of them
            ex.judge(inputs, forged)


def test_judges_draw_sizes_at_grading_time():
    drawn = [
        {gid: EXERCISES[gid].make_inputs(torch.Generator().manual_seed(s)) for gid in GIDS}
        for s in SEEDS
    ]
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


# --- the visible checks ---------------------------------------------------------------------


@pytest.mark.parametrize("gid", GIDS)
def test_visible_check_passes_the_solution(gid, capsys):
    name = TYPICAL[gid][0]
    getattr(checks, name)(namespace(SOURCES[cell_of(gid)])[name])
    out = capsys.readouterr().out
    assert out.startswith("OK: ") and out.count("\n") == 1


@pytest.mark.parametrize("gid", GIDS)
def test_visible_check_rejects_the_typical_mistake(gid):
    name, says = TYPICAL[gid]
    wrong = namespace(mistakes_lab01.MISTAKES[cell_of(gid)])[name]
    with pytest.raises(CheckFailed, match=says):
        getattr(checks, name)(wrong)


@pytest.mark.parametrize("case", list(OTHER_MISTAKES))
def test_visible_check_rejects_other_mistakes(case):
    gid, wrong, says = OTHER_MISTAKES[case]
    name = TYPICAL[gid][0]
    with pytest.raises(CheckFailed, match=says):
        getattr(checks, name)(namespace(wrong)[name])


def test_visible_check_rejects_the_released_stub():
    for gid in GIDS:
        name = TYPICAL[gid][0]
        stub = namespace(f"def {name}(*args, **kwargs):\n    raise NotImplementedError()\n")
        with pytest.raises(NotImplementedError):
            getattr(checks, name)(stub[name])


# --- references and figures -----------------------------------------------------------------


def test_references_agree_with_their_definitions():
    assert checks.shard_sizes(10, 4) == [3, 3, 2, 2] and checks.shard_sizes(8, 4) == [2] * 4
    kw = dict(
        compute_s=0.5,
        param_bytes=2e9,
        batch_bytes=4e9,
        output_bytes=1e9,
        bandwidth=1e9,
        host_s=0.25,
    )
    assert sum(checks.step_time_terms(1, **kw).values()) == pytest.approx(0.75)
    assert sum(checks.step_time_terms(4, **kw).values()) == pytest.approx(
        0.125 + 6 * 2 + 0.75 * 4 + 2 * 0.75 * 1 + 1.0
    )
    g = torch.Generator().manual_seed(0)
    shards = [torch.randn(c, 3, generator=g, dtype=torch.float64) + c for c in (1, 4, 9)]
    mean, var = checks.reference_combine_shard_stats(
        torch.stack([s.mean(0) for s in shards]),
        torch.stack([s.var(0, unbiased=False) for s in shards]),
        torch.tensor([1, 4, 9]),
    )
    whole = torch.cat(shards)
    torch.testing.assert_close(mean, whole.mean(0))
    torch.testing.assert_close(var, whole.var(0, unbiased=False))


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

    copy = tmp_path / NOTEBOOK.name
    shutil.copy(NOTEBOOK, copy)
    nb = nbformat.read(copy, as_version=4)
    env_before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        start = time.monotonic()
        NotebookClient(
            nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
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
            assert text.count("OK: ") == 2, f"{cell.id}: {text}"  # visible check + verdict
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

# wrong answers that the inputs could, on an unlucky draw, make right: each must fail every seed
LUCKY_MISTAKES = {
    "test_ex1_split_batch": [
        mistakes_lab01.MISTAKES["ex1_split_batch"],
        OTHER_MISTAKES["split_with_torch_chunk"][1],
        """
def split_batch(x, y, n):  # the last shard takes the whole remainder
    size = x.shape[0] // n
    bounds = [k * size for k in range(n)] + [x.shape[0]]
    return [(x[s:e], y[s:e]) for s, e in zip(bounds, bounds[1:])]
""",
    ],
    "test_ex2_average_gradients": [
        mistakes_lab01.MISTAKES["ex2_average_gradients"],
        OTHER_MISTAKES["average_keeps_first_replica"][1],
    ],
    "test_ex3_data_parallel_gradients": [
        mistakes_lab01.MISTAKES["ex3_data_parallel_gradients"],
        OTHER_MISTAKES["summed_shard_gradients"][1],
    ],
    "test_ex4_combine_shard_stats": [
        mistakes_lab01.MISTAKES["ex4_combine_shard_stats"],
        OTHER_MISTAKES["variance_without_the_spread_of_means"][1],
        OTHER_MISTAKES["unbiased_variance"][1],
        """
import torch
def combine_shard_stats(means, variances, counts):  # counts ignored, the formula right
    mean = means.mean(0)
    return mean, (variances + (means - mean) ** 2).mean(0)
""",
    ],
    "test_ex5_dataparallel_step_time": [
        mistakes_lab01.MISTAKES["ex5_dataparallel_step_time"],
        OTHER_MISTAKES["forgets_the_gil"][1],
        OTHER_MISTAKES["gathers_outputs_only_once"][1],
    ],
}


@pytest.mark.parametrize("gid", GIDS)
def test_property_verdict_does_not_depend_on_the_draw(gid):
    """On 200 fresh draws: the solution and every right variant pass, each mistake fails.

    Cheap: ``run`` calls the function in this process (no student process, no disk).
    """
    ex = EXERCISES[gid]
    right = [SOURCES[cell_of(gid)]] + [s for g, s in RIGHT_VARIANTS.values() if g == gid]
    rights = [namespace(s) for s in right]
    wrongs = [namespace(s) for s in LUCKY_MISTAKES[gid]]
    for seed in PROPERTY_SEEDS:
        inputs = ex.make_inputs(torch.Generator().manual_seed(seed))
        for k, ns in enumerate(rights):
            try:
                ex.judge(inputs, ex.run(ns, inputs, None))
            except CheckFailed as err:
                pytest.fail(f"seed {seed}: right answer {k} failed: {err}")
        for k, ns in enumerate(wrongs):
            with pytest.raises(CheckFailed):
                ex.judge(inputs, ex.run(ns, inputs, None))
                pytest.fail(f"seed {seed}: mistake {k} passed")
