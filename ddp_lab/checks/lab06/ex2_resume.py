"""Exercise 2: ``train`` in ``resume.py``, checkpoints and a bit-identical resume mid-epoch.

Every rank of a torchrun job (2 ranks, then 3) receives from the checker a DDP model
(:class:`~ddp_lab.checks.lab06.common.Net`, with dropout; gradients averaged by
:func:`~ddp_lab.checks.lab06.common.ordered_mean_hook`), an optimizer with a learning-rate
schedule, and a :class:`~ddp_lab.checks.lab06.common.NoisyDataset` whose samples draw
noise from the global torch generator and a flip from Python's ``random``. The student's
``train`` follows the notebook's recipe (``train_plain``) and checkpoints every
``ckpt_every`` optimizer steps.

The checker interrupts it: the ``optimizer.step`` it handed over raises ``Preempted`` (a
``BaseException``) on every rank at a step the checker chose; then it builds everything
afresh (the same initial weights, a new optimizer and schedule, the global generators
seeded with garbage) and calls ``train`` again, which must resume from the checkpoint.
Case set, on 2 ranks (SGD with momentum) and on 3 ranks (Adam), three epochs of an uneven
data set (its length not divisible by the world size, the last batch of each epoch short):
an interruption a few steps after a checkpoint in the middle of an epoch; one right after a
checkpoint; one before the first checkpoint; one after a checkpoint at the end of an epoch;
two interruptions in one run.

The judge computes the uninterrupted run itself, in one process (every rank's generators,
batches and gradients, combined in the hook's order), and asks for: the interruption
propagated; the resumed call took exactly the steps left after the last checkpoint (not
the whole run again); one file in the checkpoint folder; and on every rank final weights
equal to the uninterrupted run's, bit for bit (``torch.equal``).
"""

from __future__ import annotations

import gc
import os
import random
import shutil
import tempfile
import types
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ddp_lab.checks import guards
from ddp_lab.checks.contract import Exercise
from ddp_lab.checks.failure import CheckFailed
from ddp_lab.checks.lab06.common import (
    RESUME_FILE,
    net,
    ordered_mean_hook,
    params,
    random_state,
)
from ddp_lab.checks.lab06.recipe import EPOCHS, dataset, make_optimizer, oracle
from ddp_lab.checks.values import max_diff, randint, same_bits, uniform

CKPT_NAME = "ckpt.pt"
#: Seconds one call of the student's train may take on a rank before the watchdog ends it.
CALL_S = 30.0


class Preempted(BaseException):  # noqa: N818 - named after what happened, like KeyboardInterrupt
    """The checker's interruption (a ``BaseException``: ``except Exception`` lets it pass)."""


# --- the case set ------------------------------------------------------------------------


