"""Jobs that hang, for exercise 4: real per-rank logs of data-parallel loops whose ranks part.

Every job is the notebook's ``hang_train.py`` loop in small (a linear model, data-parallel by
hand), run on a group of ``world_size`` gloo ranks with ``TORCH_DISTRIBUTED_DEBUG=DETAIL``,
with one divergence drawn from a family of real causes:

- ``"rank_only"``: one rank calls a collective that no other rank calls (a ``reduce``, a
  ``broadcast`` or a ``barrier`` hidden in a logging helper, at a logging step);
- ``"uneven"``: one rank's shard holds more batches, so it takes one more step per epoch;
- ``"skip"``: one rank skips a step on a condition (its loss is not finite);
- ``"shape"``: at one step one rank all-reduces a tensor of another shape;
- ``"dtype"``: at one step one rank all-reduces a tensor of another dtype.

What every rank of a job prints, in this order (its *log*):

- ``rank R: N samples, batch_size B, S steps per epoch``;
- at a logging step, on rank 0 only: ``epoch E step K: loss L``;
- ``rank R: epoch E step K: loss is nan, skipping the step`` when it skips one;
- ``rank R: epoch E done after S steps`` at the end of an epoch;
- then the error it ended with, as Python prints it (``Traceback ...``, and with ``DETAIL``
  ``RuntimeError: Detected mismatch between collectives on ranks. Rank R is running
  collective: CollectiveFingerPrint(SequenceNumber=...)``).

Each step calls one ``all_reduce`` of ``features + 2`` float64 values (gradient, loss sum,
sample count); every logging step (``step + 1`` divisible by ``log_every``) one more
``all_reduce`` (``MAX``) of a float64 scalar on every rank; the job ends with a ``barrier``.

All of a grading run's jobs run in one ``torchrun`` launch of 3 ranks, each job on a fresh
process group of its own (ranks 0 and 1, or 0 to 2), so that sequence numbers start at 0 for
every job. The truth of each job (which rank, which collective, which cause) is known by
construction; the grader keeps it out of the student's process.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import sys
import tempfile
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from ddp_lab.checks.values import randint

CAUSES = ("rank_only", "uneven", "skip", "shape", "dtype")
#: What a job's settings say besides its logs (its command line).
JOB_KEYS = ("world_size", "features", "batch_size", "log_every", "epochs")
#: Seconds a job's collective may wait: a safety net (every job fails at once under DETAIL).
GROUP_S = 10.0
LAUNCH_S = 120.0


def per_epoch(steps: int, log_every: int) -> int:
    """Collectives of one epoch of a rank that takes ``steps`` steps."""
    return steps + steps // log_every


def before(spec: dict, epoch: int, step: int) -> int:
    """Collectives a rank of the common step count has called before (epoch, step)."""
    s, le = spec["steps"], spec["log_every"]
    return epoch * per_epoch(s, le) + step + step // le


def _logging_steps(spec: dict) -> list[tuple[int, int]]:
    le = spec["log_every"]
    return [
        (e, k) for e in range(spec["epochs"]) for k in range(spec["steps"]) if (k + 1) % le == 0
    ]


def draw(gen: torch.Generator, world: int, cause: str) -> tuple[dict, dict]:
    """One job: (spec, truth). World 2 draws the odd rank from {0, 1}, world 3 from {1, 2}."""
    b, le, steps = randint(gen, 2, 3), randint(gen, 1, 3), randint(gen, 3, 5)
    spec = {
        "world_size": world,
        "features": randint(gen, 2, 5),
        "batch_size": b,
        "log_every": le,
        "epochs": randint(gen, 1, 2),
        "steps": steps,
        "cause": cause,
        "rank": randint(gen, 0, 1) if world == 2 else randint(gen, 1, 2),
    }
    spec["samples"] = [randint(gen, (steps - 1) * b + 1, steps * b) for _ in range(world)]
    if cause == "uneven":
        spec["samples"][spec["rank"]] += b  # one batch more: one step more per epoch
        spec["epochs"] = 2  # the extra step pairs with the next epoch's first: DETAIL is silent
        return spec, {"rank": spec["rank"], "collective": per_epoch(steps, le), "cause": cause}
    if cause == "rank_only":
        # not at the very last step: there the others' next call is the final barrier,
        # and a stray barrier would pass DETAIL's check as theirs
        logs = [ek for ek in _logging_steps(spec) if ek != (spec["epochs"] - 1, steps - 1)]
        if not logs:
            spec["epochs"] = 2
            logs = _logging_steps(spec)[:-1]
        e, k = logs[randint(gen, 0, len(logs) - 1)]
        spec["at"] = [e, k]
        spec["op"] = ("reduce", "broadcast", "barrier")[randint(gen, 0, 2)]
        spec["after_log"] = bool(randint(gen, 0, 1))
        where = before(spec, e, k) + 1 + int(spec["after_log"])
        return spec, {"rank": spec["rank"], "collective": where, "cause": cause}
    e, k = randint(gen, 0, spec["epochs"] - 1), randint(gen, 0, steps - 1)
    spec["at"] = [e, k]
    return spec, {"rank": spec["rank"], "collective": before(spec, e, k), "cause": cause}


def sample_jobs(seed: int, n: int = 2) -> list[dict]:
    """``n`` jobs of random causes on 2 or 3 ranks, run now: ``{"job", "logs"}`` each (what
    the notebook shows; the causes are not told)."""
    gen = torch.Generator().manual_seed(seed)
    specs = []
    for _ in range(n):
        cause = CAUSES[randint(gen, 0, len(CAUSES) - 1)]
        specs.append(draw(gen, randint(gen, 2, 3), cause)[0])
    return [
        {"job": {k: s[k] for k in JOB_KEYS}, "logs": log}
        for s, log in zip(specs, run_jobs(specs), strict=True)
    ]


def _train(spec: dict, group, rank: int) -> None:
    """The job's loop on this rank (prints its log; raises where torch raises). What the
    tensors hold does not matter here, only which collectives each rank calls with which
    shapes and dtypes."""
    b, every, d = spec["batch_size"], spec["log_every"], spec["features"]
    n = spec["samples"][rank]
    steps = -(-n // b)
    odd, at = rank == spec["rank"], tuple(spec.get("at", (-1, -1)))
    print(f"rank {rank}: {n} samples, batch_size {b}, {steps} steps per epoch")
    for epoch in range(spec["epochs"]):
        for step in range(steps):
            fault = spec["cause"] if odd and (epoch, step) == at else None
            if fault == "skip":
                print(f"rank {rank}: epoch {epoch} step {step}: loss is nan, skipping the step")
                continue
            size = min(b, n - step * b)
            sums = torch.full((d + 2,), float(size), dtype=torch.float64)  # grad, loss, count
            if fault == "shape":
                sums = sums[1:]  # one value left out
            elif fault == "dtype":
                sums = sums.float()
            dist.all_reduce(sums, group=group)
            if (step + 1) % every == 0:
                _log(spec, group, rank, fault == "rank_only", epoch, step, float(sums[-1]))
        print(f"rank {rank}: epoch {epoch} done after {steps} steps")
    dist.barrier(group=group)


def _log(spec, group, rank: int, stray: bool, epoch: int, step: int, seen: float) -> None:
    """A logging step: the largest error on every rank (and, at the fault, a stray call)."""
    if stray and not spec["after_log"]:
        _stray(spec, group, rank)
    largest = torch.tensor(seen, dtype=torch.float64)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=group)
    if stray and spec["after_log"]:
        _stray(spec, group, rank)
    if rank == 0:
        print(f"epoch {epoch} step {step}: loss {1.0 / (1.0 + epoch + step + seen):.4f}")


def _stray(spec: dict, group, rank: int) -> None:
    """The collective only one rank calls."""
    value = torch.ones((), dtype=torch.float64)
    if spec["op"] == "reduce":
        dist.reduce(value, dst=0, group=group)
    elif spec["op"] == "broadcast":
        dist.broadcast(value, src=rank, group=group)
    else:
        dist.barrier(group=group)


def _worker(specs_path: str, out_dir: str) -> None:
    """One rank of the launch: every job on a process group of its own; logs to a file."""
    specs = torch.load(specs_path, weights_only=True)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=LAUNCH_S))
    rank = dist.get_rank()
    logs: list[str | None] = []
    for spec in specs:
        members = list(range(spec["world_size"]))
        group = dist.new_group(members, timeout=datetime.timedelta(seconds=GROUP_S))
        if rank not in members:
            logs.append(None)
            continue
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            try:
                _train(spec, group, rank)
            except Exception:  # noqa: BLE001 - the error is the log's last part
                print(traceback.format_exc().rstrip())
        logs.append(printed.getvalue())
    torch.save(logs, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def run_jobs(specs: list[dict]) -> list[dict[int, str]]:
    """Run the jobs (one torchrun launch of 3 ranks); every job's log per rank."""
    from ddp_lab.launch import torchrun

    with tempfile.TemporaryDirectory(prefix="ddp_lab-hangs-") as tmp:
        torch.save(specs, Path(tmp) / "specs.pt")
        torchrun(
            "ddp_lab.checks.lab06.hang_jobs",
            [str(Path(tmp) / "specs.pt"), tmp],
            nproc=3,
            module=True,
            timeout=LAUNCH_S,
            env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"},
            stream=False,
        )
        per_rank = [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=True) for r in range(3)]
    return [{r: per_rank[r][i] for r in range(spec["world_size"])} for i, spec in enumerate(specs)]


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
