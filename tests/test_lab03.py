"""Lab 3's checks, tested directly: the solutions pass every judge, the mistakes fail theirs.

Fast tests feed the judges hand-made outputs (every diagnosis of a wrong answer, without
starting processes); the slow ones grade real code outside any kernel, through the same
``judge_notebook`` the autograder uses, and run the visible checks under torchrun.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import mistakes_lab03 as mistakes
import pytest
import torch
from _harness import assert_verdicts

from ddp_lab.checks import CheckFailed
from ddp_lab.checks import lab03 as checks
from ddp_lab.grading.authoring import notebook, solution
from ddp_lab.grading.notebook import is_solution, load, nbgrader_meta, source_of, split_magics
from ddp_lab.grading.verdict import judge_notebook

ROOT = Path(__file__).resolve().parent.parent
LAB = "lab03_ddp"
SOLUTION_NB = ROOT / "solutions" / LAB / f"{LAB}.ipynb"


def _solutions() -> dict[str, str]:
    return {
        nbgrader_meta(c)["grade_id"]: source_of(c)
        for c in load(SOLUTION_NB)["cells"]
        if is_solution(c)
    }


def _nb(**replace: str) -> dict:
    sources = {**_solutions(), **replace}
    return notebook([solution(gid, src) for gid, src in sources.items()])


def _ns(source: str) -> dict:
    ns: dict = {}
    exec(compile(source, "<test>", "exec"), ns)  # noqa: S102 - our own sources
    return ns


def _file(gid: str) -> tuple[str, str]:
    _, files = split_magics(_solutions()[gid])
    return next(iter(files.items()))


# --------------------------------------------------------------------------- pure functions


def _shard_cases():
    gen = torch.Generator().manual_seed(0)
    return checks._shard_cases(gen) + checks._shard_cases()


WRONG_SHARDS = {
    "global RNG": (
        "def shard_indices(n, rank, world_size, epoch, seed=0):\n"
        "    order = torch.randperm(n)[: n - n % world_size]\n"
        "    return order[rank::world_size].tolist()\n",
        "both read sample",
    ),
    "no shuffle": (
        "def shard_indices(n, rank, world_size, epoch, seed=0):\n"
        "    return list(range(rank, n - n % world_size, world_size))\n",
        "not shuffled",
    ),
    "padded": (
        "def shard_indices(n, rank, world_size, epoch, seed=0):\n"
        "    g = torch.Generator().manual_seed(seed + epoch)\n"
        "    order = torch.randperm(n, generator=g).tolist()\n"
        "    order += order[: -n % world_size]\n"
        "    return order[rank::world_size]\n",
        "padded?",
    ),
    "no epoch": (
        "def shard_indices(n, rank, world_size, epoch, seed=0):\n"
        "    g = torch.Generator().manual_seed(seed)\n"
        "    return torch.randperm(n, generator=g)[: n - n % world_size][rank::world_size]\n",
        "epoch 1 reads exactly what epoch 0 read",
    ),
    "contiguous, seed ignored": (
        "def shard_indices(n, rank, world_size, epoch, seed=0):\n"
        "    g = torch.Generator().manual_seed(epoch)\n"
        "    k = n // world_size\n"
        "    return torch.randperm(n, generator=g)[rank * k : (rank + 1) * k].tolist()\n",
        "another seed gave the same shards",
    ),
}


@pytest.mark.timeout(60)
def test_reference_shard_indices_passes_every_case(capsys):
    fn = _ns(_solutions()["ex1_shard_indices"])["shard_indices"]
    for case in _shard_cases():
        assert checks.shard_problem(case, checks._shard_calls(fn, case)) is None
    checks.shard_indices(fn)
    assert "identical to DistributedSampler" in capsys.readouterr().out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", list(WRONG_SHARDS))
def test_wrong_shard_indices_fail_with_the_reason(name):
    source, reason = WRONG_SHARDS[name]
    fn = _ns("import torch\n" + source)["shard_indices"]
    problems = [checks.shard_problem(c, checks._shard_calls(fn, c)) for c in _shard_cases()]
    assert any(problems), name
    assert reason in next(p for p in problems if p), problems
    with pytest.raises(CheckFailed):
        checks.shard_indices(fn)


WRONG_LRS = {
    "sqrt": ("base_lr * math.sqrt(batch_size * world_size * accum_steps / base_batch)", "square"),
    "none": ("base_lr", "must grow"),
    "no world": ("base_lr * batch_size * accum_steps / base_batch", "times world_size"),
    "no accum": ("base_lr * batch_size * world_size / base_batch", "times accum_steps"),
    "inverted": ("base_lr * base_batch / (batch_size * world_size * accum_steps)", "upside"),
}
GOOD_WARMUP = (
    "def warmup_lr(step, base_lr, peak_lr, warmup_steps):\n"
    "    return peak_lr if step >= warmup_steps else "
    "base_lr + (peak_lr - base_lr) * step / warmup_steps\n"
)


def _lr_source(scaled: str, warmup: str = GOOD_WARMUP) -> str:
    return (
        "import math\n"
        "def scaled_lr(base_lr, base_batch, batch_size, world_size, accum_steps=1):\n"
        f"    return {scaled}\n" + warmup
    )


@pytest.mark.timeout(60)
def test_reference_learning_rates_pass():
    ns = _ns(_solutions()["ex5_scaled_lr"])
    for seed in range(5):
        cases = checks._lr_cases(torch.Generator().manual_seed(seed))
        assert (
            checks.lr_problem(cases, checks._lr_calls(ns["scaled_lr"], ns["warmup_lr"], cases))
            is None
        )
    checks.learning_rates(ns["scaled_lr"], ns["warmup_lr"])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", list(WRONG_LRS))
def test_wrong_scaling_rules_fail_with_the_reason(name):
    expr, reason = WRONG_LRS[name]
    ns = _ns(_lr_source(expr))
    cases = checks._lr_cases(torch.Generator().manual_seed(1))
    problem = checks.lr_problem(cases, checks._lr_calls(ns["scaled_lr"], ns["warmup_lr"], cases))
    assert problem and reason in problem, problem


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "warmup",
    [
        "def warmup_lr(step, base_lr, peak_lr, warmup_steps):\n    return peak_lr\n",
        "def warmup_lr(step, base_lr, peak_lr, warmup_steps):\n"
        "    return peak_lr * min(1, step / max(1, warmup_steps))\n",
        "def warmup_lr(step, base_lr, peak_lr, warmup_steps):\n"
        "    return base_lr + (peak_lr - base_lr) * step / warmup_steps\n",
    ],
    ids=["no ramp", "from zero", "never stops"],
)
def test_wrong_warmups_fail(warmup):
    ns = _ns(_lr_source("base_lr * batch_size * world_size * accum_steps / base_batch", warmup))
    cases = checks._lr_cases(torch.Generator().manual_seed(2))
    try:
        got = checks._lr_calls(ns["scaled_lr"], ns["warmup_lr"], cases)
    except ZeroDivisionError:
        return  # warmup_steps = 0 is one of the cases: a crash fails the exercise too
    problem = checks.lr_problem(cases, got)
    assert problem and problem.startswith("warmup_lr"), problem


# --------------------------------------------------------------------------- judges, by hand


def _train_case(world: int = 2) -> dict:
    return checks._train_case(torch.Generator().manual_seed(5), world)


def _correct_train_outputs(case: dict) -> list[dict]:
    """What every rank of a correct solution reports (computed in one process)."""
    w, n, b = case["world_size"], len(case["y"]), case["batch_size"]
    data = checks.RecordingDataset(case["x"], case["y"])
    final = checks._state(
        checks.reference_train(
            checks.tiny_net(case["dims"], case["init"]),
            data,
            w * b,
            case["lr"],
            case["epochs"],
            case["seed"],
        )
    )
    outs = []
    for r in range(w):
        reads = []
        for epoch in range(case["epochs"]):
            shard = checks.shuffled_shards(n, w, epoch, case["seed"])[r]
            reads += shard[: (len(shard) // b) * b]
        outs.append(
            {
                "setup": [r, w, "cpu"],
                "calls": [["init", "gloo"], ["setup", ""], ["train", ""], ["destroy", ""]],
                "reads": torch.tensor(reads),
                "logged": [f"epoch {e}" for e in range(case["epochs"])] if r == 0 else [],
                "saved": dict(final) if r == 0 else None,
                "final": dict(final),
            }
        )
    return outs


def _mutate(outs: list[dict], rank=None, **changes) -> list[dict]:
    new = [dict(o) for o in outs]
    for r in range(len(new)) if rank is None else [rank]:
        new[r].update({k: (v(r, new[r]) if callable(v) else v) for k, v in changes.items()})
    return new


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_train_judge_accepts_the_correct_outputs(world):
    case = _train_case(world)
    assert checks.train_problem(case, _correct_train_outputs(case)) is None


def _alone(case, r, o):
    steps = checks._rank_alone_steps(
        len(case["y"]), case["world_size"], r, case["batch_size"], case["epochs"], case["seed"]
    )
    model = checks.tiny_net(case["dims"], case["init"])
    data = checks.RecordingDataset(case["x"], case["y"])
    return checks._state(checks.train_on_batches(model, data, steps, case["lr"]))


def _no_set_epoch_reads(case, r, o):
    n, w, b = len(case["y"]), case["world_size"], case["batch_size"]
    shard = checks.shuffled_shards(n, w, 0, case["seed"])[r]
    return torch.tensor(shard[: (len(shard) // b) * b] * case["epochs"])


def _summed(case, r, o):
    model = checks.tiny_net(case["dims"], case["init"])
    data = checks.RecordingDataset(case["x"], case["y"])
    w, b = case["world_size"], case["batch_size"]
    return checks._state(
        checks.reference_train(model, data, w * b, case["lr"] * w, case["epochs"], case["seed"])
    )


TRAIN_MISTAKES = {
    "no init": (dict(calls=[["setup", ""], ["train", ""], ["destroy", ""]]), "0 times"),
    "nccl on cpu": (dict(calls=[["init", "nccl"], ["destroy", ""]]), "NCCL"),
    "setup returns env": (dict(setup=["DistEnv(...)"]), "must return (rank, world_size"),
    "cuda device": (dict(setup=lambda r, o: [r, o["setup"][1], "cuda:0"]), "without GPUs"),
    "same data": (dict(reads=lambda r, o: torch.arange(10)), "every rank read the same"),
    "no set_epoch": ("reads", "set_epoch"),
    "alone": ("alone", "trained alone"),
    "summed": ("summed", "summed, not averaged"),
    "log everywhere": (dict(logged=["epoch 0", "epoch 1"]), "called log() too"),
    "log every step": ("log_steps", "once per epoch"),
    "save everywhere": ("save_all", "saved the model too"),
    "save nothing": ("save_none", "saved nothing"),
    "save wrapper": ("save_wrapper", "module."),
    "no teardown": (dict(calls=[["init", "gloo"], ["setup", ""], ["train", ""]]), "teardown()"),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(TRAIN_MISTAKES))
def test_train_judge_names_each_mistake(name):
    case = _train_case(2)
    outs = _correct_train_outputs(case)
    change, reason = TRAIN_MISTAKES[name]
    if isinstance(change, dict):
        outs = _mutate(outs, **change)
    elif change == "reads":
        outs = _mutate(outs, reads=lambda r, o: _no_set_epoch_reads(case, r, o))
    elif change == "alone":
        outs = _mutate(outs, final=lambda r, o: _alone(case, r, o))
    elif change == "summed":
        outs = _mutate(outs, final=lambda r, o: _summed(case, r, o))
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
    problem = checks.train_problem(case, outs)
    assert problem and reason in problem, problem


def _eval_outputs(case: dict, shards: list[list[int]], reduce: str = "sum") -> list[dict]:
    pred = (case["x"] @ case["weight"].T + case["bias"]).argmax(1)
    right = [int((pred[s] == case["y"][s]).sum()) if s else 0 for s in shards]
    sizes = [len(s) for s in shards]
    outs = []
    for r, s in enumerate(shards):
        if reduce == "sum":
            c, t = sum(right), sum(sizes)
            acc = c / t
        elif reduce == "mean of accuracies":
            c, t = sum(right), sum(sizes)
            acc = sum(x / y for x, y in zip(right, sizes, strict=True)) / len(shards)
        else:  # none: each rank its own shard
            c, t = right[r], sizes[r]
            acc = c / t
        outs.append(
            {"correct": float(c), "total": float(t), "accuracy": acc, "reads": torch.tensor(s)}
        )
    return outs


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "kind,reason",
    [
        ("correct", None),
        ("padded", "DistributedSampler pads"),
        ("everything everywhere", "scored by rank 1 and rank 0"),
        ("mean of accuracies", "mean of the ranks' accuracies"),
        ("no all_reduce", "sum the counts"),
        ("one rank does all", "split the data set evenly"),
    ],
)
def test_eval_judge_names_each_mistake(kind, reason):
    case = checks._eval_inputs(torch.Generator().manual_seed(6))["cases"][0]
    n, w = len(case["y"]), case["world_size"]
    exact = [list(range(r, n, w)) for r in range(w)]
    if kind == "padded":
        per = math.ceil(n / w)
        padded = list(range(n)) + list(range(per * w - n))
        outs = _eval_outputs(case, [padded[r::w] for r in range(w)])
    elif kind == "everything everywhere":
        outs = _eval_outputs(case, [list(range(n))] * w)
    elif kind == "mean of accuracies":
        outs = _eval_outputs(case, exact, "mean of accuracies")
    elif kind == "no all_reduce":
        outs = _eval_outputs(case, exact, "none")
    elif kind == "one rank does all":
        outs = _eval_outputs(case, [list(range(n))] + [[]] * (w - 1))
    else:
        outs = _eval_outputs(case, exact)
    problem = checks.eval_problem(case, outs)
    if reason is None:
        assert problem is None, problem
    else:
        assert problem and reason in problem, problem


def _myddp_outputs(case: dict, broadcast=True, buffers=True, reduce="mean") -> list[dict]:
    """What each rank of a (possibly wrong) MyDDP reports, simulated in one process."""
    w, steps = case["world_size"], case["xs"][0].shape[0]
    starts = []
    for r in range(w):
        s = dict(case["inits"][r])
        if broadcast:
            s.update({k: v for k, v in case["inits"][0].items() if k != "scale" or buffers})
        starts.append(s)
    models = [checks.tiny_net(case["dims"], s) for s in starts]
    opts = [torch.optim.SGD(m.parameters(), lr=case["lr"]) for m in models]
    grads0 = None
    for step in range(steps):
        grads = []
        for r, m in enumerate(models):
            m.zero_grad()
            torch.nn.functional.cross_entropy(
                m(case["xs"][r][step]), case["ys"][r][step]
            ).backward()
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
        {"after_wrap": starts[r], "grads0": grads0[r], "final": checks._state(models[r])}
        for r in range(w)
    ]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "options,reason",
    [
        ({}, None),
        ({"broadcast": False}, "broadcast every parameter"),
        ({"buffers": False}, "buffers"),
        ({"reduce": "sum"}, "SUM"),
        ({"reduce": "none"}, "holds its own gradient"),
    ],
)
def test_myddp_judge_names_each_mistake(options, reason):
    case = checks._myddp_inputs(torch.Generator().manual_seed(7))["cases"][0]
    problem = checks.myddp_problem(case, _myddp_outputs(case, **options))
    if reason is None:
        assert problem is None, problem
    else:
        assert problem and reason in problem, problem


# --------------------------------------------------------------------------- real grading


EXPECTED_REASONS = {
    "test_ex1_shard_indices": "epoch 1 reads exactly what epoch 0 read",
    "test_ex2_ddp_train": "every rank read the same samples",
    "test_ex3_evaluate": "DistributedSampler pads",
    "test_ex4_my_ddp": "broadcast every parameter",
    "test_ex5_scaled_lr": "square-root rule",
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("gid", ["ex1_shard_indices", "ex5_scaled_lr"])
def test_typical_mistakes_of_the_pure_functions_fail_their_judge(gid, tmp_path):
    ex = next(e for e in checks.EXERCISES if e.cells == (gid,))
    inputs = ex.make_inputs(torch.Generator().manual_seed(8))
    assert ex.judge(inputs, ex.run(_ns(_solutions()[gid]), inputs, tmp_path))
    with pytest.raises(CheckFailed, match=EXPECTED_REASONS[ex.grade_id]):
        ex.judge(inputs, ex.run(_ns(mistakes.MISTAKES[gid]), inputs, tmp_path))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_typical_distributed_mistakes_fail_outside_the_kernel_and_say_why():
    """The reference passing the same judges is what the autograde test's "perfect" shows."""
    gids = ["ex2_ddp_train", "ex3_evaluate", "ex4_my_ddp"]
    nb = _nb(**{g: mistakes.MISTAKES[g] for g in gids})
    verdicts = judge_notebook(nb, LAB, [f"test_{g}" for g in gids])
    for gid, v in verdicts.items():
        assert not v.passed, v
        assert EXPECTED_REASONS[gid] in v.message, v


