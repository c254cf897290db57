"""What lab 3's distributed exercises report on every rank, simulated in one process.

The property tests of ``tests/test_lab03.py`` feed the grader's judges with these outputs
over 100 draws: the right answer, and each typical mistake made on purpose. Each function
takes the exercise's inputs (one torchrun job of ``world_size`` ranks, its ``runs`` over 2
or 3 of them) and returns ``{"cases": [[rank 0's outputs, rank 1's, ...]]}`` in the shape
the exercise's ``run_rank`` gives.
"""

from __future__ import annotations

import math

import torch
from torch.utils.data import DataLoader, DistributedSampler

from ddp_lab.answers import full_judge, hidden
from ddp_lab.checks import lab03 as checks
from ddp_lab.checks.lab03 import common, ex1_shard_sampler, ex2_ddp_train, own_ddp
from ddp_lab.checks.lab03 import ex5_bucketed_ddp as ex5
from ddp_lab.checks.lab03.fake_node import node_env

LAB = "lab03_ddp"
EXERCISES = {ex.grade_id: ex for ex in checks.EXERCISES}


def judge_of(grade_id: str):
    """The grader's judge of an exercise: the kit's, then the hidden check and diagnoses."""
    return full_judge(EXERCISES[grade_id], hidden(LAB).get(grade_id))


def _per_rank(job: dict, outputs_of_run) -> list[list]:
    """``[rank][run]`` outputs from ``outputs_of_run(run) -> [rank 0's, rank 1's, ...]``."""
    ranks: list[list] = [[] for _ in range(job["world_size"])]
    for run in job["runs"]:
        outs = outputs_of_run(run)
        for r in range(job["world_size"]):
            ranks[r].append(outs[r] if r < run["ranks"] else None)
    return ranks


# --- exercise 2 -----------------------------------------------------------------------------


def _train_run(
    case: dict,
    train: bool = True,
    sampler_drop_last: bool = True,
    loader_drop_last: bool = True,
    seed: int | None = None,
    set_epoch: bool = True,
    cpu_backend: str = "gloo",
    cpu_device: str = "cpu",
    wrong: str | None = None,
) -> list[dict]:
    """Every rank of the solution's train() on one run: each rank reads through its own
    DistributedSampler and DataLoader; every step averages the ranks' gradients on one
    shared model (what DDP's all-reduce does). Without ``train`` only the reads are real."""
    w, b = case["ranks"], case["batch_size"]
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
            sampler.set_epoch(epoch if set_epoch else 0)
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
    outs = [
        {
            "setup": [r, w, cpu_device],
            "calls": [["init", cpu_backend], ["setup", ""], ["train", ""], ["destroy", ""]],
            "reads": torch.tensor(datas[r].reads, dtype=torch.long),
            "logged": [f"epoch {e}" for e in range(case["epochs"])] if r == 0 else [],
            "saved": dict(final) if r == 0 else None,
            "final": dict(final),
        }
        for r in range(w)
    ]
    if wrong == "alone":
        for r, o in enumerate(outs):
            o["final"] = _alone(case, r)
    elif wrong == "summed":
        for o in outs:
            o["final"] = ex2_ddp_train.single_process(case, lr_factor=w)
    elif wrong == "log_everywhere":
        for o in outs:
            o["logged"] = [f"epoch {e}" for e in range(case["epochs"])]
    elif wrong == "save_wrapper":
        outs[0]["saved"] = {f"module.{k}": v for k, v in outs[0]["final"].items()}
    elif wrong == "no_teardown":
        for o in outs:
            o["calls"] = o["calls"][:-1]
    return outs


def _alone(case: dict, r: int) -> dict:
    """Rank ``r``'s weights when it trains alone on its shards."""
    n, w, b = len(case["y"]), case["ranks"], case["batch_size"]
    steps = []
    for epoch in range(case["epochs"]):
        shard = ex1_shard_sampler.sampler_shards(
            {"n": n, "world_size": w, "shuffle": True, "seed": case["seed"], "drop_last": True},
            epoch,
        )[r]
        steps += [shard[k : k + b] for k in range(0, len(shard) - b + 1, b)]
    model = common.tiny_net(case["dims"], case["init"])
    data = common.RecordingDataset(case["x"], case["y"])
    return common.state(common.sgd_on_batches(model, data, steps, case["lr"]))


