"""Lab 7 (beyond data parallelism): its checks and the facts they rest on.

- the case sets cover every edge case in every draw (200 seeds, inputs only);
- over 100 seeds, the judges (kit oracle + the grader's hidden part) accept the right
  outputs and reject each typical wrong one, built without student processes;
- on real ranks (one gloo job of 3 processes per exercise): the reference and the notebook's
  solution pass: the sharded AdamW equals ``torch.optim.AdamW`` to 1e-6 after 10 steps on 2
  and 3 ranks (a frozen parameter and one without a gradient at some steps skipped as AdamW
  skips them, by reduce-scatter and all-gather), the pipeline equals the unsplit model
  (all forwards before any backward), the tensor-parallel layers equal
  ``nn.Linear`` forward and backward; every other mistake fails with its reason;
- the visible checks pass on the solutions and fail on a mistake with its message;
- facts: FSDP2 (``fully_shard``) runs on the CPU with gloo and trains DDP's weights with a
  half of the memory per rank on 2 ranks; an ideal GPipe schedule's bubble is
  ``(p - 1) / (m + p - 1)``; the memory walker counts storages; a deadlocking pipeline is
  stopped and leaves no process.

The real grader runs (full marks, zero, mistakes, cheat) are in ``test_grading.py`` and
``test_mistakes.py``.
"""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _harness import GradedLab, assert_verdicts, lab_notebook, new_leftovers, saved, spawn_gloo

from ddp_lab.answers.lab07 import MISTAKES, MORE_MISTAKES
from ddp_lab.answers.lab07 import hidden as hid
from ddp_lab.answers.lab07 import references as ref
from ddp_lab.checks import lab07 as checks
from ddp_lab.checks.contract import exercises
from ddp_lab.checks.failure import CheckFailed
from ddp_lab.checks.lab07 import ex1_memory as ex1
from ddp_lab.checks.lab07 import ex2_zero as ex2
from ddp_lab.checks.lab07 import ex3_pipeline as ex3
from ddp_lab.checks.lab07 import ex4_tensor_parallel as ex4
from ddp_lab.checks.lab07 import ex5_activations as ex5
from ddp_lab.checks.runner import STUB, namespace, run_ranks
from ddp_lab.checks.values import plain
from ddp_lab.parallel import hybrid, memory, timeline

LAB = checks.LAB
#: Draws whose inputs are checked for every edge case (cheap: nothing is run).
SEEDS = range(200)
#: Draws fed to the judges (outputs built in this process, right and wrong).
PROPERTY_SEEDS = range(100)
#: Draws for the costlier wrong answers (the typical one runs over all PROPERTY_SEEDS).
FEW = range(0, 100, 25)
GRADED = GradedLab(LAB)
SOURCES, EXERCISES = GRADED.sources, GRADED.exercises
_judge, _inputs, _saved = GRADED.judge, GRADED.inputs, saved


def _file(source: str) -> str:
    return source.split("\n", 1)[1]


# --- the case sets ---------------------------------------------------------------------------


