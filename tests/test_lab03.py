"""Lab 3's checks, tested directly: the references pass every judge, the mistakes fail theirs.

The judges are the grader's (``full_judge``: the kit's oracle judge, then the instructor's
exact checks and diagnoses). Fast tests feed them outputs computed in this process, over
100 draws of the fixed case sets; the slow ones run the references and the mistakes beyond
the grader's rounds on real gloo groups (3 ranks, runs on 2 and 3 of them) through the
exercises' own ``run_rank``, and the notebook's visible checks under torchrun. The typical
mistakes of ``ddp_lab/answers/lab03/mistakes.py`` are graded for real, outside any kernel,
by ``tests/test_mistakes.py``. The checker's pieces (slow network, faked GPU node, bucketing
oracle) and the notebook's demonstrations are in ``tests/test_lab03_parts.py``.
"""

from __future__ import annotations

import pytest
import torch
from _dist_workers import lab03_mistakes_worker, lab03_reference_worker
from _harness import assert_verdicts, solution_sources, spawn_gloo
from _lab03_sim import (
    EXERCISES,
    LAB,
    eval_outputs,
    judge_of,
    own_ddp_outputs,
    train_outputs,
)

from ddp_lab.answers.lab03 import references as ref
from ddp_lab.answers.lab03.mistakes import FORGED_FILES, MISTAKES, MORE_MISTAKES, REFUSED
from ddp_lab.answers.lab03.wrong_sources import (
    bucketed,
    ddp_train,
    my_ddp,
    sampler,
    warmup_steps_for,
)
from ddp_lab.checks import lab03 as checks
from ddp_lab.checks.failure import CheckFailed
from ddp_lab.checks.lab03 import ex1_shard_sampler, ex5_bucketed_ddp, ex6_warmup_steps
from ddp_lab.checks.runner import split_magics

#: Draws whose inputs are checked for every edge case (cheap: nothing is run).
SEEDS = range(200)
#: Draws fed to the judges (outputs simulated in this process, right and wrong).
PROPERTY_SEEDS = range(100)


def _fails_with(grade_id: str, inputs: dict, outputs: dict, reason: str, kit: bool = False):
    """The (kit's or grader's) judge rejects ``outputs`` with ``reason`` in its message."""
    judge = EXERCISES[grade_id].judge if kit else judge_of(grade_id)
    with pytest.raises(CheckFailed) as err:
        judge(inputs, outputs)
    assert reason in str(err.value), str(err.value)


def _ns(source: str) -> dict:
    code, _ = split_magics(source)
    ns: dict = {}
    exec(compile(code, "<test>", "exec"), ns)  # noqa: S102 - our own sources
    return ns


def _mistakes(cell: str) -> list:
    return [m for m in MISTAKES if m.cell == cell]