def _gpu_probe(rank: int, gpu: str = "right") -> dict:
    env = node_env(rank)
    local, global_rank = int(env["LOCAL_RANK"]), int(env["RANK"])
    device = f"cuda:{global_rank}" if gpu == "rank" else f"cuda:{local}"
    calls = [] if gpu == "no_set_device" else [["set_device", int(device.split(":")[1])]]
    calls.append(["init", "gloo" if gpu == "gloo" else "nccl", -1])
    return {"env": env, "calls": calls, "setup": [global_rank, int(env["WORLD_SIZE"]), device]}


#: (id(job), wrong, options) -> (job, every rank's runs): kept alive, so no id is reused.
_TRAINED: dict[tuple, tuple] = {}


def train_outputs(inputs: dict, gpu: str = "right", wrong: str | None = None, **kw) -> dict:
    """Every rank's outputs of exercise 2 (``gpu``: what the faked GPU node sees)."""
    (job,) = inputs["cases"]
    key = (id(job), wrong, tuple(sorted(kw.items())))
    if key not in _TRAINED:  # the GPU-node mistakes train like the right answer: once
        if len(_TRAINED) > 32:
            _TRAINED.clear()
        _TRAINED[key] = (job, _per_rank(job, lambda run: _train_run(run, wrong=wrong, **kw)))
    ranks = _TRAINED[key][1]
    outs = [{"runs": runs, "gpu": _gpu_probe(r, gpu)} for r, runs in enumerate(ranks)]
    if wrong == "short_job":
        outs = outs[:-1]
    return {"cases": [outs]}


# --- exercise 3 -----------------------------------------------------------------------------


def _eval_run(case: dict, kind: str, reduce: str) -> list[dict]:
    """What each rank reports when it scores its part of the data (``kind``: exact,
    padded, ...) and combines the counts by ``reduce``."""
    n, w = len(case["y"]), case["ranks"]
    exact = [list(range(r, n, w)) for r in range(w)]
    padded_order = list(range(n)) + list(range(math.ceil(n / w) * w - n))
    shards = {
        "exact": exact,
        "padded": [padded_order[r::w] for r in range(w)],
        "everything everywhere": [list(range(n))] * w,
        "one rank does all": [list(range(n))] + [[]] * (w - 1),
    }[kind]
    pred = (case["x"].double() @ case["weight"].double().T + case["bias"].double()).argmax(1)
    right = [int((pred[s] == case["y"][s]).sum()) if s else 0 for s in shards]
    sizes = [len(s) for s in shards]
    outs = []
    for r, s in enumerate(shards):
        c, t = sum(right), sum(sizes)
        acc = c / t
        if reduce == "mean of accuracies":
            acc = sum(x / y if y else 0.0 for x, y in zip(right, sizes, strict=True)) / w
        elif reduce == "none":
            c, t, acc = right[r], sizes[r], right[r] / max(1, sizes[r])
        outs.append(
            {"correct": float(c), "total": float(t), "accuracy": acc, "reads": torch.tensor(s)}
        )
    return outs


def eval_outputs(inputs: dict, shards: str = "exact", reduce: str = "sum") -> dict:
    """Every rank's outputs of exercise 3."""
    (job,) = inputs["cases"]
    return {"cases": [_per_rank(job, lambda run: _eval_run(run, shards, reduce))]}


# --- exercises 4 and 5 ------------------------------------------------------------------------


def _sizes(dims) -> list[int]:
    return [math.prod(s) for s in own_ddp.trainable_shapes(dims)]


