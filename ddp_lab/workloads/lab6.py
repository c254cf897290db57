"""``make lab6``: lab 6's fault workload through the trainer on every GPU of this node (or 2
CPU processes with gloo): a clean run, the same run with a fault injected under
``torchrun --max-restarts=3`` (checkpoints, ``--resume``), the comparison of their weights,
and the restart timeline (failure -> detection -> restart -> rendezvous -> first step).

Under ``--out`` (default ``results/lab6``)::

    clean/ fault/        each run's summary.json, metrics.jsonl, events.jsonl, model.pt
    comparison.json      bit-identical or not (max abs difference), the restart phases in
                         seconds, checkpoint size and write time, the fault
    timeline.png         the restart timeline

Run it as ``make lab6`` (extra flags: ``make lab6 LAB6_ARGS="--fault raise"``) or
``python -m ddp_lab.workloads.lab6 --help``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys

from ddp_lab.errors import UsageError, exit_on_usage_error
from ddp_lab.workloads.labrun import (
    dataset_for,
    lab_parser,
    plan_hardware,
    read_jsonl,
    train,
    weight_difference,
)

PROG = "ddp_lab.workloads.lab6"

#: torchrun's (glog-style) log line when it sees a worker fail: ``E1130 17:10:46.960000 ...``.
DETECTED = re.compile(r"^[EWI](\d\d)(\d\d) (\d\d):(\d\d):(\d\d)\.(\d{6}) .*failed \(exitcode")


def detection_time(agent_log: str, after: float) -> float | None:
    """When torchrun logged the first worker failure after ``after`` (a Unix time), read
    from its own log (local time, no year: the year of ``after``).

    Example:
        >>> t = datetime.datetime(2026, 11, 30, 17, 10, 46).timestamp()
        >>> log = "E1130 17:10:46.960000 1 api.py:1] failed (exitcode: 1) local_rank: 1"
        >>> round(detection_time(log, t - 1) - t, 2)
        0.96
    """
    year = datetime.datetime.fromtimestamp(after).year
    for line in agent_log.splitlines():
        m = DETECTED.match(line.strip())
        if m:
            mo, d, h, mi, s, us = map(int, m.groups())
            t = datetime.datetime(year, mo, d, h, mi, s, us).timestamp()
            if t >= after:
                return t
    return None


def restart_phases(events: list[dict], detected: float | None) -> list[tuple[str, float, float]]:
    """The restart's phases ``(name, start, end)`` in seconds after the fault, from the
    faulty run's ``events.jsonl`` and torchrun's detection time. (On a CPU the start-up of
    Python and torch dominates: the optimizer's first construction imports
    ``torch._dynamo``, seconds; reading a checkpoint takes milliseconds.)

    Example:
        >>> ev = [{"event": "fault", "time": 10.0, "attempt": 0},
        ...       {"event": "start", "time": 11.0, "attempt": 1},
        ...       {"event": "joined", "time": 12.5, "attempt": 1},
        ...       {"event": "resumed", "time": 13.0, "attempt": 1},
        ...       {"event": "first_step", "time": 13.2, "attempt": 1}]
        >>> [(n, round(a, 1), round(b, 1)) for n, a, b in restart_phases(ev, 10.5)][0]
        ('failure -> torchrun detects it', 0.0, 0.5)
    """
    fault = next(e["time"] for e in events if e["event"] == "fault")
    later = [e for e in events if e["time"] >= fault and e["event"] != "fault"]

    def first(name: str) -> float:
        return next(e["time"] for e in later if e["event"] == name) - fault

    marks = []
    if detected is not None:
        marks.append(("failure -> torchrun detects it", detected - fault))
    marks += [
        ("stop the group, start new workers", first("start")),
        ("imports, rendezvous, process group", first("joined")),
        ("data, model, optimizer, checkpoint", first("resumed")),
        ("first step after the restart", first("first_step")),
    ]
    phases, t = [], 0.0
    for name, end in marks:
        phases.append((name, t, max(t, end)))
        t = max(t, end)
    return phases


def build_parser() -> argparse.ArgumentParser:
    p = lab_parser(PROG, __doc__, "results/lab6", "default: resnet18 on GPUs, mlp on the CPU")
    p.add_argument("--batch-size", type=int, default=None, help="per process (128 GPU, 32 CPU)")
    p.add_argument("--max-steps", type=int, default=None, help="steps (default 200 GPU, 80 CPU)")
    p.add_argument("--ckpt-every", type=int, default=None, help="default: a fifth of the steps")
    p.add_argument("--fail-at-step", type=int, default=None, help="default: 60%% of the steps")
    p.add_argument(
        "--fault", choices=["raise", "sigkill", "hang"], default="sigkill", help="fault kind"
    )
    p.add_argument("--pg-timeout", type=float, default=20, help="seconds (ends a hang)")
    return p


@exit_on_usage_error(PROG)
def main(argv: list[str] | None = None) -> int:
    """Plan, run clean and faulty, compare, write ``comparison.json`` and ``timeline.png``."""
    args = build_parser().parse_args(argv)
    counts, backend, hw_reason = plan_hardware(args.max_procs)
    nproc, gpu = counts[-1], backend == "nccl"
    if nproc < 2:
        raise UsageError(
            "lab 6 needs 2 or more processes (a fault needs a peer); raise --max-procs"
        )
    dataset, data_reason = dataset_for(args)
    model = args.model or ("resnet18" if gpu else "mlp")
    batch = args.batch_size or (128 if gpu else 32)
    steps = args.max_steps or (200 if gpu else 80)
    every = args.ckpt_every or max(1, steps // 5)
    fail = args.fail_at_step or max(2, int(steps * 0.6))
    print(f"{PROG}: {hw_reason}; {nproc} process(es)", flush=True)
    print(f"{PROG}: dataset {dataset}: {data_reason}", flush=True)
    common = ["--dataset", dataset, "--data-dir", args.data_dir, "--model", model]
    common += ["--batch-size", str(batch), "--train-size", str(args.train_size)]
    common += ["--max-steps", str(steps), "--backend", backend, "--no-progress", "--seed", "0"]
    common += ["--ckpt-every", str(every), "--pg-timeout", str(args.pg_timeout)]
    os.makedirs(args.out, exist_ok=True)
    outs = {name: os.path.join(args.out, name) for name in ("clean", "fault")}
    fault_flags = ["--resume", "--fail-at-step", str(fail), "--fault", args.fault]
    plans = {
        "clean": (["--ckpt-dir", os.path.join(outs["clean"], "ckpt")], 0),
        "fault": (["--ckpt-dir", os.path.join(outs["fault"], "ckpt"), *fault_flags], 3),
    }
    launched = {}
    for name, (flags, restarts) in plans.items():
        print(f"{PROG}: {name} run (--max-restarts={restarts}) {' '.join(flags)} ...", flush=True)
        for old in ("events.jsonl", "metrics.jsonl"):  # a fresh timeline for this run
            path = os.path.join(outs[name], old)
            if os.path.exists(path):
                os.remove(path)
        ckpt = plans[name][0][1]
        if os.path.isdir(ckpt):  # --resume must not find a previous make lab6's checkpoints
            for f in os.listdir(ckpt):
                os.remove(os.path.join(ckpt, f))
        launched[name] = train(
            name, [*common, *flags, "--out", outs[name]], nproc, args.timeout, restarts
        )
    identical, diff = weight_difference(outs["clean"], outs["fault"])
    events = read_jsonl(os.path.join(outs["fault"], "events.jsonl"))
    fault_time = next(e["time"] for e in events if e["event"] == "fault")
    detected = detection_time(launched["fault"].logs.get(-1, ""), fault_time)
    phases = restart_phases(events, detected)
    ckpts = read_jsonl(os.path.join(outs["clean"], "events.jsonl"))
    ckpts = [e for e in ckpts if e["event"] == "checkpoint"]
    result = {
        "backend": backend,
        "processes": nproc,
        "model": model,
        "dataset": dataset,
        "steps": steps,
        "ckpt_every": every,
        "fault": {"kind": args.fault, "step": fail},
        "bit_identical": identical,
        "max_abs_diff": diff,
        "restart_seconds": phases[-1][2],
        "phases": [{"phase": n, "start_s": s, "end_s": e} for n, s, e in phases],
        "checkpoint_bytes": ckpts[-1]["bytes"] if ckpts else None,
        "checkpoint_write_s": (
            sorted(e["seconds"] for e in ckpts)[len(ckpts) // 2] if ckpts else None
        ),
        "launch_seconds": {k: v.seconds for k, v in launched.items()},
    }
    with open(os.path.join(args.out, "comparison.json"), "w") as f:
        json.dump(result, f, indent=2)
    from ddp_lab.figures.lab06_restart import restart_timeline

    where = "GPU" if gpu else "CPU"
    fig = restart_timeline(
        phases, f"{args.fault} on one of {nproc} ranks at step {fail}, {backend} ({where})"
    )
    fig.savefig(os.path.join(args.out, "timeline.png"), dpi=100)
    verdict = "bit-identical" if identical else f"max abs difference {diff:.3g}"
    print(f"{PROG}: faulty run vs clean run: {verdict}", flush=True)
    print(
        f"{PROG}: restart took {result['restart_seconds']:.2f} s from the failure to the first "
        f"step; checkpoints {result['checkpoint_bytes']} bytes, written in "
        f"{result['checkpoint_write_s']:.3f} s (median); see {args.out}/timeline.png",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