def _inputs(grade_id: str, seed: int) -> dict:
    return EXERCISES[grade_id].make_inputs(torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------- ex1 and ex6


@pytest.mark.timeout(240)
@pytest.mark.parametrize("cell", ["ex1_shard_sampler", "ex6_warmup_steps"])
def test_property_pure_function_verdicts_do_not_depend_on_the_draw(cell, tmp_path):
    """100 draws: the solution passes the grader's judge; every mistake of the exercise fails
    it, with its own diagnosis."""
    gid = f"test_{cell}"
    ex, judge = EXERCISES[gid], judge_of(gid)
    right = _ns(solution_sources(LAB)[cell])
    wrongs = {m.name: (_ns(m.source), m.reason) for m in _mistakes(cell)}
    assert len(wrongs) >= 5
    for seed in PROPERTY_SEEDS:
        inputs = _inputs(gid, seed)
        outs = {name: ex.run(ns, inputs, tmp_path) for name, (ns, _) in wrongs.items()}
        assert_verdicts(judge, seed, inputs, ex.run(right, inputs, tmp_path), outs)
        for name, (_, reason) in wrongs.items():
            with pytest.raises(CheckFailed) as err:
                judge(inputs, outs[name])
            assert reason in str(err.value), f"seed {seed}, {name}: {err.value}"


@pytest.mark.timeout(60)
def test_the_reference_sampler_is_torchs_distributed_sampler():
    for n in (1, 2, 3, 7, 10, 22, 79):
        for w in (1, 2, 3, 4, 5):
            for shuffle in (True, False):
                for drop_last in (True, False):
                    case = {"n": n, "world_size": w, "shuffle": shuffle}
                    case.update(drop_last=drop_last, seed=12345)
                    for epoch in (0, 1, 3):
                        want = ex1_shard_sampler.sampler_shards(case, epoch)
                        got = []
                        for r in range(w):
                            s = ref.MySampler(n, r, w, shuffle, 12345, drop_last)
                            s.set_epoch(epoch)
                            assert len(s) == len(want[r])
                            got.append(list(s))
                        assert got == want, (n, w, shuffle, drop_last, epoch)


@pytest.mark.timeout(60)
def test_the_mistake_builders_give_right_answers_by_default(tmp_path):
    """The builders behind the typical mistakes are sound: their defaults pass."""
    for gid, source in (
        ("test_ex1_shard_sampler", sampler()),
        ("test_ex6_warmup_steps", warmup_steps_for()),
    ):
        ex = EXERCISES[gid]
        for seed in range(5):
            inputs = _inputs(gid, seed)
            assert judge_of(gid)(inputs, ex.run(_ns(source), inputs, tmp_path))
    for source in (ddp_train(), my_ddp(), bucketed()):
        compile(split_magics(source)[1].popitem()[1], "<mistake>", "exec")


@pytest.mark.timeout(60)
def test_visible_pure_function_checks_pass_fail_and_refuse_stubs(capsys):
    sol1 = _ns(solution_sources(LAB)["ex1_shard_sampler"])["MySampler"]
    sol6 = _ns(solution_sources(LAB)["ex6_warmup_steps"])["warmup_steps_for"]
    checks.shard_sampler(sol1)
    checks.warmup_steps_for(sol6)
    out = capsys.readouterr().out
    assert "OK: the shards of DistributedSampler" in out
    assert "OK: warmup_steps_for gives the shortest warm-up" in out
    with pytest.raises(CheckFailed, match="epoch 1 reads exactly what epoch 0 read"):
        checks.shard_sampler(_ns(_mistakes("ex1_shard_sampler")[0].source)["MySampler"])
    with pytest.raises(CheckFailed, match=r"raises the rate by 1\.25 x base_lr"):
        checks.warmup_steps_for(_ns(_mistakes("ex6_warmup_steps")[0].source)["warmup_steps_for"])

    class Stub:
        def __init__(self, *args, **kwargs):
            pass

        def set_epoch(self, epoch):
            pass

        def __len__(self):
            raise NotImplementedError()

    def stub(*args, **kwargs):
        raise NotImplementedError()

    with pytest.raises(CheckFailed, match="finish this exercise first"):
        checks.shard_sampler(Stub)
    with pytest.raises(CheckFailed, match="finish this exercise first"):
        checks.warmup_steps_for(stub)


# --------------------------------------------------------------------------- ex2, simulated

#: name -> (what goes wrong in the simulation, the grader's reason)
TRAIN_WRONGS = {
    "sampler pads": ({"sampler_drop_last": False}, "padded with repeated samples"),
    "loader keeps the last batch": ({"loader_drop_last": False}, "incomplete last batch"),
    "seed 0": ({"seed": 0}, "follow seed 0, not `seed`"),
    "no set_epoch": ({"set_epoch": False}, "set_epoch"),
    "device from RANK": ({"gpu": "rank", "train": True}, "RANK counts the processes of every"),
    "no set_device": ({"gpu": "no_set_device", "train": True}, "never made cuda:"),
    "gloo with GPUs": ({"gpu": "gloo", "train": True}, "with GPUs use NCCL"),
    "nccl without GPUs": ({"cpu_backend": "nccl"}, "where CUDA is not available"),
    "cuda without GPUs": ({"cpu_device": "cuda:0"}, "where CUDA is not available"),
}


@pytest.mark.timeout(300)
def test_property_train_verdict_does_not_depend_on_the_draw():
    """100 draws: simulated DDP passes; each mistake changes what the ranks read or what
    setup() says, whatever the draw, and fails with its diagnosis."""
    gid = "test_ex2_ddp_train"
    judge = judge_of(gid)
    for seed in PROPERTY_SEEDS:
        inputs = _inputs(gid, seed)
        right = train_outputs(inputs)
        wrongs = {
            name: train_outputs(inputs, **{"train": False, **kw})
            for name, (kw, _) in TRAIN_WRONGS.items()
        }
        assert_verdicts(judge, seed, inputs, right, wrongs)
        for name, (_, reason) in TRAIN_WRONGS.items():
            with pytest.raises(CheckFailed, match=reason):
                judge(inputs, wrongs[name])


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "wrong,reason,kit_reason",
    [
        ("alone", "trained alone", "different weights"),
        ("summed", "summed, not averaged", "mean cross-entropy"),
        ("log_everywhere", "called log() too", None),
        ("save_wrapper", "module.", None),
        ("no_teardown", "teardown()", None),
        ("short_job", "expected the results of 3 ranks", None),
    ],
)
def test_train_judge_names_each_mistake(wrong, reason, kit_reason):
    inputs = _inputs("test_ex2_ddp_train", 5)
    outputs = train_outputs(inputs, wrong=wrong)
    _fails_with("test_ex2_ddp_train", inputs, outputs, reason)
    _fails_with("test_ex2_ddp_train", inputs, outputs, kit_reason or reason, kit=True)