def test_every_draw_holds_every_edge_case():
    for seed in SEEDS:
        cases = _inputs("test_ex1_memory", seed)["cases"]
        assert {(c["world"], c["stage"]) for c in cases} == {
            (w, s) for w in (1, 2, 3, 8) for s in range(4)
        }
        totals = {sum(ex1.numels(c["model"])) for c in cases}
        assert any(n % 6 in (1, 5) for n in totals) and any(n % 6 == 0 for n in totals)
        assert any(n < 3 for n in totals), "more ranks than numbers"
        assert {c["model"]["bytes"] for c in cases} == {2, 4, 8}

        runs = _inputs("test_ex2_zero", seed)["cases"][0]["runs"]
        assert [r["ranks"] for r in runs] == [3, 3, 3, 2, 2]
        sizes = [sum(math.prod(s) for s in r["shapes"]) for r in runs]
        assert sizes[0] % 3 and sizes[1] == 2 and sizes[3] % 2, "uneven chunks, an empty one"
        assert {r["dtype"] for r in runs} == {"float32", "float64"}
        assert all(len(r["grads"]) == ex2.STEPS >= 10 for r in runs)
        assert any([1] in r["shapes"] for r in runs), "a one-number parameter"
        assert [bool(r["frozen"]) for r in runs] == [True, False, True, True, False]
        assert [bool(r["skips"]) for r in runs] == [True, False, False, True, False]
        assert 0 in next(iter(runs[0]["skips"].values())), "no gradient at the first step"
        for r in runs:
            assert not r["frozen"] or r["weight_decay"] >= 0.03, "decay moves a zeroed one"
            for i, steps in r["skips"].items():
                assert int(i) not in r["frozen"] and len(set(steps)) == 2
            if r["max_norm"] is None:
                continue
            norms = [
                float(
                    torch.cat([g.reshape(-1) for g in ex2.mean_grads(r, k) if g is not None]).norm()
                )
                for k in range(len(r["grads"]))
            ]
            assert min(norms) < r["max_norm"] < max(norms), "some steps clip, some do not"
        assert sum(r["max_norm"] is None for r in runs) == 2

        pipes = _inputs("test_ex3_pipeline", seed)["cases"][0]["runs"]
        assert [(r["stages"], r["micro"]) for r in pipes] == [(3, 1), (3, 4), (2, 3), (2, 2)]
        assert {r["dtype"] for r in pipes} == {"float32", "float64"}
        for r in pipes:
            assert all(len(ex3.stage_layers(r, s)) >= 1 for s in range(r["stages"]))

        subs = _inputs("test_ex4_tensor_parallel", seed)["cases"][0]["subs"]
        assert [(s["kind"], s["ranks"]) for s in subs] == [
            ("column", 3),
            ("row", 3),
            ("mlp", 3),
            ("column", 2),
            ("row", 2),
            ("row", 2),
            ("mlp", 2),
        ]
        for s in subs:
            split = s["fc1"]["weight"].shape[0 if s["kind"] in ("column", "mlp") else 1]
            assert split % s["ranks"], "the split dimension does not divide by the ranks"
        assert {s["x"].dim() for s in subs} == {2, 3}
        no_bias = {s["kind"] for s in subs if s["fc1"]["bias"] is None}
        assert no_bias == {"column", "row"}, "a column and a row layer without bias"
        assert any(s["kind"] == "row" and s["fc1"]["bias"] is not None for s in subs)

        acts = _inputs("test_ex5_activations", seed)["cases"]
        assert {c["bytes"] for c in acts} == {4, 8}
        assert any(c["batch"] == c["seq"] == c["heads"] == 1 for c in acts), "one token, one head"
        assert any(c["batch"] == 1 < c["seq"] for c in acts) and any(c["batch"] > 1 for c in acts)
        assert any(c["heads"] == 1 < c["seq"] for c in acts) and any(c["heads"] > 1 for c in acts)
        assert all(c["width"] % c["heads"] == 0 for c in acts)
        assert max(ex5.oracle(c) for c in acts) > 5e9, "a GPT-2-sized block of several GB"


# --- judges over 100 draws (outputs built without student processes) ------------------------


def test_memory_judge_accepts_the_reference_and_rejects_every_mistake_every_draw():
    gid = "test_ex1_memory"
    mistakes = {
        m.name: namespace({m.cell: m.source}, [m.cell]) for m in MISTAKES if m.cell == "ex1_memory"
    }
    for seed in PROPERTY_SEEDS:
        inputs = _inputs(gid, seed)
        right = _saved(ex1.run({"memory_per_rank": ref.memory_per_rank}, inputs, None))
        wrongs = {n: _saved(ex1.run(ns, inputs, None)) for n, ns in mistakes.items()}
        assert_verdicts(_judge(gid), seed, inputs, right, wrongs)


