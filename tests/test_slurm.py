"""``make lab3`` on a SLURM cluster (cluster/lab3.sbatch, ddp_lab.workloads.lab3), run on this
machine: the real sbatch script, with bash, under the ``SLURM_*`` variables of a 2-node job and with
stand-ins for ``srun``, ``scontrol`` and ``nvidia-smi`` first on ``PATH``.

The stand-ins (written into a temporary ``bin/``; each logs its call to ``$STANDIN_LOG``):

- ``srun`` starts one copy of its command per "node" (``--nodes``), all at once, with
  ``SLURM_NODEID``/``SLURM_PROCID``/``SLURM_LOCALID``/``SLURMD_NODENAME`` set as a real srun
  sets them, waits for all, kills the rest when one fails (``--kill-on-bad-exit``) and
  exits with the first failure's status;
- ``scontrol show hostnames`` prints ``localhost`` once per node (``SLURM_NNODES``): every
  "node" is this machine, so the two torchrun agents meet in a c10d rendezvous on
  ``localhost:<the job's port>``;
- ``nvidia-smi`` finds no GPU (``No devices were found``, exit 6), as on a CPU node.

1 process per "node", gloo, a few steps of the ``mlp`` (``DDP_LAB_NPROC_PER_NODE``,
``DDP_LAB_BACKEND``, ``DDP_LAB_TRAIN_ARGS``): the final ``model.pt`` equals a one-node
2-process run of the same flags bit for bit.
"""

from __future__ import annotations

import json
import os
import random
import shlex
import socket
import sys
from pathlib import Path

import pytest
import torch
from _harness import ROOT, new_leftovers, run_tree, trainer_command
from test_data import write_cifar_fixture

from ddp_lab.errors import UsageError
from ddp_lab.workloads import lab3

SRUN = r"""#!/bin/bash
# srun stand-in: one copy of the command per node, in parallel, then wait for all.
set -u
echo "srun $*" >> "$STANDIN_LOG"
nodes=${SLURM_NNODES:-1} kill_on_bad=0
while [ $# -gt 0 ]; do
  case "$1" in
    --nodes=*) nodes=${1#--nodes=} ;;
    -N) shift; nodes=$1 ;;
    --kill-on-bad-exit=1|--kill-on-bad-exit|-K) kill_on_bad=1 ;;
    --ntasks=*|--ntasks-per-node=*|--cpus-per-task=*|--overlap|--label|--export=*) ;;
    --) shift; break ;;
    -*) echo "srun (stand-in): unknown option $1" >&2; exit 2 ;;
    *) break ;;
  esac
  shift
done
pids=()
trap 'kill -TERM "${pids[@]}" 2>/dev/null' TERM INT
for i in $(seq 0 $((nodes - 1))); do
  SLURM_NODEID=$i SLURM_PROCID=$i SLURM_LOCALID=0 SLURM_STEP_ID=0 SLURM_STEP_NUM_NODES=$nodes \
    SLURM_STEP_NUM_TASKS=$nodes SLURMD_NODENAME=localhost "$@" &
  pids+=($!)
done
rc=0
for _ in "${pids[@]}"; do
  wait -n
  code=$?
  if [ "$code" -ne 0 ] && [ "$rc" -eq 0 ]; then
    rc=$code
    if [ "$kill_on_bad" = 1 ]; then kill -TERM "${pids[@]}" 2>/dev/null; fi
  fi
done
exit "$rc"
"""

SCONTROL = r"""#!/bin/bash
# scontrol stand-in: every node of the job is this machine.
echo "scontrol $*" >> "$STANDIN_LOG"
if [ "${1:-}" = show ] && [ "${2:-}" = hostnames ]; then
  for _ in $(seq 1 "${SLURM_NNODES:?}"); do echo localhost; done
  exit 0
fi
echo "scontrol (stand-in): only 'show hostnames' is known" >&2
exit 1
"""

NVIDIA_SMI = r"""#!/bin/bash
# nvidia-smi stand-in: a node without GPUs.
echo "nvidia-smi $*" >> "$STANDIN_LOG"
echo "No devices were found"
exit 6
"""

# 80 CIFAR-10 fixture images: 2 ranks x 16 -> 2 steps per epoch, 2 epochs (a checkpoint each).
TRAIN_ARGS = "--model mlp --batch-size 16 --epochs 2 --seed 3 --momentum 0.9 --log-every 1"


def _free_job_id() -> tuple[str, int]:
    """A job id whose rendezvous port (20000 + id % 10000) is free on this machine now."""
    for _ in range(50):
        job = str(random.randrange(1_000_000, 9_999_999))
        port = lab3.rdzv_port(job)
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
        return job, port
    raise AssertionError("no free port in 20000-29999")