DISTRIBUTED_MISTAKES = {
    # forgetting DDP: each rank trains alone on its shard
    "ex2_ddp_train": (
        lambda src: src.replace(
            'ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)',
            "ddp_model = model",
        ),
        "trained alone",
    ),
    # averaging the ranks' accuracies over shards of unequal size
    "ex3_evaluate": (
        lambda src: (
            """%%writefile evaluate.py
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader


def evaluate(model, dataset, batch_size=64):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    shard = list(range(rank, len(dataset), world_size))
    correct = total = 0
    with torch.no_grad():
        for x, y in DataLoader(dataset, batch_size=batch_size, sampler=shard):
            correct += (model(x).argmax(1) == y).sum().item()
            total += y.numel()
    stats = torch.tensor([correct, total, correct / total], dtype=torch.float64)
    dist.all_reduce(stats)
    accuracy = stats[2].item() / world_size
    return {"correct": int(stats[0]), "total": int(stats[1]), "accuracy": accuracy}
"""
        ),
        "mean of the ranks' accuracies",
    ),
    # all-reducing without dividing: the sum of the gradients
    "ex4_my_ddp": (
        lambda src: src.replace("            param.grad /= world_size\n", ""),
        "SUM",
    ),
}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_more_distributed_mistakes_fail_outside_the_kernel():
    sols = _solutions()
    wrong = {}
    for gid, (edit, _) in DISTRIBUTED_MISTAKES.items():
        wrong[gid] = edit(sols[gid])
        assert wrong[gid] != sols[gid], f"the edit of {gid} did not apply"
    verdicts = judge_notebook(_nb(**wrong), LAB, [f"test_{g}" for g in DISTRIBUTED_MISTAKES])
    for gid, (_, reason) in DISTRIBUTED_MISTAKES.items():
        v = verdicts[f"test_{gid}"]
        assert not v.passed and reason in v.message, v


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torch_ddp_is_refused_in_my_ddp():
    cheat = (
        "%%writefile my_ddp.py\n"
        "from torch import nn\n"
        "from torch.nn.parallel import DistributedDataParallel\n"
        "class MyDDP(nn.Module):\n"
        "    def __init__(self, module):\n"
        "        super().__init__()\n"
        "        self.module = DistributedDataParallel(module)\n"
        "    def forward(self, *a, **k):\n"
        "        return self.module(*a, **k)\n"
    )
    v = judge_notebook(_nb(ex4_my_ddp=cheat), LAB, ["test_ex4_my_ddp"])["test_ex4_my_ddp"]
    assert not v.passed and "must not use torch's DistributedDataParallel" in v.message, v


