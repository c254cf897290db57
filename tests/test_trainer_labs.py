"""``make lab3``, ``make lab5``, ``make lab6`` and ``make lab8``: the pieces that do not need
processes (the shared flags, the run plans, the weight comparison, torchrun's detection time,
the restart phases, the figures). The drivers themselves run the trainer, whose properties
the other trainer tests prove."""

from __future__ import annotations

import datetime

import pytest
import torch
from matplotlib.figure import Figure

from ddp_lab.errors import UsageError
from ddp_lab.figures.lab05_runs import lab5_runs
from ddp_lab.figures.lab06_restart import restart_timeline
from ddp_lab.workloads import lab3, lab5, lab6, lab8
from ddp_lab.workloads.lab5 import runs
from ddp_lab.workloads.lab6 import detection_time, restart_phases
from ddp_lab.workloads.labrun import dataset_for, plan_hardware, train, weight_difference


@pytest.mark.parametrize("module", [lab3, lab5, lab6, lab8])
def test_every_lab_run_has_the_shared_flags(module):
    args = module.build_parser().parse_args(["--max-procs", "1", "--dataset", "synthetic"])
    assert (args.data_dir, args.train_size, args.timeout) == ("data", 10_000, 1800)
    assert dataset_for(args) == ("synthetic", "--dataset synthetic asked for")
    assert plan_hardware(args.max_procs)[0] == [1]


def test_lab8_needs_two_processes_and_a_schedule(capsys):
    for argv, said in ((["--max-procs", "1"], "2 or more"), (["--profile-steps", "1,x"], "WAIT")):
        with pytest.raises(SystemExit):
            lab8.main([*argv, "--dataset", "synthetic"])
        assert said in capsys.readouterr().err


def test_weight_difference_says_identical_or_how_far(tmp_path):
    weights = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.zeros(3)}
    for name, shift in (("a", 0.0), ("same", 0.0), ("other", 0.25)):
        (tmp_path / name).mkdir()
        torch.save({k: v + shift for k, v in weights.items()}, tmp_path / name / "model.pt")
    assert weight_difference(str(tmp_path / "a"), str(tmp_path / "same")) == (True, 0.0)
    assert weight_difference(str(tmp_path / "a"), str(tmp_path / "other")) == (False, 0.25)


@pytest.mark.timeout(120)
def test_a_failed_trainer_run_is_one_line_that_names_it(tmp_path):
    with pytest.raises(UsageError, match="the np9 run failed"):
        train("np9", ["--model", "no-such-model", "--out", str(tmp_path)], 1, timeout=100)


def test_lab5_runs_keep_the_global_batch():
    plan = runs(32, 4)
    assert list(plan) == ["fp32", "bf16", "fp16+scaler", "fp32 accum 4"]
    for flags in plan.values():
        batch = int(flags[flags.index("--batch-size") + 1])
        accum = int(flags[flags.index("--accum-steps") + 1]) if "--accum-steps" in flags else 1
        assert batch * accum == 32


def test_lab6_reads_torchrun_detection_and_the_restart_phases():
    fault = datetime.datetime(2026, 11, 30, 17, 10, 46, 500000).timestamp()
    log = (
        "I1130 17:10:40.000000 1 api.py:1] starting\n"
        "E1130 17:10:46.960000 13456 api.py:1002] failed (exitcode: -9) local_rank: 1\n"
    )
    detected = detection_time(log, fault)
    assert detected - fault == pytest.approx(0.46, abs=1e-3)
    events = [
        {"event": "checkpoint", "time": fault - 1, "attempt": 0},
        {"event": "fault", "time": fault, "attempt": 0},
        {"event": "start", "time": fault + 1.0, "attempt": 1},
        {"event": "joined", "time": fault + 3.0, "attempt": 1},
        {"event": "resumed", "time": fault + 4.0, "attempt": 1},
        {"event": "first_step", "time": fault + 4.25, "attempt": 1},
    ]
    phases = restart_phases(events, detected)
    assert [round(e, 2) for _, _, e in phases] == [0.46, 1.0, 3.0, 4.0, 4.25]
    assert all(a <= b for _, a, b in phases)
    assert isinstance(restart_timeline(phases, "test"), Figure)
    assert restart_phases(events, None)[0][0] == "stop the group, start new workers"


def test_lab5_figure_draws_curves_and_ratios():
    fig = lab5_runs(
        {"fp32": ([5, 10], [2.3, 2.0]), "bf16": ([5, 10], [2.3, 2.1])},
        {"fp32": 10.0, "bf16": 5.0},
        "test",
    )
    assert len(fig.axes) == 2


def test_lab3_scales_the_learning_rate_with_the_processes():
    """The linear scaling rule: N processes (N times the global batch, N times fewer steps per
    epoch) use N times the rate after a warm-up over a tenth of the run; one process and
    ``--lr-scaling none`` use the rate as given."""
    assert lab3.scaled_lr(0.05, 1, 313, "linear") == (0.05, 0)
    assert lab3.scaled_lr(0.05, 2, 157, "linear") == (0.1, 15)
    assert lab3.scaled_lr(0.05, 8, 5, "linear") == (0.4, 1)
    assert lab3.scaled_lr(0.05, 4, 100, "none") == (0.05, 0)
    args = lab3.build_parser().parse_args([])
    assert (args.lr, args.lr_scaling) == (0.05, "linear")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_make_lab3_compares_accuracy_at_scaled_learning_rates(tmp_path, capsys):
    out = tmp_path / "lab3"
    argv = ["--max-procs", "2", "--dataset", "synthetic", "--train-size", "640", "--out", str(out)]
    assert lab3.main(argv) == 0
    said = capsys.readouterr().out
    assert "linear scaling rule" in said and "test accuracy" in said, said
    import json

    result = json.loads((out / "scaling.json").read_text())
    one, two = result["runs"]
    assert (one["processes"], one["lr"], one["warmup_steps"]) == (1, 0.05, 0)
    assert (two["processes"], two["lr"], two["warmup_steps"]) == (2, 0.1, 1)
    assert two["global_batch"] == 2 * one["global_batch"] and two["steps"] == 10
    assert all(0.0 <= r["accuracy"] <= 1.0 for r in (one, two))
    assert (out / "scaling.png").stat().st_size > 0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_make_lab3_with_the_transformer_trains_on_text_and_says_so(tmp_path, capsys):
    """`make lab3 LAB3_ARGS="--model gpt"`: the text is chosen (and why), the model's size
    said, each run's perplexity printed and kept, the warm-up a tenth of the text's steps."""
    out = tmp_path / "lab3"
    argv = ["--max-procs", "2", "--model", "gpt", "--train-size", "256", "--out", str(out)]
    assert lab3.main(argv) == 0
    said = capsys.readouterr().out
    assert "dataset text: --model gpt trains on Python's own documentation" in said, said
    assert "model gpt (2 layers x 4 heads, width 128, 64 tokens; 0.47 M parameters)" in said
    assert said.count("(perplexity ") >= 3, said  # two runs and the closing line
    import json

    result = json.loads((out / "scaling.json").read_text())
    assert (result["model"], result["dataset"]) == ("gpt", "text")
    one, two = result["runs"]
    assert two["steps"] == 4 and two["warmup_steps"] == 1  # 256 sequences / 64 per step
    assert all(1.0 < r["perplexity"] < 256 for r in (one, two))
