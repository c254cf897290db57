"""Lab 3's checks, tested directly: the references pass every judge, the mistakes fail theirs.

The judges are the grader's (``full_judge``: the kit's oracle judge, then the instructor's
exact checks and diagnoses). Fast tests feed them outputs computed in this process, over
200 draws for the property tests; one test runs the references on real gloo groups through
the exercises' own ``run_rank``; the slow ones run the notebook's visible checks under
torchrun. Every mistake of ``ddp_lab/answers/lab03/mistakes.py`` is also graded for real,
outside any kernel, by ``tests/test_mistakes.py``.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from _dist_workers import lab03_reference_worker
from _harness import assert_verdicts, lab_notebook, solution_sources, spawn_gloo
from torch.utils.data import DataLoader, DistributedSampler

from ddp_lab.answers import full_judge, hidden
from ddp_lab.answers.lab03 import references as ref
from ddp_lab.answers.lab03.mistakes import FORGED_FILES, MISTAKES
from ddp_lab.checks import lab03 as checks
from ddp_lab.checks.failure import CheckFailed
from ddp_lab.checks.lab03 import common, ex1_shard_indices, ex2_ddp_train, ex3_evaluate, ex4_my_ddp
from ddp_lab.checks.runner import split_magics
from ddp_lab.grading.notebook import is_test, nbgrader_meta

LAB = "lab03_ddp"
EXERCISES = {ex.grade_id: ex for ex in checks.EXERCISES}
PROPERTY_SEEDS = range(200)


def _judge(grade_id: str):
    """The grader's judge of an exercise: the kit's, then the hidden check and diagnoses."""
    return full_judge(EXERCISES[grade_id], hidden(LAB).get(grade_id))


def _fails_with(grade_id: str, inputs: dict, outputs: dict, reason: str, kit: bool = False):
    """The (kit's or grader's) judge rejects ``outputs`` with ``reason`` in its message."""
    judge = EXERCISES[grade_id].judge if kit else _judge(grade_id)
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


# --------------------------------------------------------------------------- ex1 and ex5


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cell", ["ex1_shard_indices", "ex5_scaled_lr"])
def test_property_pure_function_verdicts_do_not_depend_on_the_draw(cell, tmp_path):
    """200 draws: the solution passes the grader's judge; every mistake of the exercise fails
    it, with its own diagnosis."""
    gid = f"test_{cell}"
    ex, judge = EXERCISES[gid], _judge(gid)
    right = _ns(solution_sources(LAB)[cell])
    wrongs = {m.name: (_ns(m.source), m.reason) for m in _mistakes(cell)}
    assert len(wrongs) >= 5
    for seed in PROPERTY_SEEDS:
        inputs = ex.make_inputs(torch.Generator().manual_seed(seed))
        outs = {name: ex.run(ns, inputs, tmp_path) for name, (ns, _) in wrongs.items()}
        assert_verdicts(judge, seed, inputs, ex.run(right, inputs, tmp_path), outs)
        for name, (_, reason) in wrongs.items():
            with pytest.raises(CheckFailed) as err:
                judge(inputs, outs[name])
            assert reason in str(err.value), f"seed {seed}, {name}: {err.value}"


@pytest.mark.timeout(60)
def test_reference_shards_are_distributed_samplers():
    for n in (1, 2, 7, 22, 79):
        for w in (1, 2, 3, 4):
            for epoch, seed in ((0, 0), (1, 0), (3, 12345)):
                want = ex1_shard_indices.sampler_shards(n, w, epoch, seed)
                assert ref.shuffled_shards(n, w, epoch, seed) == want, (n, w, epoch, seed)


@pytest.mark.timeout(60)
def test_references_pass_the_pure_function_judges(tmp_path):
    ns1 = {"shard_indices": lambda n, r, w, e, s=0: ref.shuffled_shards(n, w, e, s)[r]}
    ns5 = {"scaled_lr": ref.expected_scaled_lr, "warmup_lr": ref.expected_warmup_lr}
    for gid, ns in (("test_ex1_shard_indices", ns1), ("test_ex5_scaled_lr", ns5)):
        ex = EXERCISES[gid]
        for seed in range(20):
            inputs = ex.make_inputs(torch.Generator().manual_seed(seed))
            assert _judge(gid)(inputs, ex.run(ns, inputs, tmp_path))


@pytest.mark.timeout(60)
def test_visible_pure_function_checks_pass_fail_and_refuse_stubs(capsys):
    sol1 = _ns(solution_sources(LAB)["ex1_shard_indices"])["shard_indices"]
    sol5 = _ns(solution_sources(LAB)["ex5_scaled_lr"])
    checks.shard_indices(sol1)
    checks.learning_rates(sol5["scaled_lr"], sol5["warmup_lr"])
    out = capsys.readouterr().out
    assert "OK: the shards of DistributedSampler" in out and "OK: scaled_lr keeps" in out
    # the typical mistakes, with the kit's diagnosis
    with pytest.raises(CheckFailed, match="epoch 1 reads exactly what epoch 0 read"):
        checks.shard_indices(_ns(_mistakes("ex1_shard_indices")[0].source)["shard_indices"])
    sqrt = _ns(_mistakes("ex5_scaled_lr")[0].source)
    with pytest.raises(CheckFailed, match="proportional to the global batch"):
        checks.learning_rates(sqrt["scaled_lr"], sqrt["warmup_lr"])
    no_ramp = _ns(next(m for m in _mistakes("ex5_scaled_lr") if m.name == "warmup_no_ramp").source)
    with pytest.raises(CheckFailed, match="starts at base_lr"):
        checks.learning_rates(no_ramp["scaled_lr"], no_ramp["warmup_lr"])

    def stub(*args, **kwargs):
        raise NotImplementedError()

    with pytest.raises(CheckFailed, match="finish this exercise first"):
        checks.shard_indices(stub)
    with pytest.raises(CheckFailed, match="finish this exercise first"):
        checks.learning_rates(stub, sol5["warmup_lr"])


@pytest.mark.timeout(60)
def test_a_warmup_that_crashes_on_zero_steps_is_said_in_one_line(tmp_path):
    crash = _ns(
        "def scaled_lr(base_lr, base_batch, batch_size, world_size, accum_steps=1):\n"
        "    return base_lr * batch_size * world_size * accum_steps / base_batch\n"
        "def warmup_lr(step, base_lr, peak_lr, warmup_steps):\n"
        "    return min(peak_lr, base_lr + (peak_lr - base_lr) * step / warmup_steps)\n"
    )
    ex = EXERCISES["test_ex5_scaled_lr"]
    inputs = ex.make_inputs(torch.Generator().manual_seed(3))
    outputs = ex.run(crash, inputs, tmp_path)
    _fails_with(ex.grade_id, inputs, outputs, "warmup_steps=0) raised ZeroDivisionError")
    _fails_with(ex.grade_id, inputs, outputs, "with warmup_steps = 0 the rate is peak_lr at once")


# --------------------------------------------------------------------------- ex2, simulated


def _train_case(world: int = 2, seed: int = 5) -> dict:
    return ex2_ddp_train.case(torch.Generator().manual_seed(seed), world)


def _simulated_ddp_outputs(
    case: dict,
    sampler_drop_last: bool = True,
    loader_drop_last: bool = True,
    train: bool = True,
    seed: int | None = None,
) -> list[dict]:
    """What every rank of the solution's train() reports, simulated in one process.

    Each rank reads through its own DistributedSampler and DataLoader (as the solution does);
    every step averages the ranks' gradients (what DDP's all-reduce does) on one shared model.
    Without ``train`` only the reads are real (enough for mistakes in what the ranks read).
    """
    w, b = case["world_size"], case["batch_size"]
    model = common.tiny_net(case["dims"], case["init"])
    opt = torch.optim.SGD(model.parameters(), lr=case["lr"])
    datas = [common.RecordingDataset(case["x"], case["y"]) for _ in range(w)]
    samplers = [
        DistributedSampler(
            datas[r],
            num_replicas=w,
            rank=r,
            shuffle=True,
            seed=case["seed"] if seed is None else seed,
            drop_last=sampler_drop_last,
        )
        for r in range(w)
    ]
    loaders = [
        DataLoader(datas[r], batch_size=b, sampler=samplers[r], drop_last=loader_drop_last)
        for r in range(w)
    ]
    for epoch in range(case["epochs"]):
        for sampler in samplers:
            sampler.set_epoch(epoch)
        for batches in zip(*loaders, strict=True):
            if not train:
                continue
            grads = []
            for x, y in batches:
                model.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                grads.append([p.grad.clone() for p in model.parameters()])
            for i, p in enumerate(model.parameters()):
                p.grad = sum(g[i] for g in grads) / w
            opt.step()
    final = common.state(model)
    return [
        {
            "setup": [r, w, "cpu"],
            "calls": [["init", "gloo"], ["setup", ""], ["train", ""], ["destroy", ""]],
            "reads": torch.tensor(datas[r].reads, dtype=torch.long),
            "logged": [f"epoch {e}" for e in range(case["epochs"])] if r == 0 else [],
            "saved": dict(final) if r == 0 else None,
            "final": dict(final),
        }
        for r in range(w)
    ]


@pytest.mark.timeout(120)
def test_property_train_verdict_does_not_depend_on_the_draw():
    """200 draws: simulated DDP passes; a padding sampler or a DataLoader that keeps the
    incomplete batch always changes what the ranks read, and fails with its diagnosis."""
    judge = _judge("test_ex2_ddp_train")
    wrongs = {
        "sampler pads": ({"sampler_drop_last": False}, "padded with repeated samples"),
        "loader keeps the last batch": ({"loader_drop_last": False}, "incomplete last batch"),
        "both": ({"sampler_drop_last": False, "loader_drop_last": False}, "padded"),
        "seed 0": ({"seed": 0}, "follow seed 0, not `seed`"),
    }
    for seed in PROPERTY_SEEDS:
        inputs = EXERCISES["test_ex2_ddp_train"].make_inputs(torch.Generator().manual_seed(seed))
        right = {"cases": [_simulated_ddp_outputs(c) for c in inputs["cases"]]}
        outs = {
            name: {"cases": [_simulated_ddp_outputs(c, train=False, **kw) for c in inputs["cases"]]}
            for name, (kw, _) in wrongs.items()
        }
        assert_verdicts(judge, seed, inputs, right, outs)
        for name, (_, reason) in wrongs.items():
            with pytest.raises(CheckFailed, match=reason):
                judge(inputs, outs[name])


def _alone(case, r, o):
    n, w, b = len(case["y"]), case["world_size"], case["batch_size"]
    steps = []
    for epoch in range(case["epochs"]):
        shard = ex1_shard_indices.sampler_shards(n, w, epoch, case["seed"])[r]
        steps += [shard[k : k + b] for k in range(0, len(shard) - b + 1, b)]
    model = common.tiny_net(case["dims"], case["init"])
    data = common.RecordingDataset(case["x"], case["y"])
    return common.state(common.sgd_on_batches(model, data, steps, case["lr"]))


def _no_set_epoch_reads(case, r, o):
    n, w, b = len(case["y"]), case["world_size"], case["batch_size"]
    shard = ex1_shard_indices.sampler_shards(n, w, 0, case["seed"])[r]
    return torch.tensor(shard[: (len(shard) // b) * b] * case["epochs"])


def _perturbed(r, o):
    return {k: v + (1e-3 if r == 1 else 0.0) for k, v in o["final"].items()}


#: name -> (what changes in the right outputs, the grader's reason, the kit's reason)
TRAIN_MISTAKES = {
    "no init": (dict(calls=[["setup", ""], ["train", ""], ["destroy", ""]]), "0 times", None),
    "nccl on cpu": (dict(calls=[["init", "nccl"], ["destroy", ""]]), "NCCL", None),
    "setup returns env": (dict(setup=["DistEnv(...)"]), "must return (rank, world_size", None),
    "cuda device": (dict(setup=lambda r, o: [r, o["setup"][1], "cuda:0"]), "without GPUs", None),
    "same data": (dict(reads=lambda r, o: torch.arange(10)), "every rank read the same", None),
    "no set_epoch": ("reads", "set_epoch", None),
    "alone": ("alone", "trained alone", "different weights"),
    "summed": ("summed", "summed, not averaged", "mean cross-entropy"),
    "ranks apart": (dict(final=_perturbed), "different weights", None),
    "log everywhere": (dict(logged=["epoch 0", "epoch 1"]), "called log() too", None),
    "log every step": ("log_steps", "once per epoch", None),
    "save everywhere": ("save_all", "saved the model too", None),
    "save nothing": ("save_none", "saved nothing", None),
    "save wrapper": ("save_wrapper", "module.", None),
    "no teardown": (dict(calls=[["init", "gloo"], ["train", ""]]), "teardown()", None),
}


def _mutate(outs: list[dict], rank=None, **changes) -> list[dict]:
    new = [dict(o) for o in outs]
    for r in range(len(new)) if rank is None else [rank]:
        new[r].update({k: (v(r, new[r]) if callable(v) else v) for k, v in changes.items()})
    return new


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_train_judge_accepts_the_simulated_solution(world):
    case = _train_case(world)
    outputs = {"cases": [_simulated_ddp_outputs(case)]}
    assert _judge("test_ex2_ddp_train")({"cases": [case]}, outputs)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(TRAIN_MISTAKES))
def test_train_judge_names_each_mistake(name):
    case = _train_case(2)
    outs = _simulated_ddp_outputs(case)
    change, reason, kit_reason = TRAIN_MISTAKES[name]
    if isinstance(change, dict):
        outs = _mutate(outs, **change)
    elif change == "reads":
        outs = _mutate(outs, reads=lambda r, o: _no_set_epoch_reads(case, r, o))
    elif change == "alone":
        outs = _mutate(outs, final=lambda r, o: _alone(case, r, o))
    elif change == "summed":
        summed = ex2_ddp_train.single_process(case, lr_factor=case["world_size"])
        outs = _mutate(outs, final=summed)
    elif change == "log_steps":
        outs = _mutate(outs, rank=0, logged=["step"] * 7)
    elif change == "save_all":
        outs = _mutate(outs, saved=lambda r, o: o["final"])
    elif change == "save_none":
        outs = _mutate(outs, saved=None)
    elif change == "save_wrapper":
        outs = _mutate(
            outs, rank=0, saved=lambda r, o: {f"module.{k}": v for k, v in o["final"].items()}
        )
    inputs, outputs = {"cases": [case]}, {"cases": [outs]}
    _fails_with("test_ex2_ddp_train", inputs, outputs, reason)
    _fails_with("test_ex2_ddp_train", inputs, outputs, kit_reason or reason, kit=True)


# --------------------------------------------------------------------------- ex3, simulated


def _eval_outputs(case: dict, shards: list[list[int]], reduce: str = "sum") -> list[dict]:
    """What each rank reports when it scores ``shards[rank]`` with ``nn.Linear`` in batches
    and combines the counts by ``reduce`` (``sum``, ``mean of accuracies``, ``none``)."""
    model = torch.nn.Linear(case["weight"].shape[1], case["weight"].shape[0]).double()
    model.load_state_dict({"weight": case["weight"], "bias": case["bias"]})
    b = case["batch_size"]
    right = []
    for s in shards:
        hits = 0
        with torch.no_grad():
            for k in range(0, len(s), b):
                idx = torch.tensor(s[k : k + b], dtype=torch.long)
                hits += int((model(case["x"][idx]).argmax(1) == case["y"][idx]).sum())
        right.append(hits)
    sizes = [len(s) for s in shards]
    outs = []
    for r, s in enumerate(shards):
        c, t = sum(right), sum(sizes)
        acc = c / t
        if reduce == "mean of accuracies":
            acc = sum(x / y for x, y in zip(right, sizes, strict=True)) / len(shards)
        elif reduce == "none":
            c, t, acc = right[r], sizes[r], right[r] / max(1, sizes[r])
        outs.append(
            {"correct": float(c), "total": float(t), "accuracy": acc, "reads": torch.tensor(s)}
        )
    return outs


def _eval_shards(kind: str, n: int, w: int) -> list[list[int]]:
    exact = [list(range(r, n, w)) for r in range(w)]
    padded = list(range(n)) + list(range(math.ceil(n / w) * w - n))
    return {
        "exact": exact,
        "padded": [padded[r::w] for r in range(w)],
        "everything everywhere": [list(range(n))] * w,
        "one rank does all": [list(range(n))] + [[]] * (w - 1),
    }[kind]


@pytest.mark.timeout(60)
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
    inputs = EXERCISES["test_ex3_evaluate"].make_inputs(torch.Generator().manual_seed(6))
    (case,) = inputs["cases"]
    outs = {"cases": [_eval_outputs(case, _eval_shards(shards, len(case["y"]), 2), reduce)]}
    if reason is None:
        assert _judge("test_ex3_evaluate")(inputs, outs)
    else:
        _fails_with("test_ex3_evaluate", inputs, outs, reason)


@pytest.mark.timeout(120)
def test_property_eval_verdict_does_not_depend_on_the_draw():
    judge = _judge("test_ex3_evaluate")
    for seed in PROPERTY_SEEDS:
        inputs = EXERCISES["test_ex3_evaluate"].make_inputs(torch.Generator().manual_seed(seed))
        (case,) = inputs["cases"]
        n, w = len(case["y"]), case["world_size"]
        exact = _eval_shards("exact", n, w)
        wrongs = {
            "padded": _eval_outputs(case, _eval_shards("padded", n, w)),
            "mean of accuracies": _eval_outputs(case, exact, "mean of accuracies"),
            "no all_reduce": _eval_outputs(case, exact, "none"),
        }
        right = {"cases": [_eval_outputs(case, exact)]}
        assert_verdicts(judge, seed, inputs, right, {k: {"cases": [v]} for k, v in wrongs.items()})


# --------------------------------------------------------------------------- ex4, simulated


def _myddp_outputs(case: dict, broadcast=True, buffers=True, reduce="mean") -> list[dict]:
    """What each rank of a (possibly wrong) MyDDP reports, simulated in one process."""
    w, steps = case["world_size"], case["xs"][0].shape[0]
    starts = []
    for r in range(w):
        s = dict(case["inits"][r])
        if broadcast:
            s.update({k: v for k, v in case["inits"][0].items() if k != "scale" or buffers})
        starts.append(s)
    models = [common.tiny_net(case["dims"], s) for s in starts]
    opts = [torch.optim.SGD(m.parameters(), lr=case["lr"]) for m in models]
    grads0 = None
    for step in range(steps):
        grads = []
        for r, m in enumerate(models):
            m.zero_grad()
            loss = torch.nn.functional.cross_entropy(m(case["xs"][r][step]), case["ys"][r][step])
            loss.backward()
            grads.append({k: p.grad.clone() for k, p in m.named_parameters()})
        for r, m in enumerate(models):
            for k, p in m.named_parameters():
                total = sum(g[k] for g in grads)
                p.grad = {"mean": total / w, "sum": total, "none": grads[r][k]}[reduce]
        if step == 0:
            grads0 = [{k: p.grad.clone() for k, p in m.named_parameters()} for m in models]
        for o in opts:
            o.step()
    return [
        {"after_wrap": starts[r], "grads0": grads0[r], "final": common.state(models[r])}
        for r in range(w)
    ]


MYDDP_MISTAKES = {
    # options -> (the grader's reason, the kit's reason)
    "no broadcast": ({"broadcast": False}, "broadcast every parameter", None),
    "no buffers": ({"buffers": False}, "buffers", None),
    "summed": ({"reduce": "sum"}, "SUM", "not the average over the ranks"),
    "not reduced": ({"reduce": "none"}, "holds its own gradient", "not the average over"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", [None, *MYDDP_MISTAKES])
def test_myddp_judge_names_each_mistake(name):
    inputs = EXERCISES["test_ex4_my_ddp"].make_inputs(torch.Generator().manual_seed(7))
    (case,) = inputs["cases"]
    if name is None:
        assert _judge("test_ex4_my_ddp")(inputs, {"cases": [_myddp_outputs(case)]})
        return
    options, reason, kit_reason = MYDDP_MISTAKES[name]
    outs = {"cases": [_myddp_outputs(case, **options)]}
    _fails_with("test_ex4_my_ddp", inputs, outs, reason)
    _fails_with("test_ex4_my_ddp", inputs, outs, kit_reason or reason, kit=True)


@pytest.mark.timeout(120)
def test_property_myddp_verdict_does_not_depend_on_the_draw():
    """200 draws: simulated MyDDP passes; each typical mistake fails with its diagnosis."""
    judge = _judge("test_ex4_my_ddp")
    for seed in PROPERTY_SEEDS:
        inputs = EXERCISES["test_ex4_my_ddp"].make_inputs(torch.Generator().manual_seed(seed))
        (case,) = inputs["cases"]
        wrongs = {
            name: ({"cases": [_myddp_outputs(case, **options)]}, reason)
            for name, (options, reason, _) in MYDDP_MISTAKES.items()
        }
        right = {"cases": [_myddp_outputs(case)]}
        assert_verdicts(judge, seed, inputs, right, {k: v for k, (v, _) in wrongs.items()})
        for outs, reason in wrongs.values():
            with pytest.raises(CheckFailed, match=reason):
                judge(inputs, outs)


# --------------------------------------------------------------------------- references, gloo


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size", [2, 3])
def test_references_pass_the_distributed_judges_on_real_groups(tmp_path, world_size):
    """ex2 to ex4's references, run on every rank of a gloo group by the exercises' own
    ``run_rank``, pass the grader's judge: the oracles and the references agree."""
    seed = 11
    spawn_gloo(lab03_reference_worker, world_size, str(tmp_path), seed, timeout=180)
    for module in (ex2_ddp_train, ex3_evaluate, ex4_my_ddp):
        gid = module.EXERCISE.grade_id
        case = module.case(torch.Generator().manual_seed(seed), world_size)
        outs = [
            torch.load(tmp_path / f"{gid}-{r}.pt", weights_only=True) for r in range(world_size)
        ]
        assert _judge(gid)({"cases": [case]}, {"cases": [outs]})