def _cluster(tmp_path: Path, job: str, extra: dict | None = None) -> tuple[dict, Path]:
    """Stand-ins on PATH and the environment of a 2-node job (1 CPU process per node)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL), ("nvidia-smi", NVIDIA_SMI)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "standin.log"
    env = {
        "PATH": os.pathsep.join(
            [str(bin_dir), str(Path(sys.executable).parent), os.environ["PATH"]]
        ),
        "STANDIN_LOG": str(log),
        "SLURM_JOB_ID": job,
        "SLURM_JOB_NAME": "ddp-lab3",
        "SLURM_NNODES": "2",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_JOB_NODELIST": "node[01-02]",
        "SLURM_NODELIST": "node[01-02]",
        "SLURM_NODEID": "0",
        "SLURM_CPUS_PER_TASK": "1",
        "SLURM_NTASKS_PER_NODE": "1",
        "DDP_LAB_PYTHON": sys.executable,
        "DDP_LAB_NPROC_PER_NODE": "1",
        "DDP_LAB_BACKEND": "gloo",
        **(extra or {}),
    }
    return env, log


def _flag(flags: list[str], name: str) -> str:
    return flags[flags.index(name) + 1]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_sbatch_two_nodes_equal_one_node_bit_for_bit(tmp_path):
    """cluster/lab3.sbatch under a 2-node job: two torchrun agents (srun), c10d on the job's
    port, CIFAR-10 staged to node-local scratch; the weights equal a one-node 2-process run
    of the same flags, and the results folder holds what the README promises."""
    before = set(os.listdir("/proc"))
    course, scratch = tmp_path / "course", tmp_path / "scratch"
    write_cifar_fixture(course / "data", per_batch=16)
    job, port = _free_job_id()
    env, log = _cluster(
        tmp_path,
        job,
        {
            "SLURM_SUBMIT_DIR": str(course),
            "DDP_LAB_STAGE": str(scratch),
            "DDP_LAB_TRAIN_ARGS": TRAIN_ARGS,
        },
    )
    proc = run_tree(
        ["bash", str(ROOT / "cluster" / "lab3.sbatch")], env=env, cwd=str(tmp_path), timeout=150
    )
    out = course / "results" / f"lab3-slurm-{job}"
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    for name in (
        "summary.json",
        "metrics.jsonl",
        "model.pt",
        "events.jsonl",
        "job.json",
        "launch.log",
    ):
        assert (out / name).is_file(), f"{name} missing from {out}: {sorted(os.listdir(out))}"
    assert len(list((out / "checkpoints").glob("ckpt-*.pt"))) == 2  # one per epoch
    calls = log.read_text().splitlines()
    assert "nvidia-smi -L" in calls and "scontrol show hostnames node[01-02]" in calls
    srun = [c for c in calls if c.startswith("srun ")]
    assert len(srun) == 1 and "--nodes=2" in srun[0] and "--kill-on-bad-exit=1" in srun[0]
    assert f"--rdzv-endpoint=localhost:{port}" in srun[0] and "--rdzv-backend=c10d" in srun[0]
    assert "--nnodes=2" in srun[0] and "--max-restarts=3" in srun[0] and "29500" not in srun[0]
    assert "sees 0 GPU(s)" in text and "dataset cifar10: CIFAR-10 found in" in text
    launch = (out / "launch.log").read_text()
    for node in (0, 1):
        assert f"lab3: node {node} reads CIFAR-10 from {scratch}" in launch, launch[-3000:]
    assert sorted(os.listdir(scratch)) == ["cifar-10-batches-py"]  # no half copy left
    job_info = json.loads((out / "job.json").read_text())
    plan = job_info["plan"]
    assert job_info["exit_code"] == 0 and job_info["result"]["world_size"] == 2
    assert plan["nodes"] == 2 and plan["rendezvous"] == f"localhost:{port}"
    assert plan["staged_to"] == str(scratch) and plan["processes_per_node"] == 1
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 4 and summary["backend"] == "gloo"
    assert not new_leftovers(before, str(tmp_path))

    # the same trainer flags on one node: 2 processes under torchrun --standalone
    flags = list(plan["trainer_flags"])
    ref = tmp_path / "ref"
    for name, value in (
        ("--data-dir", course / "data"),
        ("--out", ref),
        ("--ckpt-dir", ref / "ck"),
    ):
        flags[flags.index(name) + 1] = str(value)
    one = run_tree(trainer_command(flags, nproc=2), timeout=120)
    assert one.returncode == 0, one.stderr[-3000:]
    a = torch.load(out / "model.pt", weights_only=True)
    b = torch.load(ref / "model.pt", weights_only=True)
    diff = {
        k: (a[k].double() - b[k].double()).abs().max().item()
        for k in a
        if not torch.equal(a[k], b[k])
    }
    assert not diff, f"2 nodes x 1 differ from 1 node x 2: {diff}"


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_make_lab3_in_a_two_node_allocation(tmp_path):
    """`make lab3` inside the same allocation (salloc): the allocation run, synthetic data
    said in one line (offline, no CIFAR-10), nothing staged."""
    before = set(os.listdir("/proc"))
    job, port = _free_job_id()
    env, log = _cluster(
        tmp_path,
        job,
        {
            "DDP_LAB_STAGE": str(tmp_path / "scratch"),
            "DDP_LAB_TRAIN_ARGS": "--model mlp --batch-size 16 --max-steps 3 --train-size 256 "
            "--test-size 64",
        },
    )
    out = tmp_path / "out"
    lab3_args = shlex.join(["--out", str(out), "--data-dir", str(tmp_path / "nodata"), "--offline"])
    stamp = ".venv/.installed-stamp"  # the Makefile's $(STAMP): never install here
    cmd = [
        "make",
        "--no-print-directory",
        "-o",
        stamp,
        "lab3",
        f"PY={sys.executable}",
        f"LAB3_ARGS={lab3_args}",
    ]
    proc = run_tree(cmd, env=env, timeout=120)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    assert f"c10d rendezvous on localhost:{port}" in text
    fallback = [line for line in text.splitlines() if "dataset synthetic:" in line]
    assert len(fallback) == 1 and "--offline: no download tried" in fallback[0], text[-3000:]
    plan = json.loads((out / "job.json").read_text())["plan"]
    assert plan["staged_to"] is None and not (tmp_path / "scratch").exists()
    assert json.loads((out / "summary.json").read_text())["world_size"] == 2
    assert (out / "model.pt").is_file() and (out / "launch.log").is_file()
    assert sum(c.startswith("srun ") for c in log.read_text().splitlines()) == 1
    assert not new_leftovers(before, str(tmp_path))


# --------------------------------------------------------------------------- the plan alone


def _plan(monkeypatch, nodes: int, **environ) -> dict:
    monkeypatch.setattr(lab3, "job_hosts", lambda env: [f"n{i}" for i in range(nodes)])
    env = {"SLURM_JOB_ID": "4242", "SLURM_NNODES": str(nodes), **environ}
    args = lab3.build_parser().parse_args(["--dataset", "synthetic", "--max-steps", "5"])
    return lab3.plan_slurm(args, env)


def test_plan_two_nodes_srun_one_agent_per_node_on_the_jobs_port(monkeypatch):
    p = _plan(monkeypatch, 2, SLURM_CPUS_PER_TASK="8", DDP_LAB_TRAIN_ARGS="--model mlp")
    cmd = p["command"]
    assert cmd[:5] == [
        "srun",
        "--nodes=2",
        "--ntasks=2",
        "--ntasks-per-node=1",
        "--kill-on-bad-exit=1",
    ]
    assert "--cpus-per-task=8" in cmd and "--rdzv-endpoint=n0:24242" in cmd
    assert "--rdzv-conf=join_timeout=600" in cmd and "--standalone" not in cmd
    assert p["world_size"] == 4 and p["backend"] == "gloo"  # no GPU here: 2 per node
    flags = p["trainer_flags"]
    assert _flag(flags, "--pg-timeout") == "600" and flags[-2:] == ["--model", "mlp"]
    assert "--resume" in flags and _flag(flags, "--out").endswith("results/lab3-slurm-4242")


def test_plan_one_node_runs_torchrun_itself(monkeypatch):
    p = _plan(monkeypatch, 1, DDP_LAB_NPROC_PER_NODE="3", DDP_LAB_RDZV_PORT="23456")
    assert p["command"][0] == sys.executable and "--standalone" in p["command"]
    assert p["rendezvous"] is None and p["world_size"] == 3


def test_rendezvous_port_comes_from_the_job_id():
    assert lab3.rdzv_port("1234567", {}) == 24567
    assert lab3.rdzv_port("1234568", {}) == 24568
    assert lab3.rdzv_port("77_3", {}) == 20773  # an array task's id
    assert lab3.rdzv_port("1", {"DDP_LAB_RDZV_PORT": "31000"}) == 31000


def test_outside_an_allocation_slurm_on_is_a_usage_error(monkeypatch, capsys, tmp_path):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        lab3.main(["--slurm", "on"])
    assert exit_info.value.code == 2 and "needs a SLURM allocation" in capsys.readouterr().err
    assert lab3.slurm_nodes({}) is None
    monkeypatch.setenv("PATH", str(tmp_path))  # no scontrol
    with pytest.raises(UsageError, match="scontrol show hostnames"):
        lab3.job_hosts({"SLURM_JOB_NODELIST": "node[01-02]"})


def test_sbatch_script_parses():
    assert (
        run_tree(["bash", "-n", str(ROOT / "cluster" / "lab3.sbatch")], timeout=30).returncode == 0
    )
