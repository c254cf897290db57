"""Exercise 2: ``ddp_train.py``'s ``setup`` / ``train`` / ``teardown`` on every rank.

One torchrun job of 3 ranks runs the student's file twice: on a group of ranks 0 and 1
(which the student's code sees as its whole world; rank 2 waits) and on all 3 ranks. Each
rank calls ``setup()`` (the process group calls only recorded: the rank worker has joined
the group already; CUDA reported unavailable), trains a float64
:class:`~ddp_lab.checks.lab03.common.TinyNet` for 3 epochs on a :class:`RecordingDataset`
whose length is not divisible by the world size, and calls ``teardown()``. Then each rank
calls ``setup()`` once more as a faked rank of a 2-node GPU job (``RANK`` 5 to 7,
``LOCAL_RANK`` 1 to 3, CUDA reported available; :mod:`~ddp_lab.checks.lab03.fake_node`).
The judge compares

- the samples each rank read with torch's ``DistributedSampler(shuffle=True, seed=seed,
  drop_last=True)`` after ``set_epoch(epoch)``, in full batches, epoch after epoch (the
  oracle);
- every rank's final weights with one process trained on the global batch (``single.py``'s
  plain SGD loop on batches of ``world_size x batch_size``: the given starting point);

and checks properties: ``init_process_group`` once, with gloo and the CPU when CUDA is
unavailable, NCCL and ``cuda:LOCAL_RANK`` (made the current device) on the faked GPU node;
``setup()``'s return value; ranks that agree; rank 0 alone logging (once per epoch) and
saving the plain model's ``state_dict``; ``destroy_process_group`` once.
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
    per_run,
    random_dims,
    random_state,
    run_outputs,
    same_state,
    sgd_on_batches,
    single_process_batches,
    state,
    tiny_net,
)
from ddp_lab.checks.lab03.fake_node import GPUS_PER_NODE, gpu_node, no_cuda, node_env
from ddp_lab.checks.values import first, randint, uniform

FILE = "ddp_train.py"
#: Runtime modules the script may not use: the exercise is to write them.
FORBID_MODULES = ("ddp_lab.dist", "ddp_lab.train")
EPOCHS = 3


def case(gen: torch.Generator, ranks: int) -> dict:
    """One training run on ``ranks`` ranks, sized so that the typical mistakes show.

    ``n = ranks * k + t`` with ``0 < t < ranks`` and ``k = steps * b + (b - 1)``:
    ``DistributedSampler`` must drop ``t`` samples (padding gives every rank ``k + 1 =
    (steps + 1) * b``, one batch more), and each rank's shard of ``k`` ends with an
    incomplete batch of ``b - 1`` for the DataLoader to drop. Either mistake changes what
    the ranks read, whatever the draw.
    """
    dims = random_dims(gen)
    b = randint(gen, 2, 4)
    steps = randint(gen, 3, 5)
    k = steps * b + b - 1
    n = ranks * k + randint(gen, 1, ranks - 1)
    return {
        "ranks": ranks,
        "dims": dims,
        "init": random_state(dims, gen),
        "x": torch.randn(n, dims[0], generator=gen, dtype=torch.float64),
        "y": torch.randint(0, dims[2], (n,), generator=gen),
        "batch_size": b,
        "lr": uniform(gen, 0.1, 0.5),
        "epochs": EPOCHS,
        "seed": randint(gen, 1, 10**6 - 1),
    }


def make_inputs(gen: torch.Generator) -> dict:
    """One torchrun job of 3 ranks: a run on 2 of them, then one on all 3."""
    return {"cases": [{"world_size": 3, "runs": [case(gen, 2), case(gen, 3)]}]}


def visible_inputs(gen: torch.Generator) -> dict:
    """One job of 2 ranks, one run."""
    return {"cases": [{"world_size": 2, "runs": [case(gen, 2)]}]}


def _setup_result(got) -> list:
    try:
        r, w, device = got
        return [int(r), int(w), str(device)]
    except (TypeError, ValueError):
        return [repr(got)[:200]]


def _one_run(mod: dict, run: dict, rank: int, ranks: int) -> dict:
    calls: list = []
    logged: list = []
    with tempfile.TemporaryDirectory(prefix="ddp_lab-ex2-") as tmp:
        out = Path(tmp) / "model.pt"
        with guards.recorded_process_group(calls), no_cuda():
            got = mod["setup"]()
            calls.append(("setup", ""))
            model = tiny_net(run["dims"], run["init"])
            data = RecordingDataset(run["x"], run["y"])
            mod["train"](
                model,
                data,
                run["batch_size"],
                run["lr"],
                run["epochs"],
                seed=run["seed"],
                out=str(out),
                log=lambda *a, **k: logged.append(" ".join(str(v) for v in a)),
            )
            calls.append(("train", ""))
            saved = torch.load(out, weights_only=True) if out.is_file() else None
            mod["teardown"]()
    return {
        "setup": _setup_result(got),
        "calls": [list(c) for c in calls],
        "reads": torch.tensor(data.reads, dtype=torch.long),
        "logged": logged,
        "saved": dict(saved) if isinstance(saved, dict) else None,
        "final": state(model),
    }


def _gpu_probe(mod: dict, rank: int) -> dict:
    """``setup()`` as a faked rank of a multi-node GPU job."""
    env, calls = node_env(rank), []
    with gpu_node(env, calls):
        got = mod["setup"]()
    return {"env": env, "calls": calls, "setup": _setup_result(got)}


def run_rank(ns: dict, inputs: dict, case: dict, rank: int, world: int) -> dict:
    """Every run of the case this rank takes part in, then the faked GPU node."""
    path = Path(FILE)
    if path.is_file():
        guards.refuse_mentions({FILE: path.read_text()}, FORBID_MODULES)
    with guards.recorded_process_group([]), no_cuda():
        mod = guards.load_student_file(FILE)
    runs = per_run(case, rank, world, lambda run, r, n: _one_run(mod, run, r, n))
    return {"runs": runs, "gpu": _gpu_probe(mod, rank)}


def expected_reads(case: dict) -> list[list[int]]:
    """What each rank must read: its ``DistributedSampler`` shard every epoch, in full
    batches (the oracle)."""
    n, w, b = len(case["y"]), case["ranks"], case["batch_size"]
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
    return f"{case['ranks']} ranks, {len(case['y'])} samples, batch_size {case['batch_size']}"


def read_problem(case: dict, reads: list[list[int]]) -> str | None:
    """What is wrong with the samples each rank read (vs. :func:`expected_reads`), or None."""
    want = expected_reads(case)
    if reads == want:
        return None
    n, w, b, epochs = len(case["y"]), case["ranks"], case["batch_size"], case["epochs"]
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


#: (id(case), lr_factor) -> (case, weights): a judge asks for the oracle of a case once per
#: check; the case is kept alive with it, so its id is not reused.
_SINGLE: dict[tuple, tuple] = {}


def single_process(case: dict, lr_factor: float = 1.0) -> dict:
    """The weights of one process trained on the global batch (``single.py``'s loop)."""
    key = (id(case), lr_factor)
    if key not in _SINGLE:
        if len(_SINGLE) > 8:
            _SINGLE.clear()
        _SINGLE[key] = (case, _single_process(case, lr_factor))
    return _SINGLE[key][1]


def _single_process(case: dict, lr_factor: float) -> dict:
    w, b = case["ranks"], case["batch_size"]
    batches = single_process_batches(len(case["y"]), w * b, case["epochs"], case["seed"])
    model = tiny_net(case["dims"], case["init"])
    data = RecordingDataset(case["x"], case["y"])
    return state(sgd_on_batches(model, data, batches, case["lr"] * lr_factor))


def setup_problem(outs: list[dict], w: int) -> str | None:
    """What is wrong with ``setup()`` on some rank when CUDA is unavailable, or None."""
    for r, o in enumerate(outs):
        inits = [c[1] for c in o["calls"] if c[0] == "init"]
        if len(inits) != 1:
            return (
                f"rank {r}: setup() called dist.init_process_group {len(inits)} times; call it "
                "exactly once"
            )
        if "nccl" in inits[0] and "cpu:gloo" not in inits[0]:
            return (
                f"rank {r}: setup() asked for the NCCL backend where CUDA is not available: "
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
                f"rank {r}: setup() chose device {o['setup'][2]!r} where CUDA is not "
                "available; expected the CPU (cuda:LOCAL_RANK only when CUDA is available)"
            )
    return None


def gpu_problem(probe: dict, rank: int) -> str | None:
    """What is wrong with ``setup()`` on a faked rank of a multi-node GPU job, or None."""
    env = probe["env"]
    local, global_rank = int(env["LOCAL_RANK"]), int(env["RANK"])
    at = (
        f"on a faked GPU node (checker rank {rank}: RANK={global_rank}, LOCAL_RANK={local}, "
        f"WORLD_SIZE={env['WORLD_SIZE']}, {GPUS_PER_NODE} GPUs per node, CUDA available)"
    )
    inits = [c for c in probe["calls"] if c[0] == "init"]
    if len(inits) != 1:
        return f"{at}: setup() called dist.init_process_group {len(inits)} times; call it once"
    backend = inits[0][1]
    if backend and "nccl" not in backend:
        return f"{at}: setup() chose the {backend!r} backend; with GPUs use NCCL"
    if len(probe["setup"]) != 3:
        return f"{at}: setup() must return (rank, world_size, device), got {probe['setup'][0]}"
    got_rank, got_world, device = probe["setup"]
    if [got_rank, got_world] != [global_rank, int(env["WORLD_SIZE"])]:
        return (
            f"{at}: setup() returned rank {got_rank} and world size {got_world}; expected "
            f"{global_rank} and {env['WORLD_SIZE']} (dist.get_rank(), dist.get_world_size())"
        )
    if device == f"cuda:{global_rank}":
        return (
            f"{at}: setup() chose device {device!r}, a GPU this node does not have: RANK "
            "counts the processes of every node; the GPU of this node is LOCAL_RANK"
        )
    if device != f"cuda:{local}":
        return f"{at}: setup() chose device {device!r}; expected cuda:LOCAL_RANK = cuda:{local}"
    made_current = [c[1] for c in probe["calls"] if c[0] == "set_device"] + [inits[0][2]]
    if local not in made_current:
        return (
            f"{at}: setup() never made cuda:{local} this process's device: call "
            "torch.cuda.set_device(device) before init_process_group, or every process of "
            "the node starts NCCL on GPU 0"
        )
    return None


def weights_problem(case: dict, outs: list[dict]) -> str | None:
    """Whether every rank ends with the weights of one process on the global batch."""
    w, b = case["ranks"], case["batch_size"]
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
    w, at = case["ranks"], where(case)
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
    """What is wrong with ``setup`` / ``train`` / ``teardown`` on every rank of a run, or None."""
    w = case["ranks"]
    if len(outs) != w or any(o is None for o in outs):
        return f"expected the results of {w} ranks, got {len(outs)}"
    return (
        setup_problem(outs, w)
        or read_problem(case, [o["reads"].tolist() for o in outs])
        or weights_problem(case, outs)
        or rank0_problem(case, outs)
    )


def job_problem(job: dict, ranks: list) -> str | None:
    """The first thing wrong in a torchrun job: its runs in order, then the faked GPU node."""
    if len(ranks) != job["world_size"]:
        return f"expected the results of {job['world_size']} ranks, got {len(ranks)}"
    for run, outs in run_outputs(job, [o["runs"] for o in ranks]):
        if why := problem(run, outs):
            return why
    for r, o in enumerate(ranks):
        if why := gpu_problem(o["gpu"], r):
            return why
    return None


def judge(inputs: dict, outputs: dict) -> str:
    """Reads equal ``DistributedSampler``'s, weights equal one process on the global batch,
    the right backend and device with and without GPUs."""
    for job, ranks in zip(inputs["cases"], outputs["cases"], strict=True):
        if why := job_problem(job, ranks):
            raise CheckFailed(why)
    runs = [run for job in inputs["cases"] for run in job["runs"]]
    said = " and ".join(f"{r['ranks']} ranks x {r['batch_size']}" for r in runs)
    return (
        f"DDP on {said} samples ends with the weights of one process on the global batch; "
        f"each rank read its DistributedSampler shard, reshuffled in each of {EPOCHS} epochs; "
        "rank 0 alone logged and saved; gloo on the CPU without CUDA, NCCL on cuda:LOCAL_RANK "
        "on a faked multi-node GPU job"
    )


EXERCISE = Exercise(
    "test_ex2_ddp_train",
    ("ex2_ddp_train",),
    "DDP training equals one process on the global batch",
    make_inputs,
    judge,
    run_rank=run_rank,
    forbid_modules=FORBID_MODULES,
    timeout=120,
    visible_inputs=visible_inputs,
    files=(FILE,),
)