# --------------------------------------------------------------------------- visible checks


def _solution_file(cell: str) -> tuple[str, str]:
    _, files = split_magics(solution_sources(LAB)[cell])
    return next(iter(files.items()))


@pytest.fixture
def solution_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("NBGRADER_EXECUTION", raising=False)
    for cell in ("ex2_ddp_train", "ex3_evaluate", "ex4_my_ddp"):
        name, text = _solution_file(cell)
        (tmp_path / name).write_text(text)
    return tmp_path


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_visible_checks_pass_on_the_solutions(solution_files, capsys):
    checks.ddp_train("ddp_train.py")
    checks.evaluate("evaluate.py")
    checks.my_ddp("my_ddp.py")
    out = capsys.readouterr().out
    assert out.count("OK:") == 3, out
    assert sorted(p.name for p in solution_files.iterdir()) == [
        "ddp_train.py",
        "evaluate.py",
        "my_ddp.py",
    ], "a visible check left files next to the notebook"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_visible_checks_name_the_typical_mistakes(solution_files):
    path = solution_files / "ddp_train.py"
    path.write_text(path.read_text().replace("sampler.set_epoch(epoch)", "pass"))
    with pytest.raises(CheckFailed, match="set_epoch"):
        checks.ddp_train("ddp_train.py")
    for cell, check, reason in (
        ("ex3_evaluate", checks.evaluate, "DistributedSampler pads"),
        ("ex4_my_ddp", checks.my_ddp, "broadcast every parameter"),
    ):
        name, text = next(iter(split_magics(_mistakes(cell)[0].source)[1].items()))
        (solution_files / name).write_text(text)
        with pytest.raises(CheckFailed, match=reason):
            check(name)


