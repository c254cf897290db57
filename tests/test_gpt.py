"""The transformer workload: ``--model gpt`` on ``--dataset text`` / ``tokens``.

The model is causal and splits by heads as tensor parallelism needs; the text is Python's
documentation as bytes with a held-out tail; and the trainer's guarantees hold for it: DDP
N x b equals 1 x N b, accumulation equals the big batch, bf16 and fp16 (with the scaler)
train, and a run killed and resumed from its checkpoint ends bit-identical.
"""

from __future__ import annotations

import math

import pytest
import torch
from _trainer_helpers import bit_identical, jsonl, max_abs_diff, run, summary, weights

from ddp_lab.errors import UsageError
from ddp_lab.gpt import GPT, CausalSelfAttention, GPTConfig
from ddp_lab.options import parse_args
from ddp_lab.text import TokenWindows, make_text_datasets, pydoc_bytes, split

SMALL = GPTConfig(seq_len=16, width=32, heads=2, layers=1)
#: A small transformer on the Markov tokens: 128 sequences of 16 tokens.
FLAGS = ["--model", "gpt", "--dataset", "tokens", "--layers", "1", "--width", "32"]
FLAGS += ["--heads", "2", "--seq-len", "16", "--train-size", "128", "--test-size", "16"]
FLAGS += ["--seed", "3", "--lr", "0.2"]


def test_a_token_sees_only_the_tokens_before_it():
    """Changing token t changes no logit at a position before t, and changes position t."""
    torch.manual_seed(0)
    model = GPT(SMALL)
    tokens = torch.randint(0, 256, (2, 16))
    changed = tokens.clone()
    changed[:, 9] = (changed[:, 9] + 1) % 256
    a, b = model(tokens), model(changed)
    assert torch.equal(a[:, :9], b[:, :9])
    assert not torch.allclose(a[:, 9], b[:, 9])


def test_attention_split_by_heads_adds_up_to_the_whole():
    """Megatron's split of a block's attention, by hand: q, k, v cut by output columns (one
    head per part), the output projection by input columns; the parts' outputs add up to
    the whole attention. The forward reads its head count from the width it is given."""
    torch.manual_seed(1)
    cfg = GPTConfig(seq_len=8, width=16, heads=4, layers=1)
    whole = CausalSelfAttention(cfg)
    x = torch.randn(3, 8, 16)
    parts = []
    for rows in (slice(0, 8), slice(8, 16)):  # two ranks, two heads each
        part = CausalSelfAttention(cfg)
        for name in ("q", "k", "v"):
            full, cut = getattr(whole, name), getattr(part, name)
            cut.weight = torch.nn.Parameter(full.weight[rows].clone())
            cut.bias = torch.nn.Parameter(full.bias[rows].clone())
        part.proj.weight = torch.nn.Parameter(whole.proj.weight[:, rows].clone())
        part.proj.bias = torch.nn.Parameter(whole.proj.bias / 2)
        parts.append(part(x))
    torch.testing.assert_close(parts[0] + parts[1], whole(x), atol=1e-6, rtol=1e-5)


def test_gpt_refuses_a_sequence_longer_than_its_positions():
    with pytest.raises(ValueError, match="longer than seq_len 16"):
        GPT(SMALL)(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="multiple of heads"):
        GPTConfig(width=30, heads=4)


def test_text_is_pythons_documentation_with_a_held_out_tail():
    """About 465 KB of English as bytes; the test split is the last tenth, disjoint from the
    training windows; a sample's target is its input shifted by one token."""
    stream = torch.frombuffer(bytearray(pydoc_bytes()), dtype=torch.uint8).long()
    assert 400_000 < len(stream) < 600_000 and int(stream.max()) < 256
    assert b"assert" in pydoc_bytes()[:100]
    train, test = make_text_datasets("text", 64, 10**9, 10**9)
    head, tail = split(stream)
    assert len(head) + len(tail) == len(stream) and len(tail) == len(stream) - len(head)
    assert len(train) == (len(head) - 1) // 64 and len(test) == (len(tail) - 1) // 64
    x, y = train[5]
    assert torch.equal(x[1:], y[:-1]) and torch.equal(x, head[320:384])
    last_x, _ = test[len(test) - 1]
    assert torch.equal(last_x, tail[(len(test) - 1) * 64 : len(test) * 64])
    limited, _ = make_text_datasets("text", 64, 100, 10)
    assert len(limited) == 100


