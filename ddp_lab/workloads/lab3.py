"""``make lab3``: lab 3's distributed workload on whatever this machine (or job) has.

On a GPU node it trains on every GPU with NCCL; on a CPU-only machine it runs 2 processes
with gloo. It trains on CIFAR-10 when the files are in ``--data-dir`` (or can be
downloaded), on the synthetic set otherwise, and says which and why. It runs the scaling
sweep (1, 2, 4, ... processes up to every GPU; 1 and 2 on a CPU) and writes, under
``--out`` (default ``results/lab3``)::

    np1/ np2/ ...        each run's summary.json, metrics.jsonl, model.pt
    scaling.json         processes, samples/s, speed-up, efficiency, lr, warm-up and test
                         accuracy per run
    scaling.png          the plot the lab03 notebook shows: throughput, efficiency, accuracy

N processes train with a global batch N times larger, so an epoch takes N times fewer steps;
at one learning rate the N-process run learns less per epoch. The sweep follows the linear
scaling rule with warm-up (Goyal et al., 2017): N processes use N times the trainer's rate,
reached over the first tenth of the run (``--lr-scaling none``: one rate for every run).

Inside a SLURM allocation of 2 or more nodes (``sbatch cluster/lab3.sbatch``, or ``make
lab3`` inside ``salloc``) it runs one training across the allocation instead: ``srun``
starts one torchrun agent per node (``--nnodes`` = the job's nodes, c10d rendezvous on the
first host of ``scontrol show hostnames``, a port derived from the job id,
``--max-restarts=3`` with checkpoints to resume from), into
``results/lab3-slurm-<jobid>/``::

    summary.json metrics.jsonl model.pt events.jsonl   the trainer's outputs
    checkpoints/         what a restarted worker resumes from
    job.json             the plan (nodes, rendezvous, processes, data, command) and the outcome
    launch.log           every line the agents and workers printed

``--slurm on`` does so in a one-node allocation too, ``--slurm off`` never. Environment
variables of the allocation run (all optional):

    DDP_LAB_NPROC_PER_NODE  processes per node (default: the node's GPUs, 2 without GPUs)
    DDP_LAB_BACKEND         nccl or gloo (default: nccl with GPUs, gloo without)
    DDP_LAB_TRAIN_ARGS      extra trainer flags, appended last, e.g. "--epochs 5 --amp bf16"
    DDP_LAB_RDZV_PORT       rendezvous port (default: 20000 + job id modulo 10000)
    DDP_LAB_STAGE           a node-local folder (e.g. $TMPDIR): each node copies CIFAR-10
                            there before training (default: read --data-dir in place)
    DDP_LAB_SRUN_ARGS       extra srun options (e.g. --overlap, or a partition's needs)

Run it as ``make lab3`` (extra flags: ``make lab3 LAB3_ARGS="--model resnet18"``) or
``python -m ddp_lab.workloads.lab3 --help``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Mapping

import torch

from ddp_lab import options as train_options
from ddp_lab.errors import UsageError, exit_on_usage_error
from ddp_lab.workloads.labrun import (
    dataset_for,
    lab_parser,
    model_size,
    perplexity,
    plan_hardware,
    read_summary,
    train,
    training_samples,
)

PROG = "ddp_lab.workloads.lab3"
#: Rendezvous ports of SLURM jobs: below Linux's ephemeral range (32768-60999), so that no
#: outgoing connection holds one; two jobs share a port only if their ids differ by 10000k.
PORT_BASE, PORT_SPAN = 20000, 10000
#: What a node runs before its torchrun agent when DDP_LAB_STAGE is set: copy CIFAR-10 to
#: node-local scratch once (a private folder, then one rename: agents sharing a node, or a
#: copy cut short, never leave a half folder that looks complete).
STAGE_SH = (
    'set -e; src=$1; dst=$2; shift 2; f=cifar-10-batches-py; mkdir -p "$dst"; '
    'if [ ! -d "$dst/$f" ]; then tmp=$(mktemp -d "$dst/.staging.XXXXXX"); '
    'cp -r "$src/$f" "$tmp/"; mv -T "$tmp/$f" "$dst/$f" 2>/dev/null || true; rm -rf "$tmp"; fi; '
    'echo "lab3: node ${SLURM_NODEID:-?} reads CIFAR-10 from $dst/$f"; exec "$@"'
)


def build_parser() -> argparse.ArgumentParser:
    p = lab_parser(
        PROG,
        __doc__,
        None,
        "default: resnet18 on GPUs, cnn on the CPU",
        "results folder (results/lab3, or results/lab3-slurm-<jobid>)",
    )
    p.add_argument("--offline", action="store_true", help="auto never tries to download")
    p.add_argument("--batch-size", type=int, help="per process (default: 128 GPU, 32 CPU)")
    p.add_argument("--max-steps", type=int, help="per run (default: 200 GPU, 1 epoch CPU)")
    p.add_argument(
        "--slurm",
        choices=["auto", "on", "off"],
        default="auto",
        help="one run across the SLURM allocation: auto (with 2+ nodes), on, off (the sweep)",
    )
    p.add_argument(
        "--pg-timeout", type=float, default=600, help="allocation run: collective timeout, s"
    )
    p.add_argument(
        "--rdzv-timeout",
        type=float,
        default=600,
        help="allocation run: seconds the agents wait for each other (c10d join_timeout)",
    )
    lr = train_options.build_parser().get_default("lr")
    p.add_argument(
        "--lr", type=float, default=lr, help="1-process rate (the trainer's: %(default)g)"
    )
    p.add_argument(
        "--lr-scaling",
        choices=["linear", "none"],
        default="linear",
        help="linear: N processes use N x --lr after a warm-up over a tenth of the run (the "
        "linear scaling rule); none: --lr for every run",
    )
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    return p


def scaled_lr(lr: float, processes: int, run_steps: int, scaling: str) -> tuple[float, int]:
    """``(learning rate, warm-up steps)`` of a run on ``processes`` processes.

    With the linear scaling rule the global batch grows with the processes and so does the
    rate, reached by a linear warm-up over the first tenth of the run's ``run_steps``; one
    process (or ``scaling="none"``) uses ``lr`` from the first step.

    Example:
        >>> scaled_lr(0.05, 1, 312, "linear"), scaled_lr(0.05, 2, 156, "linear")
        ((0.05, 0), (0.1, 15))
        >>> scaled_lr(0.05, 4, 78, "none")
        (0.05, 0)
    """
    if scaling == "none" or processes == 1:
        return lr, 0
    return lr * processes, max(1, run_steps // 10)


def no_download(args: argparse.Namespace) -> str | None:
    """The flag that forbids downloading CIFAR-10 (``--offline``, ``--dry-run``), if any."""
    return "--offline" if args.offline else "--dry-run" if args.dry_run else None


# --------------------------------------------------------------------------- SLURM


def slurm_nodes(environ: Mapping[str, str]) -> int | None:
    """The node count of the SLURM allocation this process runs in, or None outside one.

    Example:
        >>> slurm_nodes({"SLURM_JOB_ID": "7", "SLURM_NNODES": "2"}), slurm_nodes({})
        (2, None)
    """
    if not environ.get("SLURM_JOB_ID"):
        return None
    return int(environ.get("SLURM_JOB_NUM_NODES") or environ.get("SLURM_NNODES") or 1)


def rdzv_port(job_id: str, environ: Mapping[str, str] | None = None) -> int:
    """The job's rendezvous port: ``DDP_LAB_RDZV_PORT``, else 20000 + job id % 10000 (never
    a fixed 29500: two jobs whose first node is the same would collide).

    Example:
        >>> rdzv_port("1234567", {})
        24567
    """
    given = (environ or {}).get("DDP_LAB_RDZV_PORT")
    if given:
        return int(given)
    digits = "".join(c for c in job_id if c.isdigit()) or "0"
    return PORT_BASE + int(digits) % PORT_SPAN


def job_hosts(environ: Mapping[str, str]) -> list[str]:
    """The allocation's host names, in SLURM's order (``scontrol show hostnames``)."""
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST", "")
    try:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", *([nodelist] if nodelist else [])],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError) as err:
        raise UsageError(
            f"cannot list the job's nodes with `scontrol show hostnames {nodelist}` ({err}); "
            "run inside a SLURM allocation (sbatch cluster/lab3.sbatch), or pass --slurm off"
        ) from None
    return out.split()


def plan_slurm(args: argparse.Namespace, environ: Mapping[str, str]) -> dict:
    """The allocation run: who runs what where (``job.json``'s ``plan``); see the module doc.

    Args:
        args: this program's options.
        environ: the environment (the ``SLURM_*`` and ``DDP_LAB_*`` variables).

    Returns:
        A JSON-ready dict; ``command`` is what this process runs (``srun ...`` with 2+ nodes,
        torchrun itself on one node).
    """
    job = environ["SLURM_JOB_ID"]
    nodes = slurm_nodes(environ) or 1
    hosts = job_hosts(environ)
    if len(hosts) != nodes:
        raise UsageError(
            f"scontrol lists {len(hosts)} host(s) for a job of {nodes} node(s); check "
            "SLURM_JOB_NODELIST and SLURM_NNODES"
        )
    gpus = int(environ.get("SLURM_GPUS_ON_NODE") or 0) or torch.cuda.device_count()
    nproc = int(environ.get("DDP_LAB_NPROC_PER_NODE") or gpus or 2)
    backend = environ.get("DDP_LAB_BACKEND") or ("nccl" if gpus else "gloo")
    gpu = backend == "nccl"
    data_dir = os.path.abspath(args.data_dir)
    dataset, data_reason = dataset_for(args, data_dir, no_download(args))
    stage = environ.get("DDP_LAB_STAGE") if dataset == "cifar10" else None
    out = os.path.abspath(args.out or os.path.join("results", f"lab3-slurm-{job}"))
    flags = ["--dataset", dataset, "--data-dir", os.path.abspath(stage) if stage else data_dir]
    flags += ["--model", args.model or ("resnet18" if gpu else "cnn")]
    flags += ["--batch-size", str(args.batch_size or (128 if gpu else 32))]
    flags += ["--train-size", str(args.train_size), "--backend", backend]
    steps = args.max_steps or (200 if gpu else None)
    flags += ["--max-steps", str(steps)] if steps else []
    flags += ["--pg-timeout", f"{args.pg_timeout:g}", "--no-progress"]
    flags += ["--ckpt-dir", os.path.join(out, "checkpoints"), "--resume", "--out", out]
    flags += shlex.split(environ.get("DDP_LAB_TRAIN_ARGS", ""))
    port = rdzv_port(job, environ)
    agent = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}"]
    agent += ["--max-restarts=3"]
    if nodes == 1:  # no srun inside the job's only node: a step in a step may wait forever
        agent += ["--standalone"]
    else:
        agent += [f"--nnodes={nodes}", "--rdzv-backend=c10d", f"--rdzv-id=ddp-lab3-{job}"]
        agent += [f"--rdzv-endpoint={hosts[0]}:{port}"]
        agent += [f"--rdzv-conf=join_timeout={args.rdzv_timeout:g}"]
    agent += ["-m", "ddp_lab.train", *flags]
    node = ["bash", "-c", STAGE_SH, "stage", data_dir, stage, *agent] if stage else agent
    command = node
    if nodes > 1:
        srun = ["srun", f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1"]
        srun += ["--kill-on-bad-exit=1"]
        if environ.get("SLURM_CPUS_PER_TASK"):  # srun does not inherit it (Slurm 22.05+)
            srun += [f"--cpus-per-task={environ['SLURM_CPUS_PER_TASK']}"]
        command = [*srun, *shlex.split(environ.get("DDP_LAB_SRUN_ARGS", "")), *node]
    return {
        "job_id": job,
        "nodes": nodes,
        "hosts": hosts,
        "rendezvous": None if nodes == 1 else f"{hosts[0]}:{port}",
        "processes_per_node": nproc,
        "world_size": nodes * nproc,
        "backend": backend,
        "dataset": dataset,
        "dataset_reason": data_reason,
        "data_dir": data_dir,
        "staged_to": os.path.abspath(stage) if stage else None,
        "out": out,
        "trainer_flags": flags,
        "command": command,
        "environment": {
            k: environ[k]
            for k in sorted(environ)
            if k.startswith(("DDP_LAB_", "NCCL_SOCKET", "GLOO_SOCKET", "OMP_NUM"))
        },
    }


def tee_run(cmd: list[str], log_path: str, timeout: float) -> int | None:
    """Run ``cmd``, its output shown and copied into ``log_path``; on timeout (or Ctrl-C)
    kill its whole process tree. Returns the exit code, or None after a timeout."""
    from ddp_lab.proctree import GRACE_S, SCAN_S, ProcessTree

    deadline = time.monotonic() + timeout
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )

        def copy() -> None:
            for line in proc.stdout:
                sys.stdout.write(line)
                sys.stdout.flush()
                log.write(line)
                log.flush()

        reader = threading.Thread(target=copy, daemon=True)
        reader.start()
        tree = ProcessTree(proc)
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                tree.refresh()  # agents and workers, also those in sessions of their own
                try:
                    proc.wait(SCAN_S)
                except subprocess.TimeoutExpired:
                    pass
        finally:  # a timeout, Ctrl-C, or a process the command left behind
            timed_out = proc.poll() is None
            if timed_out or tree.alive(tree.refresh()):
                tree.terminate(GRACE_S)
            reader.join(10)
    return None if timed_out else proc.returncode


def run_slurm(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    """Plan the allocation run, say it, run it, and write ``job.json``."""
    plan = plan_slurm(args, environ)
    where = f"{plan['nodes']} node(s) x {plan['processes_per_node']} process(es)"
    print(f"{PROG}: SLURM job {plan['job_id']}: {where}, backend {plan['backend']}", flush=True)
    if plan["rendezvous"]:
        print(
            f"{PROG}: one torchrun agent per node (srun), c10d rendezvous on "
            f"{plan['rendezvous']}, --max-restarts=3",
            flush=True,
        )
    print(f"{PROG}: dataset {plan['dataset']}: {plan['dataset_reason']}", flush=True)
    if plan["staged_to"]:
        print(f"{PROG}: each node copies CIFAR-10 to {plan['staged_to']} first", flush=True)
    print(f"{PROG}: results in {plan['out']}/", flush=True)
    if args.dry_run:
        print(shlex.join(plan["command"]), flush=True)
        return 0
    os.makedirs(plan["out"], exist_ok=True)
    job_path = os.path.join(plan["out"], "job.json")
    record = {"plan": plan, "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
    with open(job_path, "w") as f:
        json.dump(record, f, indent=2)
    t0 = time.monotonic()
    code = tee_run(plan["command"], os.path.join(plan["out"], "launch.log"), args.timeout)
    seconds = time.monotonic() - t0
    record.update(exit_code=code, seconds=seconds)
    summary_path = os.path.join(plan["out"], "summary.json")
    if code == 0 and os.path.isfile(summary_path):
        with open(summary_path) as f:
            s = json.load(f)
        record["result"] = {k: s[k] for k in ("world_size", "samples_per_s", "accuracy", "steps")}
    with open(job_path, "w") as f:
        json.dump(record, f, indent=2)
    if code is None:
        raise UsageError(f"the run took longer than --timeout {args.timeout:g} s and was killed")
    if code != 0 or "result" not in record:
        raise UsageError(
            f"the run failed (exit {code}); see {plan['out']}/launch.log and each node's "
            "torchrun lines there"
        )
    r = record["result"]
    print(
        f"{PROG}: {r['world_size']} process(es) on {plan['nodes']} node(s): "
        f"{r['samples_per_s']:.0f} samples/s, test accuracy {r['accuracy']:.3f}, "
        f"{seconds:.1f} s",
        flush=True,
    )
    return 0


# --------------------------------------------------------------------------- the sweep


def run_sweep(args: argparse.Namespace) -> int:
    """Plan, say the plan, run the sweep, write ``scaling.json`` and ``scaling.png``."""
    counts, backend, hw_reason = plan_hardware(args.max_procs)
    gpu = backend == "nccl"
    out_dir = args.out or os.path.join("results", "lab3")
    dataset, data_reason = dataset_for(args, args.data_dir, no_download(args))
    model = args.model or ("resnet18" if gpu else "cnn")
    batch = args.batch_size or (128 if gpu else 32)
    steps = args.max_steps or (200 if gpu else None)
    train_samples = training_samples(dataset, args.train_size)
    print(f"{PROG}: {hw_reason}", flush=True)
    print(f"{PROG}: dataset {dataset}: {data_reason}", flush=True)
    print(
        f"{PROG}: model {model_size(model, dataset)}, batch {batch} per process, sweep over "
        f"{counts} process(es); results in {out_dir}/",
        flush=True,
    )
    if args.lr_scaling == "linear":
        print(
            f"{PROG}: every run sees the same samples; N processes take N times fewer steps of "
            f"N times the batch, so they use N x lr {args.lr:g} after a warm-up over a tenth of "
            "the run (the linear scaling rule; --lr-scaling none: one rate for all)",
            flush=True,
        )
    else:
        print(
            f"{PROG}: every run at lr {args.lr:g} (--lr-scaling none): N processes take N "
            "times fewer steps per epoch with it, so expect lower accuracy per epoch",
            flush=True,
        )
    if args.dry_run:
        return 0

    os.makedirs(out_dir, exist_ok=True)
    records = []
    for n in counts:
        out = os.path.join(out_dir, f"np{n}")
        flags = ["--dataset", dataset, "--data-dir", args.data_dir, "--model", model]
        flags += ["--batch-size", str(batch), "--train-size", str(args.train_size)]
        flags += ["--backend", backend, "--out", out, "--no-progress"]
        if steps:
            flags += ["--max-steps", str(steps)]
        run_steps = steps or math.ceil(train_samples / (batch * n))
        lr, warmup = scaled_lr(args.lr, n, run_steps, args.lr_scaling)
        flags += ["--lr", f"{lr:g}", "--warmup-steps", str(warmup)]
        print(f"{PROG}: training with {n} process(es) at lr {lr:g} ...", flush=True)
        train(f"{n}-process", flags, n, args.timeout)
        s = read_summary(out)
        keep = ("samples_per_s", "seconds", "accuracy", "perplexity", "steps", "global_batch")
        records.append(
            {"processes": n, "lr": lr, "warmup_steps": warmup, **{k: s[k] for k in keep if k in s}}
        )
        print(
            f"{PROG}:   {n} process(es): {s['samples_per_s']:.0f} samples/s, "
            f"test accuracy {s['accuracy']:.3f}{perplexity(s)} after {s['steps']} steps of "
            f"{s['global_batch']} samples, {s['seconds']:.1f} s",
            flush=True,
        )
    base = records[0]["samples_per_s"] / records[0]["processes"]
    for r in records:
        r["speedup"] = r["samples_per_s"] / records[0]["samples_per_s"]
        r["efficiency"] = r["samples_per_s"] / (base * r["processes"])
    where = "GPU" if gpu else "CPU"
    result = {
        "backend": backend,
        "device": where.lower(),
        "dataset": dataset,
        "model": model,
        "batch_per_process": batch,
        "lr_scaling": args.lr_scaling,
        "hardware_reason": hw_reason,
        "dataset_reason": data_reason,
        "runs": records,
    }
    with open(os.path.join(out_dir, "scaling.json"), "w") as f:
        json.dump(result, f, indent=2)
    from ddp_lab.figures.lab03_scaling import plot_scaling

    plot_scaling(
        [r["processes"] for r in records],
        [r["samples_per_s"] for r in records],
        title=f"{model} on {dataset}, {backend} ({where})",
        path=os.path.join(out_dir, "scaling.png"),
        accuracy=[r["accuracy"] for r in records],
        lrs=[r["lr"] for r in records],
    )
    top = records[-1]
    first = records[0]
    print(
        f"{PROG}: {top['processes']} process(es) ran at {top['speedup']:.2f}x the 1-process "
        f"throughput (efficiency {top['efficiency']:.0%}) and reached test accuracy "
        f"{top['accuracy']:.3f}{perplexity(top)} against {first['accuracy']:.3f}"
        f"{perplexity(first)} in {top['steps']} steps "
        f"against {first['steps']}; see {out_dir}/scaling.png",
        flush=True,
    )
    return 0


@exit_on_usage_error(PROG)
def main(argv: list[str] | None = None) -> int:
    """The allocation run inside a SLURM job of 2+ nodes (or with ``--slurm on``), the
    sweep otherwise; each says which and why."""
    args = build_parser().parse_args(argv)
    environ = dict(os.environ)
    nodes = slurm_nodes(environ)
    if args.slurm == "on" and nodes is None:
        raise UsageError("--slurm on needs a SLURM allocation (SLURM_JOB_ID is not set)")
    if args.slurm == "on" or (args.slurm == "auto" and (nodes or 0) >= 2):
        if shutil.which("srun") is None and (nodes or 0) >= 2:
            raise UsageError("srun is not on PATH; run on the cluster, or pass --slurm off")
        return run_slurm(args, environ)
    if nodes is not None:
        print(
            f"{PROG}: SLURM job {environ['SLURM_JOB_ID']} has one node: the sweep on this "
            "node (--slurm on for one run on the allocation)",
            flush=True,
        )
    return run_sweep(args)


if __name__ == "__main__":
    sys.exit(main())