# --------------------------------------------------------------------------- ex3, simulated


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "shards,reduce,reason",
    [
        ("exact", "sum", None),
        ("padded", "sum", "DistributedSampler pads"),
        ("everything everywhere", "sum", "scored by rank 1 and rank 0"),
        ("exact", "mean of accuracies", "mean of the ranks' accuracies"),
        ("exact", "none", "sum the counts"),
        ("one rank does all", "sum", "split the data set evenly"),
    ],
)
def test_eval_judge_names_each_mistake(shards, reduce, reason):
    inputs = _inputs("test_ex3_evaluate", 6)
    outs = eval_outputs(inputs, shards, reduce)
    if reason is None:
        assert judge_of("test_ex3_evaluate")(inputs, outs)
    else:
        _fails_with("test_ex3_evaluate", inputs, outs, reason)


@pytest.mark.timeout(120)
def test_property_eval_verdict_does_not_depend_on_the_draw():
    judge = judge_of("test_ex3_evaluate")
    for seed in PROPERTY_SEEDS:
        inputs = _inputs("test_ex3_evaluate", seed)
        wrongs = {
            "padded": eval_outputs(inputs, "padded"),
            "mean of accuracies": eval_outputs(inputs, "exact", "mean of accuracies"),
            "no all_reduce": eval_outputs(inputs, "exact", "none"),
        }
        assert_verdicts(judge, seed, inputs, eval_outputs(inputs, "exact"), wrongs)


# --------------------------------------------------------------------------- ex4/5, simulated