def test_tokens_are_seeded_and_sized_exactly():
    a, a_test = make_text_datasets("tokens", 16, 40, 8, data_seed=2)
    b, _ = make_text_datasets("tokens", 16, 40, 8, data_seed=2)
    c, _ = make_text_datasets("tokens", 16, 40, 8, data_seed=3)
    assert len(a) == 40 and len(a_test) == 8
    assert all(torch.equal(a[i][0], b[i][0]) for i in range(40))
    assert not torch.equal(a[0][0], c[0][0])
    with pytest.raises(UsageError, match="lower --seq-len"):
        TokenWindows(torch.arange(10), seq_len=16)


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--model", "gpt", "--dataset", "synthetic"], "use --dataset text"),
        (["--model", "cnn", "--dataset", "text"], "use --model gpt, or an image set"),
        (["--model", "gpt", "--width", "30"], "--width 30 must be a multiple of --heads 4"),
        (["--model", "gpt", "--seq-len", "0"], "--seq-len must be a positive integer"),
    ],
)
def test_a_model_and_data_that_do_not_fit_are_refused_with_the_fix(flags, message):
    with pytest.raises(UsageError, match=message.replace("-", r"\-")):
        parse_args(flags)


def test_gpt_trains_on_text_by_default():
    cfg = parse_args(["--model", "gpt"])
    assert cfg.dataset == "text" and parse_args([]).dataset == "synthetic"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_gpt_ddp_and_accumulation_match_the_big_batch(tmp_path):
    """2 processes x 8, and 1 x 8 with 2 accumulated micro-batches, equal 1 x 16 to float
    rounding over 2 epochs (16 steps); the loss fell (it learned) and the summary has the
    perplexity, exp of the test loss."""
    runs = {
        "big": ([*FLAGS, "--epochs", "2", "--batch-size", "16"], 1),
        "ddp": ([*FLAGS, "--epochs", "2", "--batch-size", "8"], 2),
        "accum": ([*FLAGS, "--epochs", "2", "--batch-size", "8", "--accum-steps", "2"], 1),
    }
    for name, (flags, nproc) in runs.items():
        proc, left = run(flags, tmp_path / name, nproc=nproc)
        assert proc.returncode == 0 and not left, proc.stderr[-2000:]
    big = weights(tmp_path / "big")
    for name in ("ddp", "accum"):
        diff = max_abs_diff(big, weights(tmp_path / name))
        print(f"gpt {name} vs 1 x 16: max abs diff {diff:.3g}")
        assert diff <= 1e-6
    s = summary(tmp_path / "ddp")
    assert s["steps"] == 16 and s["world_size"] == 2
    assert s["test_loss"] < math.log(256) - 2 and s["perplexity"] == pytest.approx(
        math.exp(s["test_loss"])
    )
    records = jsonl(tmp_path / "ddp" / "metrics.jsonl")
    assert all(r["perplexity"] == pytest.approx(math.exp(r["loss"])) for r in records)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_gpt_trains_in_mixed_precision(tmp_path, amp):
    """bf16 autocast, and fp16 with the GradScaler, lower the test loss far below log 256
    (fp16's scale is recorded: the scaler ran)."""
    proc, left = run([*FLAGS, "--epochs", "2", "--batch-size", "16", "--amp", amp], tmp_path)
    assert proc.returncode == 0 and not left, proc.stderr[-2000:]
    s = summary(tmp_path)
    assert s["test_loss"] < math.log(256) - 2
    records = jsonl(tmp_path / "metrics.jsonl")
    assert ("loss_scale" in records[-1]) == (amp == "fp16")


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("fmt", ["file", "dcp"])
def test_gpt_resumed_after_a_kill_is_bit_identical(tmp_path, fmt):
    """2 processes, 12 steps, a checkpoint every 4 (one file, or a DCP folder); rank 1
    killed at step 7 and the group restarted by torchrun: the same model.pt bit for bit as
    the uninterrupted run."""
    flags = [*FLAGS, "--epochs", "2", "--batch-size", "8", "--max-steps", "12"]
    clean, left = run(flags, tmp_path / "clean", nproc=2)
    assert clean.returncode == 0 and not left, clean.stderr[-2000:]
    fault = ["--ckpt-dir", str(tmp_path / "ck"), "--ckpt-every", "4", "--resume"]
    fault += ["--ckpt-format", fmt]
    fault += ["--fail-at-step", "7", "--fault", "sigkill", "--fail-rank", "1"]
    proc, left = run(
        [*flags, *fault], tmp_path / "out", nproc=2, torchrun_args=["--max-restarts=1"]
    )
    assert proc.returncode == 0 and not left, proc.stderr[-3000:]
    s = summary(tmp_path / "out")
    assert s["attempt"] == 1 and s["resumed_from"] == 4 and s["steps"] == 12
    a, b = weights(tmp_path / "clean"), weights(tmp_path / "out")
    assert bit_identical(a, b), f"max abs diff {max_abs_diff(a, b):.3g}"