def test_activations_judge_accepts_the_reference_and_names_every_mistake_every_draw():
    """Every draw: the reference passes; every arithmetic mistake fails with its own reason
    (the measuring one is refused before any judge: ``test_activation_bytes_that_...``)."""
    gid = "test_ex5_activations"
    mistakes = [
        m for m in MISTAKES if m.cell == "ex5_activations" and "import torch" not in m.source
    ]
    assert len(mistakes) >= 8
    spaces = {m.name: namespace({m.cell: m.source}, [m.cell]) for m in mistakes}
    judge = _judge(gid)
    for seed in PROPERTY_SEEDS:
        inputs = _inputs(gid, seed)
        judge(inputs, _saved(ex5.run({"activation_bytes": ref.activation_bytes}, inputs, None)))
        for m in mistakes:
            with pytest.raises(CheckFailed, match=m.reason.replace("/", ".")):
                judge(inputs, _saved(ex5.run(spaces[m.name], inputs, None)))


def test_activation_bytes_that_builds_or_measures_tensors_is_refused_with_one_message():
    """The function runs with PyTorch refused: a block built on the meta device and
    measured, or a formula computed in tensors, fails the visible check with the reason."""
    cheat = next(m for m in MISTAKES if m.name == "measures_a_block")
    fn = namespace({cheat.cell: cheat.source}, [cheat.cell])["activation_bytes"]
    with pytest.raises(CheckFailed, match=cheat.reason):
        checks.activations(fn)
    with pytest.raises(CheckFailed, match="not build or measure tensors"):
        checks.activations(lambda b, t, c, h, e: int(torch.tensor(e * b * t * c) * 16))
    with pytest.raises(CheckFailed, match="expected a whole number of bytes, got a str"):
        checks.activations(lambda *sizes: "many")


def _summed(spec: dict) -> list[list[torch.Tensor | None]]:
    """Each step's gradients summed over the ranks (not averaged), None where none."""
    return [
        [
            torch.stack(g).sum(0) if ex2.has_grad(spec, i, s) else None
            for i, g in enumerate(zip(*step, strict=True))
        ]
        for s, step in enumerate(spec["grads"])
    ]


