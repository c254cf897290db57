"""Exercise 2: ``ddp_train.py``'s ``setup`` / ``train`` / ``teardown`` on every rank.

Each rank of a torchrun job loads the student's file, calls ``setup()`` (with the process
group calls only recorded: the rank worker has joined the group already), trains a float64
:class:`~ddp_lab.checks.lab03.common.TinyNet` on a :class:`RecordingDataset`, and calls
``teardown()``. The judge compares

- the samples each rank read with torch's ``DistributedSampler(shuffle=True, seed=seed,
  drop_last=True)`` after ``set_epoch(epoch)``, in full batches (the oracle);
- every rank's final weights with one process trained on the global batch (``single.py``'s
  plain SGD loop on batches of ``world_size x batch_size``: the given starting point);

and checks properties: ``init_process_group`` once with gloo on the CPU, ``setup()``'s
return value, ranks that agree, rank 0 alone logging (once per epoch) and saving the plain
model's ``state_dict``, ``destroy_process_group`` once.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from torch.utils.data import DistributedSampler

from ddp_lab.checks import guards
from ddp_lab.checks.contract import Exercise
from ddp_lab.checks.failure import CheckFailed, max_abs_diff
from ddp_lab.checks.lab03.common import (
    RecordingDataset,
    random_dims,
    random_state,
    same_state,
    sgd_on_batches,
    single_process_batches,
    state,
    tiny_net,
)
from ddp_lab.checks.values import first, randint, uniform

FILE = "ddp_train.py"
#: Runtime modules the script may not use: the exercise is to write them.
FORBID_MODULES = ("ddp_lab.dist", "ddp_lab.train")


def case(gen: torch.Generator, world: int) -> dict:
    """One training job on ``world`` ranks, sized so that the typical mistakes show.

    ``n = world * k + t`` with ``0 < t < world`` and ``k = steps * b + (b - 1)``:
    ``DistributedSampler`` must drop ``t`` samples (padding gives every rank ``k + 1 =
    (steps + 1) * b``, one batch more), and each rank's shard of ``k`` ends with an
    incomplete batch of ``b - 1`` for the DataLoader to drop. Either mistake changes what
    the ranks read, whatever the draw.
    """
    dims = random_dims(gen)
    b = randint(gen, 2, 4)
    steps = randint(gen, 4, 7)
    k = steps * b + b - 1
    n = world * k + randint(gen, 1, world - 1)
    return {
        "world_size": world,
        "dims": dims,
        "init": random_state(dims, gen),
        "x": torch.randn(n, dims[0], generator=gen, dtype=torch.float64),
        "y": torch.randint(0, dims[2], (n,), generator=gen),
        "batch_size": b,
        "lr": uniform(gen, 0.1, 0.5),
        "epochs": 2,
        "seed": randint(gen, 1, 10**6 - 1),
    }


def make_inputs(gen: torch.Generator) -> dict:
    """One job on 3 ranks (a torchrun job per case costs seconds of grading time)."""
    return {"cases": [case(gen, 3)]}


def visible_inputs(gen: torch.Generator) -> dict:
    """One job on 2 ranks."""
    return {"cases": [case(gen, 2)]}


def run_rank(ns: dict, inputs: dict, case: dict, rank: int, world: int) -> dict:
    """Run the student's ``setup``, ``train`` and ``teardown`` on this rank."""
    path = Path(FILE)
    if path.is_file():
        guards.refuse_mentions({FILE: path.read_text()}, FORBID_MODULES)
    calls: list = []
    logged: list = []
    with tempfile.TemporaryDirectory(prefix="ddp_lab-ex2-") as tmp:
        out = Path(tmp) / "model.pt"
        with guards.recorded_process_group(calls):
            mod = guards.load_student_file(FILE)
            got = mod["setup"]()
            calls.append(("setup", ""))
            model = tiny_net(case["dims"], case["init"])
            data = RecordingDataset(case["x"], case["y"])
            mod["train"](
                model,
                data,
                case["batch_size"],
                case["lr"],
                case["epochs"],
                seed=case["seed"],
                out=str(out),
                log=lambda *a, **k: logged.append(" ".join(str(v) for v in a)),
            )
            calls.append(("train", ""))
            saved = torch.load(out, weights_only=True) if out.is_file() else None
            mod["teardown"]()
    try:
        r, w, device = got
        setup = [int(r), int(w), str(device)]
    except (TypeError, ValueError):
        setup = [repr(got)[:200]]
    return {
        "setup": setup,
        "calls": [list(c) for c in calls],
        "reads": torch.tensor(data.reads, dtype=torch.long),
        "logged": logged,
        "saved": dict(saved) if isinstance(saved, dict) else None,
        "final": state(model),
    }


