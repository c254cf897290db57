"""Distributed checkpoints (``torch.distributed.checkpoint``): a sharded FSDP2 state saved on
2 ranks loads on 3 and back, equal to the gathered state bit for bit; the trainer's
``--ckpt-format dcp`` is written by every rank, resumes at another world size exactly as the
single file does, and a damaged file in its folder is caught and the previous checkpoint
used."""

from __future__ import annotations

import os

import pytest
import torch
from _dcp_workers import CFG, reshard_worker
from _harness import spawn_gloo
from _trainer_helpers import bit_identical, jsonl, max_abs_diff, run, weights

from ddp_lab import checkpoint as ck
from ddp_lab import dcp

FLAGS = ["--model", "gpt", "--dataset", "tokens", "--layers", "1", "--width", "32"]
FLAGS += ["--heads", "2", "--seq-len", "16", "--train-size", "192", "--test-size", "16"]
FLAGS += ["--seed", "3", "--lr", "0.2", "--batch-size", "8", "--epochs", "2"]


def _equal_states(a, b, where: str = "") -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _equal_states(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _equal_states(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), f"{where} differs"
    else:
        assert a == b, where


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_sharded_fsdp2_checkpoint_loads_on_another_number_of_ranks(tmp_path):
    """Saved on 2 ranks, loaded on 3 (and saved on 3, loaded on 2): the model and AdamW state
    every rank then holds gather to the saved state bit for bit, each rank holding its
    torch.chunk share of every parameter (the embedding's 256 rows: 86, 86, 84 on 3)."""
    for saved, loaded in ((2, 3), (3, 2)):
        folder = str(tmp_path / f"ckpt{saved}")
        (tmp_path / f"s{saved}").mkdir()
        spawn_gloo(reshard_worker, saved, str(tmp_path / f"s{saved}"), "save", folder)
        files = sorted(n for n in os.listdir(folder) if n.endswith(".distcp"))
        assert files == [f"__{r}_0.distcp" for r in range(saved)]  # every rank wrote
        out = tmp_path / f"l{loaded}"
        out.mkdir()
        spawn_gloo(reshard_worker, loaded, str(out), "load", folder)
        want = torch.load(f"{folder}.full.pt", weights_only=True)
        got = torch.load(out / "loaded.full.pt", weights_only=True)
        _equal_states(want, got)
        assert got[1]["state"], "the optimizer state came back"
        rows = [torch.load(out / f"shards{r}.pt")["tok.weight"][0] for r in range(loaded)]
        assert rows == [len(c) for c in torch.arange(CFG.vocab).chunk(loaded)]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_trainer_dcp_resumes_on_another_world_size_as_the_file_does(tmp_path):
    """2 processes to step 4 with each format, then 3 processes from that checkpoint to
    step 8: the two resumed runs end bit-identical. A DCP folder holds a file from each
    rank of the run that wrote it (2, then 3), the file format one file per checkpoint."""
    for fmt in ("file", "dcp"):
        ckpts = str(tmp_path / f"ck-{fmt}")
        flags = [*FLAGS, "--ckpt-dir", ckpts, "--ckpt-every", "4", "--ckpt-format", fmt]
        first, left = run([*flags, "--max-steps", "4"], tmp_path / f"a-{fmt}", nproc=2)
        assert first.returncode == 0 and not left, first.stderr[-2000:]
        then, left = run([*flags, "--max-steps", "8", "--resume"], tmp_path / f"b-{fmt}", nproc=3)
        assert then.returncode == 0 and not left, then.stderr[-2000:]
        assert "resuming a 2-process checkpoint on 3 process(es)" in then.stderr
    folder = tmp_path / "ck-dcp" / ck.checkpoint_name(4, "dcp")
    assert sorted(os.listdir(folder)) == [".metadata", "__0_0.distcp", "__1_0.distcp", "trainer.pt"]
    later = tmp_path / "ck-dcp" / ck.checkpoint_name(8, "dcp")  # written by the 3 ranks
    assert sorted(n for n in os.listdir(later) if n.endswith(".distcp")) == [
        f"__{r}_0.distcp" for r in range(3)
    ]
    assert sorted(os.listdir(tmp_path / "ck-file")) == [ck.checkpoint_name(s) for s in (4, 8)]
    a, b = weights(tmp_path / "b-file"), weights(tmp_path / "b-dcp")
    assert bit_identical(a, b), f"max abs diff {max_abs_diff(a, b):.3g}"
    event = next(
        e for e in jsonl(tmp_path / "a-dcp" / "events.jsonl") if e["event"] == "checkpoint"
    )
    assert event["bytes"] == sum(p.stat().st_size for p in folder.iterdir())
    # DDP's tensors are the same on every rank: DCP has each written once, by one rank or
    # the other (weights and SGD momentum: twice the model's bytes and the files' headers,
    # under 3.2 times; every rank writing everything would be 4 times)
    shares = [(folder / f"__{r}_0.distcp").stat().st_size for r in range(2)]
    model_bytes = sum(t.numel() * t.element_size() for t in a.values())
    assert min(shares) > 0.2 * model_bytes and sum(shares) < 3.2 * model_bytes, shares


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_damaged_dcp_file_falls_back_to_the_previous_checkpoint(tmp_path):
    """Checkpoints at steps 4 and 8; one byte of rank 1's file of step 8 flipped: the resumed
    run says which file is bad, uses step 4, and ends bit-identical to the first run."""
    ckpts = tmp_path / "ck"
    flags = [*FLAGS, "--ckpt-dir", str(ckpts), "--ckpt-every", "4", "--ckpt-format", "dcp"]
    flags += ["--max-steps", "8"]
    first, left = run(flags, tmp_path / "first", nproc=2)
    assert first.returncode == 0 and not left, first.stderr[-2000:]
    shard = ckpts / ck.checkpoint_name(8, "dcp") / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ck.CorruptCheckpoint, match="__1_0.distcp in the folder: checksum"):
        dcp.verify(str(shard.parent))
    again, left = run([*flags, "--resume"], tmp_path / "again", nproc=2)
    assert again.returncode == 0 and not left, again.stderr[-2000:]
    assert "ckpt-00000008.dcp is corrupt (__1_0.distcp in the folder: checksum mismatch)" in (
        again.stderr
    )
    assert "resumed from" in again.stderr and "ckpt-00000004.dcp" in again.stderr
    assert bit_identical(weights(tmp_path / "first"), weights(tmp_path / "again"))