def _zero_outputs(inputs: dict, how: str = "right", oracles: list | None = None) -> dict:
    """Every rank's outputs as a right (or wrong) ShardedAdamW would give them (``oracles``:
    AdamW's parameters of each run, when computed already)."""
    case = inputs["cases"][0]
    ranks = [[] for _ in range(case["world_size"])]
    for i, spec in enumerate(case["runs"]):
        n = sum(math.prod(s) for s in spec["shapes"])
        size = torch.empty((), dtype=ex2.DTYPES[spec["dtype"]]).element_size()
        params = {
            "right": lambda spec=spec, i=i: oracles[i] if oracles else ex2.oracle(spec),
            "steps_everything": lambda spec=spec, i=i: oracles[i] if oracles else ex2.oracle(spec),
            "all_reduce_params": lambda spec=spec: hid._averaged_updates(spec)[0],
            "sums_gradients": lambda spec=spec: ex2.oracle(spec, _summed(spec).__getitem__),
            "zero_grad_for_frozen": lambda spec=spec: ex2.oracle(spec, hid._zero_for_none(spec)),
            "all_reduce_gradients": lambda spec=spec, i=i: (
                oracles[i] if oracles else ex2.oracle(spec)
            ),
        }[how]()
        held = 2 * n * size if how == "steps_everything" else 3 * -(-n // spec["ranks"]) * size
        padded = spec["ranks"] * -(-n // spec["ranks"])
        norm = [["all_reduce", 1]] if spec["max_norm"] is not None else []
        calls = [["reduce_scatter_single", padded], *norm, ["all_gather_single", padded]]
        if how == "all_reduce_gradients":  # DDP's exchange, then the rank's own slice
            calls = [["all_reduce", n], ["all_gather", padded]]
        steps = [calls] * ex2.STEPS
        for r in range(case["world_size"]):
            out = {"params": params, "held": held, "calls": steps}
            ranks[r].append(out if r < spec["ranks"] else None)
    return _saved({"cases": [ranks]})


def test_zero_judge_accepts_adamw_and_rejects_the_mistakes_every_draw():
    judge = _judge("test_ex2_zero")
    for seed in PROPERTY_SEEDS:
        inputs = _inputs("test_ex2_zero", seed)
        oracles = [ex2.oracle(spec) for spec in inputs["cases"][0]["runs"]]
        names = (
            "zero_grad_for_frozen",
            "steps_everything",
            "all_reduce_params",
            "sums_gradients",
            "all_reduce_gradients",
        )
        wrongs = {
            n: _zero_outputs(inputs, n, oracles) for n in (names if seed in FEW else names[:1])
        }
        assert_verdicts(judge, seed, inputs, _zero_outputs(inputs, "right", oracles), wrongs)
    inputs = _inputs("test_ex2_zero", 0)
    reasons = (
        "was given a zero gradient",
        "ZeRO keeps about three",
        "moved 1/N",
        "summed the ranks",
        "a reduce-scatter gives it just",
    )
    for name, reason in zip(names, reasons, strict=True):
        with pytest.raises(CheckFailed, match=reason):
            judge(inputs, _zero_outputs(inputs, name))


def _pipeline_outputs(inputs: dict, how: str = "right") -> dict:
    case = inputs["cases"][0]
    ranks = [[] for _ in range(case["world_size"])]
    for spec in case["runs"]:
        p, m = spec["stages"], spec["micro"]
        steps = [ex3.oracle(spec, step) for step in spec["steps"]]
        for r in range(case["world_size"]):
            if r >= p:
                ranks[r].append(None)
                continue
            out = []
            for want in steps:
                grads = [g for i in ex3.stage_layers(spec, r) for g in want["grads"][i]]
                if how == "no_gradient_sent_back" and r < p - 1:
                    grads = [None] * len(grads)
                if how == "loss_not_divided":
                    grads = [g * m for g in grads]
                last = [want["loss"], want["outputs"]] if r == p - 1 else None
                order = "FB" * m if how == "one_micro_batch_at_a_time" else "F" * m + "B" * m
                out.append({"grads": grads, "result": last, "order": order})
            ranks[r].append(out)
    return _saved({"cases": [ranks]})


def test_pipeline_judge_accepts_the_unsplit_model_and_rejects_the_mistakes_every_draw():
    judge = _judge("test_ex3_pipeline")
    names = ("no_gradient_sent_back", "loss_not_divided", "one_micro_batch_at_a_time")
    for seed in PROPERTY_SEEDS:
        inputs = _inputs("test_ex3_pipeline", seed)
        wrongs = {n: _pipeline_outputs(inputs, n) for n in (names if seed in FEW else names[:1])}
        assert_verdicts(judge, seed, inputs, _pipeline_outputs(inputs), wrongs)
    inputs = _inputs("test_ex3_pipeline", 0)
    for name in names:
        reason = next(m.reason for m in MISTAKES + MORE_MISTAKES if m.name == name)
        with pytest.raises(CheckFailed, match=reason):
            judge(inputs, _pipeline_outputs(inputs, name))


def _tp_outputs(inputs: dict, how: str = "right") -> dict:
    case = inputs["cases"][0]
    ranks = [[] for _ in range(case["world_size"])]
    for spec in case["subs"]:
        want, n = ex4.oracle(spec), spec["ranks"]
        for r in range(case["world_size"]):
            if r >= n:
                ranks[r].append(None)
                continue
            y, xg = want["y"], want["x_grad"]
            if spec["kind"] == "column":
                y = y[..., ex4.owned(y.shape[-1], r, n)]
            if spec["kind"] == "row":
                xg = xg[..., ex4.owned(xg.shape[-1], r, n)]
            last = spec["fc2" if spec["kind"] == "mlp" else "fc1"]["bias"]
            if how == "row_bias_every_rank" and spec["kind"] != "column" and last is not None:
                y = y + (n - 1) * last
            calls = ex4.EXPECTED_CALLS[spec["kind"]]
            layers = {k: ex4._parts(spec, k, v, r) for k, v in want["layers"].items()}
            for k, v in want["layers"].items():
                if v.bias is None:
                    layers[k]["bias"] = None
            ranks[r].append(
                {
                    "y": y,
                    "x_grad": xg,
                    "layers": layers,
                    "forward_calls": dict(calls[0]),
                    "backward_calls": dict(calls[1]),
                }
            )
    return _saved({"cases": [ranks]})


def test_tensor_parallel_judge_accepts_nn_linear_and_rejects_the_mistake_every_draw():
    judge = _judge("test_ex4_tensor_parallel")
    for seed in PROPERTY_SEEDS:
        inputs = _inputs("test_ex4_tensor_parallel", seed)
        wrongs = {"row_bias_every_rank": _tp_outputs(inputs, "row_bias_every_rank")}
        assert_verdicts(judge, seed, inputs, _tp_outputs(inputs), wrongs)
    with pytest.raises(CheckFailed, match="added the bias on every rank"):
        judge(inputs, wrongs["row_bias_every_rank"])


# --- real ranks: references, solutions, the other mistakes -----------------------------------


def _ranks_worker(rank: int, world: int, tmp: str, gid: str, jobs: list) -> None:
    """Each job ``(name, file text, seed)``: the exercise's run_rank in its own folder."""
    ex = exercises(LAB)[gid]
    home = os.getcwd()
    for name, text, seed in jobs:
        inputs = ex.make_inputs(torch.Generator().manual_seed(seed))
        folder = Path(tmp) / name
        if rank == 0:
            folder.mkdir()
            (folder / ex.files[0]).write_text(text)
        dist.barrier()
        os.chdir(folder)
        try:
            out = plain(ex.run_rank({}, inputs, inputs["cases"][0], rank, world))
        finally:
            os.chdir(home)
        torch.save(out, Path(tmp) / f"{name}-rank{rank}.pt")
        dist.barrier()


_RAN: dict[str, dict] = {}


def _on_ranks(gid: str) -> dict[str, tuple[dict, dict]]:
    """``name -> (inputs, outputs)`` for the reference (seed 1), the notebook's solution
    (seed 2) and the exercise's other mistakes (seed 3), from one gloo job of 3 ranks."""
    if gid not in _RAN:
        ex = EXERCISES[gid]
        cell = gid.removeprefix("test_")
        jobs = [("reference", ref.FILES[ex.files[0]], 1), ("solution", _file(SOURCES[cell]), 2)]
        jobs += [(m.name, _file(m.source), 3) for m in MORE_MISTAKES if m.cell == cell]
        with tempfile.TemporaryDirectory() as tmp:
            spawn_gloo(_ranks_worker, 3, tmp, gid, jobs, timeout=240)
            _RAN[gid] = {
                name: (
                    ex.make_inputs(torch.Generator().manual_seed(seed)),
                    {
                        "cases": [
                            [
                                torch.load(Path(tmp) / f"{name}-rank{r}.pt", weights_only=True)
                                for r in range(3)
                            ]
                        ]
                    },
                )
                for name, _, seed in jobs
            }
    return _RAN[gid]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sharded_adamw_equals_adamw_after_10_steps_on_2_and_3_ranks():
    for name in ("reference", "solution"):
        inputs, outputs = _on_ranks("test_ex2_zero")[name]
        assert "equals torch.optim.AdamW" in _judge("test_ex2_zero")(inputs, outputs)
        for spec, got in zip(
            inputs["cases"][0]["runs"], zip(*outputs["cases"][0], strict=True), strict=True
        ):
            want = ex2.oracle(spec)
            worst = max(
                float((g - w).abs().max())
                for rank_out in got[: spec["ranks"]]
                for g, w in zip(rank_out["params"], want, strict=True)
            )
            print(f"{name}: {ex2.run_text(spec)}: max |ShardedAdamW - AdamW| = {worst:.2e}")
            assert worst <= 1e-6 and len(want) >= 10
            assert all(o["held"] <= ex2.bound(spec) for o in got[: spec["ranks"]])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_pipeline_outputs_and_gradients_equal_the_unsplit_model():
    for name in ("reference", "solution"):
        inputs, outputs = _on_ranks("test_ex3_pipeline")[name]
        assert "equals the unsplit model" in _judge("test_ex3_pipeline")(inputs, outputs)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tensor_parallel_layers_equal_nn_linear_forward_and_backward():
    for name in ("reference", "solution"):
        inputs, outputs = _on_ranks("test_ex4_tensor_parallel")[name]
        assert "equal nn.Linear forward and backward" in _judge("test_ex4_tensor_parallel")(
            inputs, outputs
        )


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("mistake", MORE_MISTAKES, ids=lambda m: m.name)
def test_more_mistakes_fail_their_exercise_with_their_reason(mistake):
    gid = f"test_{mistake.cell}"
    inputs, outputs = _on_ranks(gid)[mistake.name]
    with pytest.raises(CheckFailed, match=mistake.reason):
        _judge(gid)(inputs, outputs)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_row_layer_that_assumes_a_bias_raises_on_the_bias_less_case_with_its_reason(tmp_path):
    """``row_assumes_bias`` (``y + self.bias``) is right wherever there is a bias: the grading
    run's row layer without one makes every rank of its group raise, and the error the
    grader quotes (rank_worker under torchrun) names the case and that it has no bias."""
    mistake = next(m for m in MISTAKES if m.name == "row_assumes_bias")
    ex = EXERCISES["test_ex4_tensor_parallel"]
    folder, work = tmp_path / "student", tmp_path / "work"
    folder.mkdir()
    work.mkdir()
    (folder / "tp.py").write_text(_file(mistake.source))
    inputs = ex.make_inputs(torch.Generator().manual_seed(3))
    with pytest.raises(CheckFailed, match=mistake.reason) as failed:
        run_ranks(ex, LAB, inputs, work, folder, ex.timeout)
    said = str(failed.value)
    assert "TypeError" in said and "tp.py line" in said, said
    assert "RowParallelLinear over 2 ranks" in said and "no bias" in said, said


# --- visible checks ---------------------------------------------------------------------------


def test_visible_activations_check_passes_the_solution_and_fails_a_mistake(capsys):
    checks.activations(namespace(SOURCES, ["ex5_activations"])["activation_bytes"])
    assert "matches the bytes measured" in capsys.readouterr().out
    bad = next(m for m in MISTAKES if m.name == "scores_and_weights")
    with pytest.raises(CheckFailed, match="should be 16,345 bytes"):
        checks.activations(namespace({bad.cell: bad.source}, [bad.cell])["activation_bytes"])


def test_visible_memory_check_passes_the_solution_and_names_a_mistake(capsys):
    checks.memory(namespace(SOURCES, ["ex1_memory"])["memory_per_rank"])
    assert capsys.readouterr().out.startswith("OK: ")
    bad = next(m for m in MISTAKES if m.name == "zero2_full_grads")
    with pytest.raises(CheckFailed, match="'grads' should be"):
        checks.memory(namespace({bad.cell: bad.source}, [bad.cell])["memory_per_rank"])
    with pytest.raises(CheckFailed, match="finish this exercise first"):
        checks.memory(lambda *a: (_ for _ in ()).throw(NotImplementedError()))


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_visible_distributed_checks_run_the_files_under_torchrun(tmp_path, capsys):
    for cell in ("ex2_zero", "ex3_pipeline", "ex4_tensor_parallel"):
        name = SOURCES[cell].split("\n", 1)[0].split()[-1]
        (tmp_path / name).write_text(_file(SOURCES[cell]))
    checks.zero(str(tmp_path / "zero.py"))
    checks.pipeline(str(tmp_path / "pipeline.py"))
    checks.tensor_parallel(str(tmp_path / "tp.py"))
    assert capsys.readouterr().out.count("OK: ") == 3
    bad = next(m for m in MISTAKES if m.name == "row_bias_every_rank")
    (tmp_path / "tp.py").write_text(_file(bad.source))
    with pytest.raises(CheckFailed, match="forward output differs"):
        checks.tensor_parallel(str(tmp_path / "tp.py"))
    (tmp_path / "zero.py").write_text(
        f"class ShardedAdamW:\n    def step(self):\n        {STUB}()\n"
    )
    with pytest.raises(CheckFailed, match="finish this exercise first"):
        checks.zero(str(tmp_path / "zero.py"))


# --- facts ------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fsdp_runs_on_the_cpu_with_gloo_and_trains_ddps_weights_with_half_the_memory(tmp_path):
    from ddp_lab.launch import torchrun

    (tmp_path / "zero.py").write_text(ref.FILES["zero.py"])
    res = torchrun(
        "ddp_lab.parallel.compare",
        ["--zero", "zero.py", "--width", "64"],
        nproc=2,
        module=True,
        timeout=240,
        cwd=str(tmp_path),
        stream=False,
    ).result
    runs = res["runs"]
    assert set(runs) == {"ddp", "zero1 (torch)", "zero (yours)", "fsdp"}
    assert all(r["max_abs_diff"] < 1e-5 for r in runs.values()), runs
    n = res["parameters"]
    for part in ("params", "grads"):
        assert all(row[part] == 4 * n for row in runs["ddp"]["ranks"])
        assert sum(row[part] for row in runs["fsdp"]["ranks"]) == 4 * n
        assert all(row[part] < 4 * n for row in runs["fsdp"]["ranks"])
    assert all(row["optimizer"] == 8 * n for row in runs["ddp"]["ranks"])
    assert sum(row["optimizer"] for row in runs["zero1 (torch)"]["ranks"]) == 8 * n
    counters = 4 * len(res["numels"])  # AdamW's 0-d step counters, one per parameter's piece
    assert all(
        row["optimizer"] <= 3 * 4 * -(-n // 2) + counters for row in runs["zero (yours)"]["ranks"]
    )


def _demo_script(cell_id: str) -> str:
    """The file a notebook's ``%%writefile`` demonstration cell writes."""
    cell = next(c for c in lab_notebook(LAB)["cells"] if c["id"] == cell_id)
    return "".join(cell["source"]).split("\n", 1)[1]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_1f1b_holds_p_minus_s_micro_batches_gpipe_all_m_with_the_same_bubble(tmp_path):
    """Section 4's schedules demonstration as the notebook writes it, on 4 gloo ranks with
    the solution's pipeline.py: torch's GPipe and the student's hold all 8 micro-batches on
    every stage, torch's 1F1B 4, 3, 2, 1; the bubbles agree within a few points, near
    (p - 1) / (m + p - 1) = 27 %."""
    from ddp_lab.launch import torchrun

    (tmp_path / "pipeline.py").write_text(ref.FILES["pipeline.py"])
    (tmp_path / "schedules_demo.py").write_text(_demo_script("onefb_script"))
    res = torchrun("schedules_demo.py", nproc=4, timeout=240, cwd=str(tmp_path), stream=False)
    runs = res.result["runs"]
    peaks = {name: [timeline.peak_held(e) for e in events] for name, events in runs.items()}
    assert peaks == {
        "GPipe (torch)": [8, 8, 8, 8],
        "1F1B (torch)": [4, 3, 2, 1],
        "your gpipe_step": [8, 8, 8, 8],
    }
    bubbles = [timeline.bubble(e) for e in runs.values()]
    assert all(0.2 < b < 0.5 for b in bubbles), bubbles
    assert max(bubbles) - min(bubbles) < 0.1, bubbles


def test_an_ideal_gpipe_schedule_idles_the_formulas_share():
    tf, tb = 1.0, 2.0
    for p in (2, 3, 4):
        for m in (1, 2, 4, 8):
            events = [
                [("F", (s + i) * tf, (s + i + 1) * tf) for i in range(m)]
                + [
                    (
                        "B",
                        (m + p - 1) * tf + (p - 1 - s + i) * tb,
                        (m + p - 1) * tf + (p - s + i) * tb,
                    )
                    for i in range(m)
                ]
                for s in range(p)
            ]
            assert timeline.bubble(events) == pytest.approx(timeline.gpipe_bubble(p, m))


def test_memory_counts_storages_once_and_leaves_out_the_excluded():
    w = torch.zeros(10)
    holder = {"view": w[2:4], "own": torch.ones(3, dtype=torch.float64), "again": w}
    assert memory.held_bytes(holder) == 40 + 24  # the view keeps all of w alive
    assert memory.held_bytes(holder, exclude=[w]) == 24
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(5))])
    opt.param_groups[0]["params"][0].grad = torch.ones(5)
    opt.step()
    assert memory.optimizer_bytes(opt) == 2 * 5 * 4