def expected_reads(case: dict) -> list[list[int]]:
    """What each rank must read: its ``DistributedSampler`` shard every epoch, in full
    batches (the oracle)."""
    n, w, b = len(case["y"]), case["world_size"], case["batch_size"]
    reads = []
    for rank in range(w):
        sampler = DistributedSampler(
            range(n), num_replicas=w, rank=rank, shuffle=True, seed=case["seed"], drop_last=True
        )
        mine = []
        for epoch in range(case["epochs"]):
            sampler.set_epoch(epoch)
            shard = list(sampler)
            mine += shard[: len(shard) // b * b]
        reads.append(mine)
    return reads


def where(case: dict) -> str:
    """``"3 ranks, 95 samples, batch_size 4"``."""
    return f"{case['world_size']} ranks, {len(case['y'])} samples, batch_size {case['batch_size']}"


def read_problem(case: dict, reads: list[list[int]]) -> str | None:
    """What is wrong with the samples each rank read (vs. :func:`expected_reads`), or None."""
    want = expected_reads(case)
    if reads == want:
        return None
    n, w, b, epochs = len(case["y"]), case["world_size"], case["batch_size"], case["epochs"]
    at = where(case)
    if any(len(r) == 0 for r in reads):
        r = next(i for i, x in enumerate(reads) if not x)
        return (
            f"{at}: rank {r} never read a sample of `dataset`: iterate a DataLoader over it "
            "in this process (num_workers=0)"
        )
    if w > 1 and all(r == reads[0] for r in reads):
        return (
            f"{at}: every rank read the same samples ({first(reads[0])}): give the "
            "DataLoader a DistributedSampler so that each rank reads its own shard"
        )
    per_epoch = [len(r) / epochs for r in reads]
    if all(p == n // w for p in per_epoch):
        return (
            f"{at}: each rank read its whole shard of {n // w} samples every epoch, the "
            f"incomplete last batch too: pass drop_last=True to the DataLoader"
        )
    if all(p == -(-n // w) for p in per_epoch):
        return (
            f"{at}: each rank read {-(-n // w)} samples an epoch, more than its "
            f"{n} // {w} = {n // w}: the shards were padded with repeated samples: pass "
            "drop_last=True to DistributedSampler"
        )
    if all(len(r) == len(x) for r, x in zip(reads, want, strict=True)):
        half = len(want[0]) // epochs
        if all(r[:half] * epochs == r for r in reads):
            return (
                f"{at}: every epoch read the samples in epoch 0's order: call "
                "sampler.set_epoch(epoch) at the start of every epoch"
            )
    r = next(i for i in range(w) if reads[i] != want[i])
    steps = (n // w) // b
    return (
        f"{at}: rank {r} read {len(reads[r])} samples ({first(reads[r])}); expected "
        f"{epochs} epochs x {steps} steps x {b} samples of its shard of DistributedSampler("
        f"dataset, shuffle=True, seed=seed, drop_last=True) with set_epoch(epoch): "
        f"{first(want[r])}"
    )


def single_process(case: dict, lr_factor: float = 1.0) -> dict:
    """The weights of one process trained on the global batch (``single.py``'s loop)."""
    w, b = case["world_size"], case["batch_size"]
    batches = single_process_batches(len(case["y"]), w * b, case["epochs"], case["seed"])
    model = tiny_net(case["dims"], case["init"])
    data = RecordingDataset(case["x"], case["y"])
    return state(sgd_on_batches(model, data, batches, case["lr"] * lr_factor))


def setup_problem(outs: list[dict], w: int) -> str | None:
    """What is wrong with ``setup()`` on some rank (backend, return value, device), or None."""
    for r, o in enumerate(outs):
        inits = [c[1] for c in o["calls"] if c[0] == "init"]
        if len(inits) != 1:
            return (
                f"rank {r}: setup() called dist.init_process_group {len(inits)} times; call it "
                "exactly once"
            )
        if "nccl" in inits[0] and "gloo" not in inits[0]:
            return (
                f"rank {r}: setup() asked for the NCCL backend on a machine without GPUs: "
                "use gloo on the CPU (nccl only when torch.cuda.is_available())"
            )
        if len(o["setup"]) != 3:
            return f"rank {r}: setup() must return (rank, world_size, device), got {o['setup'][0]}"
        if o["setup"][:2] != [r, w]:
            return (
                f"rank {r}: setup() returned rank {o['setup'][0]} and world size "
                f"{o['setup'][1]}; expected {r} and {w}: read them from the process group "
                "(dist.get_rank(), dist.get_world_size())"
            )
        if not o["setup"][2].startswith("cpu"):
            return (
                f"rank {r}: setup() chose device {o['setup'][2]!r} on a machine without GPUs; "
                "expected the CPU (cuda:LOCAL_RANK only when CUDA is available)"
            )
    return None


def weights_problem(case: dict, outs: list[dict]) -> str | None:
    """Whether every rank ends with the weights of one process on the global batch."""
    w, b = case["world_size"], case["batch_size"]
    expected = single_process(case)
    finals = [o["final"] for o in outs]
    bad = [r for r in range(w) if not same_state(finals[r], expected)]
    if not bad:
        return None
    r = bad[0]
    if not all(same_state(f, finals[0]) for f in finals):
        hint = (
            "the ranks ended with different weights: wrap the model in DistributedDataParallel "
            "and give the optimizer the wrapped model's parameters"
        )
    else:
        hint = "use SGD(lr=lr) and the mean cross-entropy loss of each rank's batch"
    return (
        f"{where(case)}: rank {r}'s final weights differ from one process trained on batches of "
        f"{w} x {b} = {w * b} samples (max abs difference {max_abs_diff(finals[r], expected):.3g})"
        f": {hint}"
    )


def rank0_problem(case: dict, outs: list[dict]) -> str | None:
    """Logging and saving on rank 0 alone, and ``teardown()`` once on every rank."""
    w, at = case["world_size"], where(case)
    logs = [len(o["logged"]) for o in outs]
    if any(logs[1:]):
        return (
            f"{at}: ranks {[r for r in range(1, w) if logs[r]]} called log() too: only "
            "rank 0 logs (if rank == 0), or every line appears world_size times"
        )
    if logs[0] != case["epochs"]:
        return (
            f"{at}: rank 0 called log() {logs[0]} times in {case['epochs']} epochs; expected "
            "once per epoch"
        )
    saved = [o["saved"] for o in outs]
    if any(s is not None for s in saved[1:]):
        return (
            f"{at}: ranks {[r for r in range(1, w) if saved[r] is not None]} saved the model "
            "too: only rank 0 writes (the others would overwrite the same file)"
        )
    if saved[0] is None:
        return f"{at}: rank 0 saved nothing to `out`: torch.save(model.state_dict(), out)"
    if any(k.startswith("module.") for k in saved[0]):
        return (
            f"{at}: rank 0 saved the DDP wrapper's state_dict (keys start with 'module.'): "
            "save the plain model's, model.state_dict() (or ddp.module.state_dict())"
        )
    if not same_state(saved[0], outs[0]["final"]):
        return f"{at}: the saved state_dict is not the final model's"
    for r, o in enumerate(outs):
        destroys = [c for c in o["calls"] if c[0] == "destroy"]
        if len(destroys) != 1:
            return (
                f"rank {r}: teardown() called dist.destroy_process_group {len(destroys)} times; "
                "call it once, at the end"
            )
    return None


def problem(case: dict, outs: list[dict]) -> str | None:
    """What is wrong with ``setup`` / ``train`` / ``teardown`` on every rank, or None."""
    w = case["world_size"]
    if len(outs) != w:
        return f"expected the results of {w} ranks, got {len(outs)}"
    return (
        setup_problem(outs, w)
        or read_problem(case, [o["reads"].tolist() for o in outs])
        or weights_problem(case, outs)
        or rank0_problem(case, outs)
    )


def judge(inputs: dict, outputs: dict) -> str:
    """Reads equal ``DistributedSampler``'s, weights equal one process on the global batch."""
    for c, outs in zip(inputs["cases"], outputs["cases"], strict=True):
        if why := problem(c, outs):
            raise CheckFailed(why)
    runs = " and ".join(f"{c['world_size']} ranks x {c['batch_size']}" for c in inputs["cases"])
    return (
        f"DDP on {runs} samples ends with the weights of one process on the global batch; "
        "each rank read its DistributedSampler shard, reshuffled every epoch; rank 0 alone "
        "logged and saved"
    )


EXERCISE = Exercise(
    "test_ex2_ddp_train",
    ("ex2_ddp_train",),
    "DDP training equals one process on the global batch",
    make_inputs,
    judge,
    run_rank=run_rank,
    forbid_modules=FORBID_MODULES,
    timeout=90,
    visible_inputs=visible_inputs,
    files=(FILE,),
)