@pytest.mark.timeout(60)
def test_visible_checks_refuse_stubs_without_starting_processes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("NBGRADER_EXECUTION", raising=False)
    for fn, name in (
        (checks.ddp_train, "ddp_train.py"),
        (checks.evaluate, "evaluate.py"),
        (checks.my_ddp, "my_ddp.py"),
    ):
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
    assert capsys.readouterr().out.count("run by the grader") == 3


# --------------------------------------------------------------------------- the notebook


def test_mistakes_cover_every_exercise_and_forged_files_are_the_solution_files():
    assert {m.cell for m in MISTAKES} == {ex.cells[0] for ex in checks.EXERCISES}
    assert set(FORGED_FILES) == {"ddp_train.py", "evaluate.py", "my_ddp.py"}
    assert FORGED_FILES["my_ddp.py"] == _solution_file("ex4_my_ddp")[1]


def test_points_and_notebook_shape():
    cells = lab_notebook(LAB)["cells"]
    points = {nbgrader_meta(c)["grade_id"]: nbgrader_meta(c)["points"] for c in cells if is_test(c)}
    assert points == {
        "test_ex1_shard_indices": 3,
        "test_ex2_ddp_train": 5,
        "test_ex3_evaluate": 3,
        "test_ex4_my_ddp": 5,
        "test_ex5_scaled_lr": 2,
    }
    text = json.dumps(cells)
    for required in ("What goes wrong", "On real GPUs", "Recap", "../../results/lab3/scaling.json"):
        assert required in text, required