# --------------------------------------------------------------------------- visible checks


@pytest.fixture
def solution_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("NBGRADER_EXECUTION", raising=False)
    for gid in ("ex2_ddp_train", "ex3_evaluate", "ex4_my_ddp"):
        name, text = _file(gid)
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
    assert (solution_files / "ddp_model.pt").is_file()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_visible_ddp_train_check_names_a_missing_set_epoch(solution_files):
    path = solution_files / "ddp_train.py"
    path.write_text(path.read_text().replace("sampler.set_epoch(epoch)", "pass"))
    with pytest.raises(CheckFailed, match="set_epoch"):
        checks.ddp_train("ddp_train.py")


@pytest.mark.timeout(60)
def test_visible_checks_refuse_stubs_without_starting_processes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("NBGRADER_EXECUTION", raising=False)
    for name in ("ddp_train.py", "evaluate.py", "my_ddp.py"):
        (tmp_path / name).write_text("# YOUR CODE HERE\nraise NotImplementedError()\n")
    for fn, name in (
        (checks.ddp_train, "ddp_train.py"),
        (checks.evaluate, "evaluate.py"),
        (checks.my_ddp, "my_ddp.py"),
    ):
        with pytest.raises(CheckFailed, match="stub"):
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
    exercises = {ex.cells[0] for ex in checks.EXERCISES}
    assert set(mistakes.MISTAKES) == exercises
    assert set(mistakes.FORGED_FILES) == {"ddp_train.py", "evaluate.py", "my_ddp.py"}