#: name -> (exercises, what goes wrong, the grader's reason)
OWN_DDP_WRONGS = {
    "no broadcast": ("45", {"broadcast": False}, "broadcast every parameter"),
    "no buffers": ("45", {"buffers": False}, "broadcast the buffers too"),
    "summed": ("45", {"reduce": "sum"}, "holds the SUM"),
    "own gradient": ("45", {"reduce": "own"}, "holds its own gradient"),
    "own gradient divided": ("45", {"reduce": "own_divided"}, "holds its own gradient"),
    "frozen gets a grad": ("45", {"frozen_grad": True}, "frozen parameter"),
    "blocking all-reduce": ("45", {"timing": "blocking"}, "start each all-reduce with async_op"),
    "all after backward": ("45", {"timing": "after"}, "started after backward had ended"),
    "waits at once": ("45", {"timing": "waits"}, "do not wait for an all-reduce right after"),
    "a gradient never sent": ("4", {"calls": "missing"}, "expected 5, one per trainable"),
    "forward order": ("5", {"calls": "forward"}, "buckets of the forward order"),
    "a bucket per gradient": ("5", {"calls": "per_gradient"}, "not one per gradient"),
    "cap ignored": ("5", {"calls": "one"}, "close a bucket once it holds at least"),
    "four bytes": ("5", {"calls": "four_bytes"}, "measure a tensor in bytes"),
    "buckets used once": ("5", {"calls": "once"}, "get the buckets ready again"),
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("number", ["4", "5"])
def test_property_own_ddp_verdicts_do_not_depend_on_the_draw(number):
    """100 draws: simulated right wrappers pass; each typical mistake fails with its
    diagnosis (the kit's judge fails them too)."""
    gid = {"4": "test_ex4_my_ddp", "5": "test_ex5_bucketed_ddp"}[number]
    judge = judge_of(gid)
    wrongs = {k: v for k, v in OWN_DDP_WRONGS.items() if number in v[0]}
    for seed in PROPERTY_SEEDS:
        inputs = _inputs(gid, seed)
        outs = {name: own_ddp_outputs(inputs, number, **kw) for name, (_, kw, _) in wrongs.items()}
        assert_verdicts(judge, seed, inputs, own_ddp_outputs(inputs, number), outs)
        for name, (_, _, reason) in wrongs.items():
            with pytest.raises(CheckFailed) as err:
                judge(inputs, outs[name])
            assert reason in str(err.value), f"seed {seed}, {name}: {err.value}"
            if seed == 0:
                _fails_with(gid, inputs, outs[name], "", kit=True)


def test_every_draw_holds_every_edge_case():
    for seed in SEEDS:
        cases = _inputs("test_ex1_shard_sampler", seed)["cases"]
        assert {c["world_size"] for c in cases} == {2, 3, 4}
        assert any(c["n"] == 1 and c["drop_last"] for c in cases)
        assert any(c["n"] == 1 and not c["drop_last"] for c in cases)
        assert any(c["n"] % c["world_size"] == 0 for c in cases)
        assert sum(c["n"] % c["world_size"] != 0 and c["n"] > 1 for c in cases) >= 4
        assert any(not c["shuffle"] for c in cases)
        for gid in ("test_ex2_ddp_train", "test_ex3_evaluate", "test_ex4_my_ddp"):
            (job,) = _inputs(gid, seed)["cases"]
            assert job["world_size"] == 3 and {r["ranks"] for r in job["runs"]} == {2, 3}
        for run in _inputs("test_ex2_ddp_train", seed)["cases"][0]["runs"]:
            assert len(run["y"]) % run["ranks"] and run["epochs"] == 3
        sizes = [
            (len(r["y"]), r["ranks"])
            for r in _inputs("test_ex3_evaluate", seed)["cases"][0]["runs"]
        ]
        assert (1, 2) in sizes and (2, 3) in sizes and any(n % w and n > w for n, w in sizes)
        runs = _inputs("test_ex5_bucketed_ddp", seed)["cases"][0]["runs"]
        counts = [len(ex5_bucketed_ddp.expected_buckets(r)) for r in runs if "cap_bytes" in r]
        assert counts[0] >= 3 and counts[1] == 1 and counts[2] >= 2
        assert {r["dtype"] for r in runs if "dtype" in r} == {"float32", "float64"}
        calls = _inputs("test_ex6_warmup_steps", seed)["calls"]
        ratios = [ex6_warmup_steps.global_batch(c) / c["base_batch"] for c in calls]
        assert any(r > 1 and r == int(r) for r in ratios), "an integer ratio"
        assert any(r > 1 and 0 < r - int(r) < 0.5 for r in ratios), "a fraction below 1/2"
        assert any(r > 1 and r - int(r) > 0.5 for r in ratios), "a fraction above 1/2"
        assert 1.0 in ratios and any(r < 1 for r in ratios)
        samples = [(c["warmup_samples"], ex6_warmup_steps.global_batch(c)) for c in calls]
        assert any(s == 0 for s, _ in samples) and any(s and s % g for s, g in samples)
        assert any(s and s % g == 0 for s, g in samples)
        assert {2, 3} <= {c["world_size"] for c in calls}
        assert any(c["accum_steps"] > 1 for c in calls)


# --------------------------------------------------------------------------- real gloo groups


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_references_pass_the_distributed_judges_on_real_groups(tmp_path):
    """ex2 to ex5's references, run on every rank of a 3-rank gloo job (runs on 2 and 3 of
    them) by the exercises' own ``run_rank``, pass the grader's judge."""
    seed = 11
    spawn_gloo(lab03_reference_worker, 3, str(tmp_path), seed, timeout=300)
    for gid in (
        "test_ex2_ddp_train",
        "test_ex3_evaluate",
        "test_ex4_my_ddp",
        "test_ex5_bucketed_ddp",
    ):
        outs = [torch.load(tmp_path / f"{gid}-{r}.pt", weights_only=True) for r in range(3)]
        assert judge_of(gid)(_inputs(gid, seed), {"cases": [outs]})


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_more_mistakes_fail_their_exercise_on_real_groups(tmp_path):
    """The mistakes beyond the grader's rounds, on real groups and the grader's full judge."""
    seed = 3
    spawn_gloo(lab03_mistakes_worker, 3, str(tmp_path), seed, timeout=420)
    for m in MORE_MISTAKES:
        gid = f"test_{m.cell}"
        outs = [torch.load(tmp_path / f"{m.name}-{r}.pt", weights_only=True) for r in range(3)]
        _fails_with(gid, _inputs(gid, seed), {"cases": [outs]}, m.reason)


def test_refused_mistakes_are_refused(tmp_path, monkeypatch):
    import torch.distributed as dist

    from ddp_lab.checks.lab03 import ex4_my_ddp, own_ddp

    monkeypatch.chdir(tmp_path)
    for m in REFUSED:
        name, text = split_magics(m.source)[1].popitem()
        (tmp_path / name).write_text(text)
        run = own_ddp.run_spec(torch.Generator().manual_seed(0), 1)
        case = {"world_size": 1, "runs": [run]}
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            with pytest.raises(RuntimeError, match=m.reason):
                ex4_my_ddp.run_rank({}, {"cases": [case]}, case, 0, 1)
        finally:
            dist.destroy_process_group()


# --------------------------------------------------------------------------- visible checks


def _solution_file(cell: str) -> tuple[str, str]:
    _, files = split_magics(solution_sources(LAB)[cell])
    return next(iter(files.items()))


FILE_CELLS = ("ex2_ddp_train", "ex3_evaluate", "ex4_my_ddp", "ex5_bucketed_ddp")


@pytest.fixture
def solution_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("NBGRADER_EXECUTION", raising=False)
    for cell in FILE_CELLS:
        name, text = _solution_file(cell)
        (tmp_path / name).write_text(text)
    return tmp_path


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_visible_checks_pass_on_the_solutions(solution_files, capsys):
    checks.ddp_train("ddp_train.py")
    checks.evaluate("evaluate.py")
    checks.my_ddp("my_ddp.py")
    checks.bucketed_ddp("bucketed_ddp.py")
    out = capsys.readouterr().out
    assert out.count("OK:") == 4, out
    assert sorted(p.name for p in solution_files.iterdir()) == [
        "bucketed_ddp.py",
        "ddp_train.py",
        "evaluate.py",
        "my_ddp.py",
    ], "a visible check left files next to the notebook"


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_visible_checks_name_the_typical_mistakes(solution_files):
    for cell, check in (
        ("ex2_ddp_train", checks.ddp_train),
        ("ex3_evaluate", checks.evaluate),
        ("ex4_my_ddp", checks.my_ddp),
        ("ex5_bucketed_ddp", checks.bucketed_ddp),
    ):
        mistake = _mistakes(cell)[0]
        name, text = next(iter(split_magics(mistake.source)[1].items()))
        (solution_files / name).write_text(text)
        with pytest.raises(CheckFailed, match=mistake.reason):
            check(name)


@pytest.mark.timeout(60)
def test_visible_checks_refuse_stubs_without_starting_processes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("NBGRADER_EXECUTION", raising=False)
    for cell, fn in zip(
        FILE_CELLS,
        (checks.ddp_train, checks.evaluate, checks.my_ddp, checks.bucketed_ddp),
        strict=True,
    ):
        name = _solution_file(cell)[0]
        with pytest.raises(CheckFailed, match=f"%%writefile {name}"):
            fn(name)
        (tmp_path / name).write_text("# YOUR CODE HERE\nraise NotImplementedError()\n")
        with pytest.raises(CheckFailed, match="finish this exercise first"):
            fn(name)


@pytest.mark.timeout(60)
def test_visible_torchrun_checks_defer_to_the_grader_under_autograde(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # no files at all: a check that ran would fail
    monkeypatch.setenv("NBGRADER_EXECUTION", "autograde")
    checks.ddp_train()
    checks.evaluate()
    checks.my_ddp()
    checks.bucketed_ddp()
    assert capsys.readouterr().out.count("run by the grader") == 4


def test_mistakes_cover_every_exercise_and_forged_files_are_the_solution_files():
    assert {m.cell for m in MISTAKES} == {ex.cells[0] for ex in checks.EXERCISES}
    assert set(FORGED_FILES) == {_solution_file(c)[0] for c in FILE_CELLS}
    assert FORGED_FILES["bucketed_ddp.py"] == _solution_file("ex5_bucketed_ddp")[1]
