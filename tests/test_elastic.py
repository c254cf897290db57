"""Elastic runs: torchrun --max-restarts=3 restarts the group after an injected fault and the
run ends bit-identical to an uninterrupted one (2 and 3 processes; raise and SIGKILL); two
torchrun agents on localhost (c10d rendezvous) equal one 2-process node, also across a
restart; resuming on another number of processes re-shards the rest of the epoch."""

from __future__ import annotations

import uuid

import pytest
from _harness import trainer_command
from _trainer_helpers import (
    bit_identical,
    jsonl,
    max_abs_diff,
    reap,
    run,
    start_agent,
    summary,
    wait_all,
    weights,
)

from ddp_lab.dist import free_port

# 330 samples: 2 x 16 -> 10 steps per epoch (a tail of 10 dropped), 2 epochs.
FLAGS = ["--model", "mlp", "--train-size", "330", "--test-size", "50", "--seed", "3"]
FLAGS += ["--epochs", "2", "--momentum", "0.9", "--clip-grad-norm", "1.0"]
ELASTIC = ["--max-restarts=3"]


@pytest.fixture(scope="module")
def clean2(tmp_path_factory):
    """The uninterrupted 2-process run every test here compares with."""
    out = tmp_path_factory.mktemp("clean2") / "out"
    proc, left = run([*FLAGS, "--batch-size", "16"], out, nproc=2)
    assert proc.returncode == 0 and not left, proc.stderr[-2000:]
    return out


def _faulty(tmp_path, kind: str, rank: int = 1) -> list[str]:
    return [
        "--ckpt-dir",
        str(tmp_path / "ck"),
        "--ckpt-every",
        "4",
        "--resume",
        "--fail-at-step",
        "7",
        "--fault",
        kind,
        "--fail-rank",
        str(rank),
    ]


def _restart_time(out) -> float:
    """Seconds from the fault to the first step after the restart (events.jsonl)."""
    events = jsonl(out / "events.jsonl")
    fault = next(e for e in events if e["event"] == "fault")
    first = next(e for e in events if e["event"] == "first_step" and e["attempt"] == 1)
    return first["time"] - fault["time"]


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["raise", "sigkill"])
def test_restarted_run_is_bit_identical_to_the_uninterrupted_one(clean2, tmp_path, kind):
    out = tmp_path / "out"
    proc, left = run(
        [*FLAGS, "--batch-size", "16", *_faulty(tmp_path, kind)],
        out,
        nproc=2,
        torchrun_args=ELASTIC,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not left
    s = summary(out)
    assert s["attempt"] == 1 and s["resumed_from"] == 4 and s["steps"] == 20
    assert bit_identical(weights(out), weights(clean2))
    # metrics.jsonl reads like the uninterrupted run's: each record once, in order
    assert [r["step"] for r in jsonl(out / "metrics.jsonl")] == [10, 20]
    print(f"{kind}: restart (fault -> first step after it) {_restart_time(out):.1f} s")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_three_processes_restart_bit_identical(tmp_path):
    """3 ranks add gradients in a ring, so the all-reduce's order of additions matters: the
    resumed run settles DDP's buckets first (ddp_lab.train.settle_buckets) to add in the
    uninterrupted run's order. The cnn adds BatchNorm buffers to the state."""
    flags = [*FLAGS, "--model", "cnn", "--batch-size", "8", "--max-steps", "10"]
    clean, left = run(flags, tmp_path / "clean", nproc=3)
    assert clean.returncode == 0 and not left, clean.stderr[-2000:]
    proc, left = run(
        [*flags, *_faulty(tmp_path, "sigkill", rank=2)],
        tmp_path / "out",
        nproc=3,
        torchrun_args=ELASTIC,
    )
    assert proc.returncode == 0 and not left, proc.stderr[-3000:]
    assert summary(tmp_path / "out")["attempt"] == 1
    a, b = weights(tmp_path / "clean"), weights(tmp_path / "out")
    assert bit_identical(a, b), f"max abs diff {max_abs_diff(a, b):.3g}"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_resume_on_another_world_size_reshards_the_rest_of_the_epoch(clean2, tmp_path):
    """2 x 16 for 7 steps, then 1 x 32 from the checkpoint: the remaining samples of epoch 0
    are re-sharded, no sample read twice or skipped; the end equals the uninterrupted 2 x 16
    run to float rounding (1 x 32 and 2 x 16 add gradients in another order)."""
    ckpts = ["--ckpt-dir", str(tmp_path / "ck"), "--ckpt-every", "7"]
    first, left = run(
        [*FLAGS, "--batch-size", "16", "--max-steps", "7", *ckpts], tmp_path / "a", nproc=2
    )
    assert first.returncode == 0 and not left, first.stderr[-2000:]
    second, left = run([*FLAGS, "--batch-size", "32", *ckpts, "--resume"], tmp_path / "b")
    assert second.returncode == 0 and not left, second.stderr[-2000:]
    assert "resuming a 2-process checkpoint on 1 process(es)" in second.stderr
    assert "re-sharded" in second.stderr
    s = summary(tmp_path / "b")
    assert s["resumed_from"] == 7 and s["steps"] == summary(clean2)["steps"] == 20
    diff = max_abs_diff(weights(tmp_path / "b"), weights(clean2))
    print(f"2 x 16 -> 1 x 32 after step 7 vs 2 x 16 throughout: max abs diff {diff:.3g}")
    assert diff <= 1e-5


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_agents_on_localhost_equal_one_node_also_across_a_restart(clean2, tmp_path):
    """Two torchrun agents (--nnodes=2, one process each, c10d rendezvous on a free port);
    one agent's worker is SIGKILLed at step 7, both agents restart their workers, and the
    run ends bit-identical to the one-node 2-process run."""
    out = tmp_path / "out"
    args = [*FLAGS, "--batch-size", "16", *_faulty(tmp_path, "sigkill", rank=1)]
    args += ["--out", str(out), "--no-progress"]
    agent = [
        "--nnodes=2",
        "--nproc_per_node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=localhost:{free_port()}",
        f"--rdzv-id={uuid.uuid4().hex[:8]}",
        "--max-restarts=3",
    ]
    torchrun = trainer_command(args, nproc=2)[0]
    cmd = [torchrun, *agent, "-m", "ddp_lab.train", *args]
    agents = [start_agent(cmd, str(tmp_path / f"agent{i}.log")) for i in range(2)]
    try:
        codes = wait_all(agents, timeout=240)
    finally:
        left = reap(str(out))
    logs = "\n".join((tmp_path / f"agent{i}.log").read_text()[-2000:] for i in range(2))
    assert codes == [0, 0], logs
    assert not left
    s = summary(out)
    assert s["world_size"] == 2 and s["resumed_from"] == 4
    # the healthy agent restarts its worker with TORCHELASTIC_RESTART_COUNT still 0: the
    # fault fired once all the same (events.jsonl knows this job's fault)
    events = [e["event"] for e in jsonl(out / "events.jsonl")]
    assert events.count("fault") == 1 and events.count("resumed") == 1
    assert bit_identical(weights(out), weights(clean2))