@pytest.mark.parametrize("folder", ["solutions", "labs"])
def test_the_notebook_points_at_no_answer_and_uses_only_the_kit(folder):
    text = json.dumps(lab_notebook(LAB, folder)["cells"])
    for pointer in ("course's answer", "reference DDP script", "print0"):
        assert pointer not in text, pointer
    for instructor_only in ("ddp_lab.answers", "checks.verdict", "ddp_lab.bench"):
        assert instructor_only not in text, instructor_only
    grading = [line for line in text.split("\\n") if "ddp_lab.grading" in line]
    assert all("hidden_test" in line for line in grading), grading


def test_the_learning_rate_figure_draws_the_students_functions():
    from ddp_lab.figures import lab03 as figures

    calls = []

    def scaled(base_lr, base_batch, batch_size, world_size):
        calls.append(world_size)
        return base_lr * world_size

    fig = figures.lr_schedules(scaled, lambda s, b, p, w: p, 0.1, 32, 32, [1, 2, 4], 5, 10)
    assert calls == [1, 2, 4] and len(fig.axes[0].lines) == 3 + 1  # + the end of warm-up

    def stub(*args):
        raise NotImplementedError()

    with pytest.raises(NotImplementedError):
        figures.lr_schedules(stub, stub, 0.1, 32, 32, [1], 5, 10)
