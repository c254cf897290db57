"""``make lab8``: lab 8's workload through the trainer with ``--profile`` on every GPU of this
node (or 2 CPU processes with gloo): a ``torch.profiler`` trace of a few DDP steps on every
rank, one step per rank drawn as a timeline, and each phase's time per rank and step.

Under ``--out`` (default ``results/lab8``)::

    run/                 the trainer's summary.json, metrics.jsonl, model.pt
    trace/               trace-rank<r>.json per rank: Chrome trace JSON (open it in
                         ui.perfetto.dev, chrome://tracing or TensorBoard)
    phases.json          per rank and profiled step: the step's length, each phase's
                         (data, forward, backward, optimizer) and the collectives' summed
                         durations, in ms
    timeline.png         the last profiled step of every rank

Which part of the communication the backward pass hides, and which rank makes the others
wait, is what the lab asks you to read from these traces: this run does not say.

Run it as ``make lab8`` (extra flags: ``make lab8 LAB8_ARGS="--model mlp --batch-size 64"``)
or ``python -m ddp_lab.workloads.lab8 --help``.
"""

from __future__ import annotations

import glob
import json
import os
import statistics
import sys

from ddp_lab.errors import UsageError, exit_on_usage_error
from ddp_lab.figures.profile import load_events, step_marks, step_timeline
from ddp_lab.profiling import (
    COLLECTIVE_PREFIXES,
    DEFAULT_SCHEDULE,
    PHASES,
    PREFIX,
    parse_schedule,
    trace_path,
)
from ddp_lab.workloads.labrun import dataset_for, lab_parser, plan_hardware, read_summary, train

PROG = "ddp_lab.workloads.lab8"


def phase_times(events: list[dict]) -> list[dict]:
    """Per profiled step of one rank's trace (its ``ProfilerStep#k`` range): the step's
    length, each trainer phase's and the collectives' summed durations, in ms.

    Example:
        >>> ev = [{"name": "ProfilerStep#3", "ts": 0, "dur": 10_000},
        ...       {"name": "ddp_lab: forward", "ts": 100, "dur": 4_000},
        ...       {"name": "gloo:all_reduce", "ts": 6_000, "dur": 2_500}]
        >>> phase_times(ev)[0]["forward_ms"], phase_times(ev)[0]["collectives_ms"]
        (4.0, 2.5)
    """
    out = []
    for mark in step_marks(events):
        t0, t1 = mark["ts"], mark["ts"] + mark["dur"]
        inside = [e for e in events if t0 <= e["ts"] < t1]
        row = {"step": int(mark["name"].split("#")[1]), "step_ms": mark["dur"] / 1e3}
        for phase in PHASES:
            row[f"{phase}_ms"] = sum(e["dur"] for e in inside if e["name"] == PREFIX + phase) / 1e3
        comm = (e["dur"] for e in inside if e["name"].startswith(COLLECTIVE_PREFIXES))
        row["collectives_ms"] = sum(comm) / 1e3
        out.append(row)
    return out


def build_parser():
    p = lab_parser(PROG, __doc__, "results/lab8", "default: resnet18 on GPUs, cnn on the CPU")
    p.add_argument("--batch-size", type=int, default=None, help="per process (128 GPU, 32 CPU)")
    wait, warmup, active = DEFAULT_SCHEDULE
    p.add_argument(
        "--profile-steps",
        default=f"{wait},{warmup},{active}",
        help="WAIT,WARMUP,ACTIVE optimizer steps of the profiler's schedule (default: %(default)s)",
    )
    return p


@exit_on_usage_error(PROG)
def main(argv: list[str] | None = None) -> int:
    """Plan, run the profiled job, write ``phases.json`` and ``timeline.png``."""
    args = build_parser().parse_args(argv)
    try:
        wait, warmup, active = parse_schedule(args.profile_steps)
    except ValueError:
        raise UsageError(
            f"--profile-steps takes WAIT,WARMUP,ACTIVE (ACTIVE >= 1), got {args.profile_steps!r}"
        ) from None
    counts, backend, hw_reason = plan_hardware(args.max_procs)
    nproc, gpu = counts[-1], backend == "nccl"
    if nproc < 2:
        raise UsageError("lab 8 profiles communication: it needs 2 or more processes")
    dataset, data_reason = dataset_for(args)
    model = args.model or ("resnet18" if gpu else "cnn")
    batch = args.batch_size or (128 if gpu else 32)
    steps = wait + warmup + active + 1  # one more: the trace is written when ACTIVE ends
    print(f"{PROG}: {hw_reason}; {nproc} process(es)", flush=True)
    print(f"{PROG}: dataset {dataset}: {data_reason}", flush=True)
    run, traces = os.path.join(args.out, "run"), os.path.join(args.out, "trace")
    for old in glob.glob(trace_path(traces, "*")):  # an earlier, larger run's traces
        os.remove(old)
    flags = ["--dataset", dataset, "--data-dir", args.data_dir, "--model", model]
    flags += ["--batch-size", str(batch), "--train-size", str(args.train_size)]
    flags += ["--max-steps", str(steps), "--backend", backend, "--no-progress", "--seed", "0"]
    flags += ["--out", run, "--profile", traces, "--profile-steps", args.profile_steps]
    flags += ["--test-size", "256"]  # the evaluation is not what this lab looks at
    print(f"{PROG}: {model}, batch {batch} per process, profiling steps {wait + warmup + 1}"
          f" to {wait + warmup + active} ...", flush=True)  # fmt: skip
    train("profiled", flags, nproc, args.timeout)
    paths = [trace_path(traces, r) for r in range(nproc)]
    table = {f"rank{r}": phase_times(load_events(p)) for r, p in enumerate(paths)}
    result = {
        "backend": backend,
        "processes": nproc,
        "model": model,
        "dataset": dataset,
        "batch_size": batch,
        "profile_steps": [wait, warmup, active],
        "ddp_buckets": read_summary(run)["ddp_buckets"],
        "traces": paths,
        "phases": table,
    }
    with open(os.path.join(args.out, "phases.json"), "w") as f:
        json.dump(result, f, indent=2)
    where = "GPU" if gpu else "CPU"
    fig = step_timeline(paths, title=f"{model} on {nproc} {where} ranks ({backend}), one step")
    fig.savefig(os.path.join(args.out, "timeline.png"), dpi=100)
    for rank, rows in table.items():
        med = {k: statistics.median(row[k] for row in rows) for k in rows[0] if k != "step"}
        parts = ", ".join(f"{k[:-3]} {v:.1f}" for k, v in med.items())
        print(f"{PROG}: {rank}, median ms per step: {parts}", flush=True)
    print(f"{PROG}: traces in {traces}/ (ui.perfetto.dev opens them); see "
          f"{args.out}/timeline.png", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