def test_points_and_notebook_shape():
    cells = load(SOLUTION_NB)["cells"]
    points = {
        nbgrader_meta(c)["grade_id"]: nbgrader_meta(c)["points"]
        for c in cells
        if nbgrader_meta(c).get("grade") and not nbgrader_meta(c).get("solution")
    }
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


# --------------------------------------------------------------------------- property: any draw

PROPERTY_SEEDS = range(200)


def _property_inputs(grade_id: str, seed: int) -> dict:
    ex = next(e for e in checks.EXERCISES if e.grade_id == grade_id)
    return ex.make_inputs(torch.Generator().manual_seed(seed))


def _judge_of(grade_id: str):
    return next(e for e in checks.EXERCISES if e.grade_id == grade_id).judge


def _assert_verdicts(grade_id: str, seed: int, inputs: dict, right: dict, wrongs: dict) -> None:
    assert_verdicts(_judge_of(grade_id), seed, inputs, right, wrongs)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("gid", ["ex1_shard_indices", "ex5_scaled_lr"])
def test_property_pure_function_verdicts_do_not_depend_on_the_draw(gid, tmp_path):
    """200 draws: the solution passes, every typical mistake fails (``run`` in this process)."""
    ex = next(e for e in checks.EXERCISES if e.cells == (gid,))
    if gid == "ex1_shard_indices":
        wrong_sources = [mistakes.MISTAKES[gid]] + [
            "import torch\n" + source for source, _ in WRONG_SHARDS.values()
        ]
    else:
        wrong_sources = [mistakes.MISTAKES[gid]] + [_lr_source(e) for e, _ in WRONG_LRS.values()]
    right = _ns(_solutions()[gid])
    wrongs = {k: _ns(s) for k, s in enumerate(wrong_sources)}
    for seed in PROPERTY_SEEDS:
        inputs = ex.make_inputs(torch.Generator().manual_seed(seed))
        _assert_verdicts(
            ex.grade_id,
            seed,
            inputs,
            ex.run(right, inputs, tmp_path),
            {k: ex.run(ns, inputs, tmp_path) for k, ns in wrongs.items()},
        )