def test_hybrid_layout_groups_cover_every_rank_once_per_kind():
    groups = hybrid.layout(dp=2, tp=4, pp=2)
    for kind, size in (("tensor", 4), ("pipeline", 2), ("data", 2)):
        assert sorted(r for g in groups[kind] for r in g) == list(range(16))
        assert all(len(g) == size for g in groups[kind])
    assert groups["tensor"][0] == [0, 1, 2, 3], "tensor groups are neighbours (one node)"
    node = {r: r // 8 for r in range(16)}  # two nodes of 8 GPUs
    assert all(len({node[r] for r in g}) == 1 for g in groups["tensor"] + groups["data"])
    assert all(len({node[r] for r in g}) == 2 for g in groups["pipeline"]), "stages across nodes"
    for r in range(16):  # the notebook's formula r = (pp d + dd) t + tt, pipeline outermost
        d, p, t = hybrid.coords(r, dp=2, tp=4)
        assert (p * 2 + d) * 4 + t == r
    plan = hybrid.plan(8, 64, 16, 32, 2, 2, 2, 4, ref.memory_per_rank, zero_stage=1)
    assert plan["params"] == 12 * 64 * 64 * 8 // 4 and plan["bubble"] == pytest.approx(1 / 5)


def test_hybrid_plan_keeps_adamw_state_in_float32_16_bytes_per_parameter():
    """bf16 parameters and gradients (2 + 2), fp32 master weights and moments (12)."""
    n = 12 * 64 * 64 * 8 // 4
    whole = hybrid.plan(8, 64, 16, 32, 2, 2, 2, 4, ref.memory_per_rank, zero_stage=0)
    assert whole["memory"] == {
        "params": 2 * n,
        "grads": 2 * n,
        "optimizer": 12 * n,
        "total": 16 * n,
    }
    fp32 = hybrid.plan(8, 64, 16, 32, 2, 2, 2, 4, ref.memory_per_rank, 0, 4, 4)
    assert fp32["memory"]["total"] == 16 * n and fp32["memory"]["optimizer"] == 8 * n
    sharded = hybrid.plan(8, 64, 16, 32, 2, 2, 2, 4, ref.memory_per_rank, zero_stage=1)
    assert sharded["memory"]["optimizer"] == 12 * n // 2


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_deadlocking_pipeline_is_stopped_and_leaves_no_process(tmp_path):
    (tmp_path / "pipeline.py").write_text(
        "import torch, torch.distributed as dist\n\n\n"
        "def gpipe_step(stage, n_stages, n_micro, inputs, targets, act_shape, loss_fn):\n"
        "    t = torch.zeros(act_shape)\n"
        "    dist.recv(t, src=(dist.get_rank() + 1) % n_stages)  # everyone waits: no send\n"
    )
    before = set(os.listdir("/proc"))
    ex = EXERCISES["test_ex3_pipeline"]
    inputs = ex.visible_inputs(torch.Generator().manual_seed(0))
    work = tmp_path / "work"
    work.mkdir()
    with pytest.raises(CheckFailed, match="did not finish within"):
        run_ranks(ex, LAB, inputs, work, tmp_path, timeout=25)
    assert not new_leftovers(before, str(tmp_path))


def test_gpipe_step_is_never_called_on_a_rank_past_the_last_stage(tmp_path, monkeypatch):
    """The docstring's contract: ranks from n_stages on do not call gpipe_step (rank 2 of the
    two-stage runs gets None without the student's function running)."""
    (tmp_path / "pipeline.py").write_text(
        "def gpipe_step(*args):\n    raise AssertionError('called on a rank past the pipeline')\n"
    )
    monkeypatch.chdir(tmp_path)
    inputs = _inputs("test_ex3_pipeline", 0)
    case = inputs["cases"][0]
    two = {**case, "runs": [r for r in case["runs"] if r["stages"] == 2]}
    assert len(two["runs"]) == 2
    assert ex3.run_rank({}, inputs, two, 2, 3) == [None, None]
