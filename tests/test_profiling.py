"""``--profile DIR`` and ``make lab8``: a trace per rank that loads and holds the trainer's
ranges, one all-reduce per DDP bucket and profiled step, and not a single changed weight;
the phase table and the timeline."""

from __future__ import annotations

import collections
import json

import pytest
from _trainer_helpers import bit_identical, run, summary, weights

from ddp_lab.errors import UsageError
from ddp_lab.figures.profile import load_events, step_timeline
from ddp_lab.options import parse_args
from ddp_lab.profiling import BUCKET, PHASES, PREFIX, parse_schedule, trace_path
from ddp_lab.workloads import lab8

ARGS = ["--model", "cnn", "--dataset", "synthetic", "--train-size", "640", "--test-size", "64",
        "--max-steps", "7"]  # fmt: skip


def test_the_schedule_flag_is_checked():
    assert parse_schedule("2,1,3") == (2, 1, 3)
    for bad in ("1,2", "1,1,0", "a,b,c", "-1,0,1"):
        with pytest.raises(UsageError, match="--profile-steps"):
            parse_args([f"--profile-steps={bad}"])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_profiled_run_writes_every_ranks_trace_and_changes_no_weight(tmp_path, capsys):
    """The profiled run is ``make lab8``'s (on 2 CPU processes, the test's sizes)."""
    plain, lab8_out = tmp_path / "plain", tmp_path / "lab8"
    proc, left = run(ARGS, plain, nproc=2)
    assert proc.returncode == 0 and not left, proc.stderr[-2000:]
    steps = sum(parse_schedule(parse_args([]).profile_steps)) + 1
    assert ARGS[ARGS.index("--max-steps") + 1] == str(steps)
    flags = ["--max-procs", "2", "--dataset", "synthetic", "--train-size", "640"]
    assert lab8.main([*flags, "--out", str(lab8_out)]) == 0
    profiled, traces = lab8_out / "run", lab8_out / "trace"
    assert bit_identical(weights(plain), weights(profiled)), "--profile changed the weights"
    assert (lab8_out / "timeline.png").stat().st_size > 10_000
    table = json.loads((lab8_out / "phases.json").read_text())["phases"]
    for rank in ("rank0", "rank1"):
        for row in table[rank]:
            inside = sum(row[f"{phase}_ms"] for phase in PHASES)
            assert 0 < inside <= row["step_ms"] and row["collectives_ms"] > 0, row
    assert "rank1, median ms per step: step" in capsys.readouterr().out
    buckets = summary(profiled)["ddp_buckets"]
    active = parse_schedule(parse_args([]).profile_steps)[2]
    for rank in (0, 1):
        events = load_events(trace_path(str(traces), rank))
        names = collections.Counter(e["name"] for e in events)
        assert sum(n.startswith("ProfilerStep#") for n in names) == active
        for phase in PHASES:
            assert names[PREFIX + phase] == active, (rank, phase, names)
        for i in range(buckets):
            assert names[f"{BUCKET}{i}"] == active, (rank, i)
        assert names["gloo:all_reduce"] >= buckets * active
        with open(trace_path(str(traces), rank)) as f:
            memory = [e for e in json.load(f)["traceEvents"] if e.get("name") == "[memory]"]
        assert memory, "profile_memory recorded no allocation"
    fig = step_timeline([trace_path(str(traces), r) for r in (0, 1)])
    assert len(fig.axes[0].patches) > 2 * len(PHASES)