def _simulated_ddp_outputs(
    case: dict, sampler_drop_last: bool = True, loader_drop_last: bool = True, train: bool = True
) -> list[dict]:
    """What every rank of the solution's train() reports, simulated in one process.

    Each rank reads through its own DistributedSampler and DataLoader (as the solution does);
    every step averages the ranks' gradients (what DDP's all-reduce does) on one shared model.
    Without ``train`` only the reads are real (enough for mistakes in what the ranks read).
    """
    from torch.utils.data import DataLoader, DistributedSampler

    w, b = case["world_size"], case["batch_size"]
    model = checks.tiny_net(case["dims"], case["init"])
    opt = torch.optim.SGD(model.parameters(), lr=case["lr"])
    datas = [checks.RecordingDataset(case["x"], case["y"]) for _ in range(w)]
    samplers = [
        DistributedSampler(
            datas[r],
            num_replicas=w,
            rank=r,
            shuffle=True,
            seed=case["seed"],
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
    final = checks._state(model)
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


@pytest.mark.timeout(60)
def test_property_train_verdict_does_not_depend_on_the_draw():
    """200 draws: simulated DDP passes; a padding sampler or a DataLoader that keeps the
    incomplete batch always changes what the ranks read, and fails."""
    for seed in PROPERTY_SEEDS:
        inputs = _property_inputs("test_ex2_ddp_train", seed)
        right = {"cases": [_simulated_ddp_outputs(c) for c in inputs["cases"]]}
        wrongs = {
            name: {"cases": [_simulated_ddp_outputs(c, train=False, **kw) for c in inputs["cases"]]}
            for name, kw in {
                "sampler pads": {"sampler_drop_last": False},
                "loader keeps the last batch": {"loader_drop_last": False},
                "both": {"sampler_drop_last": False, "loader_drop_last": False},
            }.items()
        }
        _assert_verdicts("test_ex2_ddp_train", seed, inputs, right, wrongs)


def _property_eval_outputs(case: dict, shards: list[list[int]], reduce: str = "sum") -> list:
    """Like ``_eval_outputs``, but each rank scores its shard with ``nn.Linear`` in batches."""
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
            c, t, acc = right[r], sizes[r], right[r] / sizes[r]
        outs.append(
            {"correct": float(c), "total": float(t), "accuracy": acc, "reads": torch.tensor(s)}
        )
    return outs


@pytest.mark.timeout(60)
def test_property_eval_verdict_does_not_depend_on_the_draw():
    for seed in PROPERTY_SEEDS:
        inputs = _property_inputs("test_ex3_evaluate", seed)
        (case,) = inputs["cases"]
        n, w = len(case["y"]), case["world_size"]
        exact = [list(range(r, n, w)) for r in range(w)]
        padded = list(range(n)) + list(range(math.ceil(n / w) * w - n))
        wrongs = {
            "padded": _property_eval_outputs(case, [padded[r::w] for r in range(w)]),
            "mean of accuracies": _property_eval_outputs(case, exact, "mean of accuracies"),
            "no all_reduce": _property_eval_outputs(case, exact, "none"),
        }
        _assert_verdicts(
            "test_ex3_evaluate",
            seed,
            inputs,
            {"cases": [_property_eval_outputs(case, exact)]},
            {k: {"cases": [v]} for k, v in wrongs.items()},
        )


def _own_first_gradient(case: dict, r: int) -> dict:
    """Rank r's gradient of its first batch at rank 0's weights (no all-reduce)."""
    model = checks.tiny_net(case["dims"], case["inits"][0])
    torch.nn.functional.cross_entropy(model(case["xs"][r][0]), case["ys"][r][0]).backward()
    return {k: p.grad.clone() for k, p in model.named_parameters()}


def _myddp_mistakes(case: dict, right: list[dict]) -> dict:
    """Each mistake's outputs: the right ones with the field the mistake changes first (the
    weights after wrapping, or the first gradient), which is where the judge stops."""
    w = case["world_size"]

    def changed(field, value_of):
        return {"cases": [[{**o, field: value_of(r, o)} for r, o in enumerate(right)]]}

    return {
        "no broadcast": changed("after_wrap", lambda r, o: dict(case["inits"][r])),
        "no buffers": changed(
            "after_wrap", lambda r, o: {**o["after_wrap"], "scale": case["inits"][r]["scale"]}
        ),
        "summed": changed("grads0", lambda r, o: {k: v * w for k, v in o["grads0"].items()}),
        "not reduced": changed("grads0", lambda r, o: _own_first_gradient(case, r)),
    }


@pytest.mark.timeout(60)
def test_property_myddp_verdict_does_not_depend_on_the_draw():
    """200 draws: simulated MyDDP passes; each typical mistake fails."""
    for seed in PROPERTY_SEEDS:
        inputs = _property_inputs("test_ex4_my_ddp", seed)
        (case,) = inputs["cases"]
        right = _myddp_outputs(case)
        wrongs = _myddp_mistakes(case, right)
        _assert_verdicts("test_ex4_my_ddp", seed, inputs, {"cases": [right]}, wrongs)