def _calls(run: dict, number: str, kind: str) -> list[list]:
    """The all-reduces of every step: ``[step, elements, dtype, async]``."""
    sizes = _sizes(run["dims"])
    itemsize = 4 if run["dtype"] == "float32" else 8
    if number == "4":
        per_step = list(reversed(sizes)) if kind != "missing" else list(reversed(sizes))[1:]
    else:
        cap = run["cap_bytes"]
        per_step = {
            "right": ex5.buckets(sizes, itemsize, cap),
            "once": ex5.buckets(sizes, itemsize, cap),
            "forward": ex5.buckets(sizes, itemsize, cap, reverse=False),
            "per_gradient": list(reversed(sizes)),
            "one": [sum(sizes)],
            "four_bytes": ex5.buckets(sizes, 4, cap),
        }[kind]
    steps = run["xs"][0].shape[0]
    out = []
    for step in range(steps if kind != "once" else 1):
        out += [[step, n, run["dtype"], True] for n in per_step]
    return out


#: id(run) -> (run, big batch gradient, big batch SGD weights, each rank's own gradient):
#: the oracles every variant of one draw shares, computed once (the run is kept alive so
#: its id is not reused).
_ORACLES: dict[int, tuple] = {}


def _oracles(run: dict) -> tuple:
    if id(run) not in _ORACLES:
        if len(_ORACLES) > 8:
            _ORACLES.clear()
        owns = []
        for r in range(run["ranks"]):
            model = own_ddp.own_net(run["dims"], run["inits"][0])
            x, y = run["xs"][r][0], run["ys"][r][0]
            torch.nn.functional.cross_entropy(model(x), y).backward()
            owns.append({k: p.grad.clone() for k, p in model.named_parameters() if p.requires_grad})
        mean, final = own_ddp.big_batch_gradient(run), own_ddp.big_batch_sgd(run)
        _ORACLES[id(run)] = (run, mean, final, owns)
    return _ORACLES[id(run)][1:]


def _own_run(run: dict, number: str, broadcast, buffers, reduce, frozen_grad, calls) -> list:
    w = run["ranks"]
    mean, final, owns = _oracles(run)
    outs = []
    for r in range(w):
        start = dict(run["inits"][r])
        if broadcast:
            start.update({k: v for k, v in run["inits"][0].items() if k != "scale" or buffers})
        own = owns[r]
        grads = {
            "mean": mean,
            "sum": {k: v * w for k, v in mean.items()},
            "own": own,
            "own_divided": {k: v / w for k, v in own.items()},
        }[reduce]
        outs.append(
            {
                "after_wrap": start,
                "grads0": grads,
                "frozen_grad": frozen_grad,
                "final": final,
                "calls": _calls(run, number, calls),
            }
        )
    return outs


def _timing(run: dict, number: str, kind: str) -> list:
    messages = 8 if number == "4" else 4
    ideal = own_ddp.ideal_gain(run, messages)
    blocking = 0.4
    overlapped = {"right": blocking - ideal, "waits": blocking - 0.01}.get(kind, blocking)
    end = 0.15
    starts = (
        [0.3 + 0.04 * i for i in range(messages)]
        if kind == "after"
        else [0.05 * (i // 2) for i in range(messages)]
    )
    calls = [[10, t, kind != "blocking"] for t in starts]
    out = {"overlapped": overlapped, "blocking": blocking, "calls": calls, "end": end}
    return [out] * run["ranks"]


def own_ddp_outputs(
    inputs: dict,
    number: str,
    broadcast: bool = True,
    buffers: bool = True,
    reduce: str = "mean",
    frozen_grad: bool = False,
    timing: str = "right",
    calls: str = "right",
) -> dict:
    """Every rank's outputs of exercise 4 (``number="4"``) or 5: a right wrapper, or one
    mistake made on purpose."""
    (job,) = inputs["cases"]

    def outputs_of_run(run):
        if "latency" in run:
            return _timing(run, number, timing)
        return _own_run(run, number, broadcast, buffers, reduce, frozen_grad, calls)

    return {"cases": [_per_rank(job, outputs_of_run)]}
