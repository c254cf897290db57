"""lab05's trainer: fp16 with a GradScaler on the CPU, bf16, clipping after unscale,
monitoring (grad norm, loss scale, skipped steps, communication, warm-up), all-reduces per
optimizer step equal to DDP's buckets under accumulation."""

from __future__ import annotations

import json

import pytest
import torch
from _harness import spawn_gloo
from _trainer_workers import count_allreduces

from ddp_lab.models import build_model
from ddp_lab.optim import optimizer_step

SMALL = ["--model", "mlp", "--train-size", "256", "--test-size", "40", "--seed", "1"]


def _records(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _scaled_backward(scaler: torch.amp.GradScaler, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = build_model("mlp")
    x, y = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))
    with torch.autocast("cpu", dtype=torch.float16, enabled=scaler.is_enabled()):
        loss = torch.nn.functional.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    return model


def test_fp16_scaler_on_cpu_skips_an_inf_step_and_halves_the_scale():
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    model = _scaled_backward(scaler)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params[0].grad[0, 0] = float("inf")  # an overflow in one gradient element
    norm, skipped = optimizer_step(opt, scaler, params, clip=1.0, need_norm=True)
    assert int(skipped) == 1 and not torch.isfinite(norm)
    assert scaler.get_scale() == 2.0**15
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()), "stepped"
    assert all(p.grad is None for p in params)
    # the next, finite step is taken at the halved scale
    x, y = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))
    with torch.autocast("cpu", dtype=torch.float16):
        loss = torch.nn.functional.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    norm, skipped = optimizer_step(opt, scaler, params, clip=1.0, need_norm=True)
    assert int(skipped) == 0 and torch.isfinite(norm)
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_clipping_after_unscale_equals_unscaled_clipping():
    """unscale_ then clip (optimizer_step) gives the fp32 update exactly: the scale is a
    power of two. Clipping the scaled gradients first (minGPT's bug) does not."""
    results = {}
    for name in ("fp32", "scaled", "clip-before-unscale"):
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, enabled=name != "fp32")
        torch.manual_seed(0)
        model = build_model("mlp")
        x, y = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))
        scaler.scale(torch.nn.functional.cross_entropy(model(x), y)).backward()
        params = list(model.parameters())
        opt = torch.optim.SGD(params, lr=0.5)
        if name == "clip-before-unscale":
            torch.nn.utils.clip_grad_norm_(params, 1.0)  # clips the scaled norm (~1000x)
        optimizer_step(opt, scaler, params, clip=1.0, need_norm=True)
        results[name] = model.state_dict()
    ref = results["fp32"]
    assert all(torch.equal(ref[k], results["scaled"][k]) for k in ref)
    assert any(not torch.allclose(ref[k], results["clip-before-unscale"][k]) for k in ref)


@pytest.mark.timeout(180)
def test_fp16_on_cpu_trains_and_monitors(trainer, tmp_path):
    """--amp fp16 runs on the CPU (a note, not an error, where fp16 is slow); records carry
    the loss scale, skipped steps, the grad norm before clipping with its warning flag, the
    warm-up rate; the warning line is rate-limited; TensorBoard has the scalars."""
    tb = tmp_path / "tb"
    flags = [*SMALL, "--batch-size", "16", "--amp", "fp16", "--clip-grad-norm", "1.0"]
    flags += ["--grad-norm-warn", "0.5", "--warmup-steps", "4", "--lr", "0.08"]
    flags += ["--log-every", "1", "--tensorboard", str(tb)]
    proc, out = trainer("fp16", flags)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "error:" not in proc.stderr
    records = _records(out)
    assert len(records) == 16
    assert [r["lr"] for r in records[:6]] == pytest.approx([0.02, 0.04, 0.06, 0.08, 0.08, 0.08])
    for r in records:
        assert r["loss_scale"] > 0 and r["skipped"] in (0, 1)
        assert r["grad_norm"] > 0.5 and r["grad_norm_warn"] is True  # norms here are ~2
    warnings = [line for line in proc.stderr.splitlines() if "warning: gradient norm" in line]
    assert len(warnings) == 1, warnings  # 16 flagged records, one line within 10 s
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for key in ("loss", "lr", "grad_norm", "loss_scale", "samples_per_s", "comm_share"):
        assert f"train/{key}" in tags, tags
    assert "eval/accuracy" in tags


@pytest.mark.timeout(120)
def test_bf16_training_lowers_the_loss(trainer):
    proc, out = trainer("bf16", [*SMALL, "--batch-size", "16", "--amp", "bf16", "--epochs", "3"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = _records(out)
    assert "loss_scale" not in records[0] and "skipped" not in records[0]
    first, last = records[0]["loss"], records[-1]["loss"]
    print(f"bf16: loss {first:.3f} -> {last:.3f}")
    assert last < 0.8 * first
    assert json.loads((out / "summary.json").read_text())["accuracy"] > 0.3


@pytest.mark.timeout(120)
def test_comm_meter_counts_one_allreduce_per_bucket_and_changes_nothing(tmp_path):
    """A comm hook counts the all-reduces: with accumulation over 3 micro-batches (no_sync
    on all but the last) there is one per DDP bucket per optimizer step, and the hook leaves
    the weights bit-identical to DDP's built-in all-reduce."""
    spawn_gloo(count_allreduces, 2, str(tmp_path), 3, 4)
    result = json.loads((tmp_path / "allreduces.json").read_text())
    print(result)
    assert result["buckets"] == 2
    assert result["calls"] == [2, 2, 2, 2]
    assert result["bit_identical"]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_trainer_allreduces_per_step_equal_buckets_under_accumulation(trainer):
    flags = [*SMALL, "--batch-size", "8", "--accum-steps", "2", "--max-steps", "5"]
    proc, out = trainer("ddp", [*flags, "--log-every", "1"], nproc=2)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    buckets = summary["ddp_buckets"]
    records = _records(out)
    counts = [r["allreduces_per_step"] for r in records]
    print(f"buckets {buckets}, all-reduces per optimizer step {counts}")
    # step 1 runs on DDP's initial buckets (one), later steps on the rebuilt ones
    assert 1 <= counts[0] <= buckets
    assert counts[1:] == [buckets] * 4
    assert all(0 < r["comm_s"] and 0 <= r["comm_share"] <= 1 for r in records)