def _scenarios(gen: torch.Generator, every: int, spe: int) -> list[list[int]]:
    """Interruptions (global steps done when the next ``optimizer.step`` raises)."""
    n = EPOCHS * spe
    mid = [c for c in range(spe, n, every) if c % spe]  # mid-epoch checkpoints, epoch >= 1

    def pick(options):
        return options[randint(gen, 0, len(options) - 1)]

    first = every * randint(gen, 1, spe // every - 1)  # mid-epoch checkpoint of epoch 0
    second = pick([c for c in mid if c > first])
    return [
        [pick(mid) + randint(gen, 1, every - 1)],  # a few steps after a mid-epoch checkpoint
        [pick(mid)],  # right after a checkpoint
        [randint(gen, 1, every - 1)],  # before the first checkpoint
        [spe * randint(gen, 1, EPOCHS - 1) + randint(gen, 1, every - 1)],  # after an epoch end
        [first + randint(gen, 1, every - 1), second + randint(gen, 0, every - 1)],  # twice
    ]


def case(gen: torch.Generator, world: int, scenarios: slice = slice(None)) -> dict:
    """One torchrun job on ``world`` ranks: a data set whose length is not divisible by the
    world size (``DistributedSampler`` pads) and whose per-rank shard ends with a short batch;
    checkpoints every 2 or 3 steps, a multiple of which is one epoch."""
    every = randint(gen, 2, 3)
    spe = every * randint(gen, 2, 3)  # steps per epoch
    b = randint(gen, 2, 3)
    per_rank = (spe - 1) * b + randint(gen, 1, b - 1)
    n = world * per_rank - randint(gen, 1, world - 1)
    dims = (randint(gen, 4, 6), randint(gen, 6, 10), 3)
    if world == 2:
        optimizer = {"name": "sgd", "lr": uniform(gen, 0.05, 0.2), "momentum": 0.9}
    else:
        optimizer = {"name": "adam", "lr": uniform(gen, 0.005, 0.02)}
    return {
        "world_size": world,
        "init": random_state(dims, gen),
        "x": torch.randn(n, dims[0], generator=gen),
        "y": torch.randint(0, dims[2], (n,), generator=gen),
        "dropout": uniform(gen, 0.2, 0.4),
        "noise": uniform(gen, 0.1, 0.5),
        "flip": uniform(gen, 0.2, 0.5),
        "batch_size": b,
        "every": every,
        "steps_per_epoch": spe,
        "optimizer": optimizer,
        "decay": uniform(gen, 0.05, 0.15),
        "seed": randint(gen, 0, 10**6),
        "garble": [randint(gen, 10**6, 10**7) for _ in range(3)],
        "scenarios": _scenarios(gen, every, spe)[scenarios],
    }


def make_inputs(gen: torch.Generator) -> dict:
    """Two torchrun jobs: 2 ranks (SGD with momentum), 3 ranks (Adam); five scenarios each."""
    return {"cases": [case(gen, 2), case(gen, 3)]}


def visible_inputs(gen: torch.Generator) -> dict:
    """One job on 2 ranks: after a mid-epoch checkpoint, right after one, before the first."""
    return {"cases": [case(gen, 2, slice(0, 3))]}


# --- the student's side --------------------------------------------------------------------


class _Interrupter:
    """Wraps ``optimizer.step``: raises :class:`Preempted` instead of step ``after + 1``."""

    def __init__(self, optimizer, after: int | None):
        self.done, self.fired = 0, False
        step = optimizer.step

        def interrupted_step(opt, *args, **kwargs):
            if after is not None and self.done >= after:
                self.fired = True
                raise Preempted(f"interrupted by the checker after {self.done} steps")
            out = step(*args, **kwargs)
            self.done += 1
            return out

        # a method, as the learning-rate schedule made next expects to wrap one
        optimizer.step = types.MethodType(interrupted_step, optimizer)


class _Writes:
    """During one ``train()`` call: this rank's ``torch.save`` calls into the checkpoint's
    folder (by path or by open file) and its ``dist.barrier`` calls."""

    def __init__(self, folder: Path):
        self.folder, self.saves, self.barriers = folder.resolve(), 0, 0

    def _mine(self, target) -> bool:
        name = getattr(target, "name", target)
        try:
            return Path(os.fspath(name)).resolve().parent == self.folder
        except TypeError:  # a buffer: serialising to memory writes nothing
            return False

    def __enter__(self):
        save, barrier = self._saved = (torch.save, dist.barrier)

        def counted_save(obj, f, *args, **kwargs):
            self.saves += self._mine(f)
            return save(obj, f, *args, **kwargs)

        def counted_barrier(*args, **kwargs):
            self.barriers += 1
            return barrier(*args, **kwargs)

        torch.save, dist.barrier = counted_save, counted_barrier
        return self

    def __exit__(self, *exc) -> None:
        torch.save, dist.barrier = self._saved


def _shared_folder(rank: int) -> Path:
    box = [tempfile.mkdtemp(prefix="ddp_lab-resume-") if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return Path(box[0])


def _attempt(train, spec: dict, ckpt: Path, after: int | None, rank: int, world: int, k: int):
    torch.manual_seed(spec["garble"][k] + rank)  # a new process: other generator states
    random.seed(spec["garble"][k] + rank)
    model = net(spec["init"], spec["dropout"])
    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(None, ordered_mean_hook(world))
    watches: list = []
    optimizer, scheduler = make_optimizer(
        ddp.parameters(), spec, wrap=lambda opt: watches.append(_Interrupter(opt, after))
    )
    watch = watches[0]
    propagated = False

    def why() -> str:
        return (
            f"{RESUME_FILE}: train() on rank {rank} of {world} did not return within {CALL_S:g} "
            "s: the ranks are waiting for each other (a collective or a barrier that only "
            "rank 0 calls, inside `if rank == 0:`?)"
        )

    writes = _Writes(ckpt.parent)
    try:
        with guards.call_watchdog(CALL_S, why), writes:
            train(
                ddp,
                optimizer,
                scheduler,
                dataset(spec),
                epochs=EPOCHS,
                batch_size=spec["batch_size"],
                ckpt_every=spec["every"],
                ckpt_path=str(ckpt),
                seed=spec["seed"],
            )
    except Preempted:
        propagated = True
    dist.barrier()
    out = {
        "steps": watch.done,
        "interrupted": watch.fired,
        "propagated": propagated,
        "files": sorted(os.listdir(ckpt.parent)) if rank == 0 else [],
        "saves": writes.saves,
        "barriers": writes.barriers,
        "final": params(model),
    }
    del ddp, optimizer, scheduler
    gc.collect()
    return out


def run_rank(ns: dict, inputs: dict, case: dict, rank: int, world: int) -> list[dict]:
    """Every scenario of the case on this rank: the interrupted calls, then the last one."""
    train = guards.load_student_file(RESUME_FILE)["train"]
    root = _shared_folder(rank)
    out = []
    try:
        for i, stops in enumerate(case["scenarios"]):
            folder = root / f"scenario{i}"
            if rank == 0:
                folder.mkdir()
            dist.barrier()
            start, attempts = 0, []
            for k, stop in enumerate([*stops, None]):
                after = None if stop is None else stop - start
                attempts.append(_attempt(train, case, folder / CKPT_NAME, after, rank, world, k))
                if stop is not None:
                    start = stop - stop % case["every"]
            out.append({"attempts": attempts})
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(root, ignore_errors=True)
    return out


# --- the judge -----------------------------------------------------------------------------


def scenario_text(spec: dict, stops: list[int]) -> str:
    """``"2 ranks, 6 steps an epoch, a checkpoint every 3 steps, interrupted at step 10"``."""
    at = " and ".join(str(s) for s in stops)
    return (
        f"{spec['world_size']} ranks, {len(spec['y'])} samples, {spec['steps_per_epoch']} steps "
        f"an epoch, a checkpoint every {spec['every']} steps, interrupted after step {at}"
    )


def count_problem(spec: dict, stops: list[int], attempts: list[dict]) -> str | None:
    """Interruptions that did not propagate, step counts, files: what is wrong, or None."""
    at = scenario_text(spec, stops)
    every, total = spec["every"], EPOCHS * spec["steps_per_epoch"]
    start = 0
    for k, (stop, got) in enumerate(zip([*stops, None], attempts, strict=True)):
        if stop is not None and not got["interrupted"]:
            return (
                f"{at}: call {k + 1} of train() ended after {got['steps']} optimizer steps, "
                f"before the interruption after global step {stop} (it resumed from step "
                f"{start} and should have taken {stop - start} steps before it)"
            )
        if got["interrupted"] and not got["propagated"]:
            return (
                f"{at}: train() caught the checker's interruption and went on: let it "
                "propagate (it stands for a crash; no code runs after a SIGKILL)"
            )
        if stop is None and got["steps"] != total - start:
            if got["steps"] == total:
                why = "it started from scratch instead of resuming from the checkpoint"
            elif start == 0:
                why = "no checkpoint was written before the interruption, so nothing to resume"
            else:
                why = (
                    "the position within the epoch must come back too (skip the batches the "
                    "checkpointed epoch had already used)"
                )
            return (
                f"{at}: the resumed train() took {got['steps']} optimizer steps; the last "
                f"checkpoint before the interruption was after step {start}, so {total - start} "
                f"steps were left ({why})"
            )
        extra = [f for f in got["files"] if f != CKPT_NAME]
        if extra:
            return (
                f"{at}: after call {k + 1} the checkpoint folder holds {', '.join(extra)}: rank 0 "
                f"writes one file, ckpt_path, holding every rank's generator states"
            )
        if stop is not None and stop >= every and CKPT_NAME not in got["files"]:
            return f"{at}: no checkpoint file at ckpt_path after {stop} steps (one every {every})"
        if stop is not None:
            start = stop - stop % every
    return None


def weights_problem(spec: dict, stops: list[int], finals: list[dict], want: dict) -> str | None:
    """Every rank's final weights against the uninterrupted run's (``want``), bit for bit,
    or None."""
    at = scenario_text(spec, stops)
    for rank, got in enumerate(finals):
        if not same_bits(got, finals[0]):
            return (
                f"{at}: rank {rank}'s final weights differ from rank 0's by "
                f"{max_diff(got, finals[0]):.3g}: every rank must load the checkpoint (the "
                "model, the optimizer, and its own generator states)"
            )
    if not same_bits(finals[0], want):
        return (
            f"{at}: the resumed run's final weights differ from the uninterrupted run's by "
            f"{max_diff(finals[0], want):.3g} (they must be equal bit for bit): restore the "
            "optimizer and the schedule, and every rank's generators (torch's and Python's "
            "random) exactly where the uninterrupted run had them: after this epoch's "
            "iter(loader), which draws a seed from the global generator, and after the "
            "batches already done"
        )
    return None


def writer_problem(spec: dict, stops: list[int], ranks: list[dict]) -> str | None:
    """Rank 0 alone writes; every rank waits in a barrier after each checkpoint."""
    at, every = scenario_text(spec, stops), spec["every"]
    for rank, got in enumerate(ranks):
        start = 0
        for k, (stop, call) in enumerate(zip([*stops, None], got["attempts"], strict=True)):
            if rank and call.get("saves"):
                return (
                    f"{at}: rank {rank} called torch.save into the checkpoint's folder in call "
                    f"{k + 1}: rank 0 alone writes the checkpoint, the others wait for it"
                )
            written = (start + call["steps"]) // every - start // every
            if call.get("barriers", 0) < written:
                return (
                    f"{at}: call {k + 1} passed {written} checkpoint(s), but rank {rank} called "
                    f"dist.barrier() {call.get('barriers', 0)} time(s): after rank 0 writes, "
                    "every rank waits in a barrier, so none reads a file that is not there yet"
                )
            if stop is not None:
                start = stop - stop % every
    return None


def problem(spec: dict, stops: list[int], ranks: list[dict], want: dict) -> str | None:
    """The first thing wrong with one scenario (``want``: the oracle's weights), or None."""
    if len(ranks) != spec["world_size"]:
        return f"expected the results of {spec['world_size']} ranks, got {len(ranks)}"
    if why := count_problem(spec, stops, ranks[0]["attempts"]):
        return why
    if why := weights_problem(spec, stops, [r["attempts"][-1]["final"] for r in ranks], want):
        return why
    return writer_problem(spec, stops, ranks)  # right weights: who wrote, who waited


def judge(inputs: dict, outputs: dict) -> str:
    """Bit-identical final weights after every scenario's interruptions (see the module)."""
    runs = 0
    for spec, ranks in zip(inputs["cases"], outputs["cases"], strict=True):
        want = oracle(spec)
        for i, stops in enumerate(spec["scenarios"]):
            if why := problem(spec, stops, [r[i] for r in ranks], want):
                raise CheckFailed(why)
            runs += 1
    worlds = " and ".join(str(c["world_size"]) for c in inputs["cases"])
    return (
        f"train resumed {runs} interrupted runs on {worlds} ranks (mid-epoch, right after a "
        "checkpoint, before the first one, after an epoch end, twice) and ended bit-identical "
        "to the uninterrupted run on every rank"
    )


EXERCISE = Exercise(
    "test_ex2_resume",
    ("ex2_resume",),
    "checkpoint and resume mid-epoch, bit-identical",
    make_inputs,
    judge,
    run_rank=run_rank,
    forbid_modules=("ddp_lab.checkpoint", "ddp_lab.train"),
    timeout=150,
    visible_inputs=visible_inputs,
    files=(RESUME_FILE,),
)
