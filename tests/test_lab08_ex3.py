"""Lab 8, exercise 3 (``make_compress_hook`` in ``compress.py``): the case set, the judge on
real ranks, the mistakes, the visible check, and the facts the section states.

- every draw holds every edge case (200 seeds, inputs only): float16 and bfloat16 over 3
  ranks and over ranks 0 and 1; each rank's gradient fits float16 at every step of an
  exact-mean replay while their float16 sum over the ranks overflows at the first step; in
  bfloat16 over 3 ranks, dividing before or after the sum rounds differently;
- on real ranks (ONE gloo job of 3 processes for all of them): the reference and the
  notebook's solution equal torch's hooks bit for bit (full judge), and every mistake, the
  sample class's included, fails with its own reason;
- the visible check passes on the reference under torchrun and fails on a mistake with its
  message (and says "finish this exercise first" on the stub); a file that uses torch's
  own hooks is refused;
- facts: torch's ``fp16_compress_hook`` divides before the all-reduce (a sum first overflows
  where it does not), and DDP's reducer takes a float16 Future's value as it is (so only the
  recorded dtype catches a hook that does not cast back).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _harness import saved, spawn_gloo

from ddp_lab.answers import full_judge
from ddp_lab.answers.lab08 import ex3 as answers
from ddp_lab.answers.lab08.references_ex3 import FILES
from ddp_lab.checks import runner
from ddp_lab.checks.failure import CheckFailed
from ddp_lab.checks.lab08 import ex3_compress_hook as ex3
from ddp_lab.checks.runner import STUB
from ddp_lab.checks.values import plain

GID = ex3.GRADE_ID
JUDGE = full_judge(ex3.EXERCISE, answers.HIDDEN[GID])
ALL_MISTAKES = [*answers.MISTAKES, *answers.MORE_MISTAKES]


def _inputs(seed: int) -> dict:
    return ex3.make_inputs(torch.Generator().manual_seed(seed))


def _file(cell: str) -> str:
    return cell.split("\n", 1)[1]


# --- the case set ----------------------------------------------------------------------------


def test_every_draw_holds_every_edge_case():
    for seed in range(200):
        runs = _inputs(seed)["cases"][0]["runs"]
        assert [(r["ranks"], r["dtype"]) for r in runs] == [
            (3, "float16"),
            (3, "bfloat16"),
            (2, "float16"),
            (2, "bfloat16"),
        ]
        for r in runs:
            n = r["ranks"]
            g = torch.stack([ex3.local_grads(r, r["init"], k) for k in range(n)])
            assert float(g.abs().max()) < ex3.FP16_MAX, "each rank's gradient fits float16"
            summed = g.half().float().sum(0)
            assert float(summed.abs().max()) > 65520, "their float16 sum overflows"
            if r["dtype"] == "bfloat16" and n == 3:
                b = g.bfloat16()
                before = (b / n)[0] + (b / n)[1] + (b / n)[2]
                after = (b[0] + b[1] + b[2]) / n
                share = float((before != after).float().mean())
                assert share > 0.05, f"seed {seed}: only {share:.1%} round differently"


def _simulated_hook(spec: dict) -> torch.Tensor:
    """torch's hook at the first step, in this process: each rank's gradient cast to the
    dtype and divided by n, summed in the dtype (in rank order, as one order gloo may take)."""
    n, dt = spec["ranks"], ex3.DTYPES[spec["dtype"]]
    parts = [ex3.local_grads(spec, spec["init"], r).to(dt).div_(n) for r in range(n)]
    total = parts[0].clone()
    for part in parts[1:]:
        total += part
    return total.float()


def test_the_graders_replay_accepts_torchs_rounding_in_every_draw():
    for seed in range(100):
        inputs = _inputs(seed)
        ranks = [{"student": [], "oracle": []} for _ in range(3)]
        for spec in inputs["cases"][0]["runs"]:
            g = _simulated_hook(spec)
            start = torch.cat([t.reshape(-1) for t in spec["init"]])
            run = {"grads": [g], "params": [start - spec["lr"] * g]}
            for r, rank in enumerate(ranks):
                for side in ("student", "oracle"):
                    rank[side].append(run if r < spec["ranks"] else None)
        answers.HIDDEN[GID].check(inputs, {"cases": [ranks]})


def test_the_visible_inputs_are_the_grading_case_set():
    assert ex3.EXERCISE.visible_inputs is None  # the same four runs (the job costs seconds)


# --- real ranks: one gloo job for the reference, the solution and every mistake -------------


def _ranks_worker(rank: int, world: int, tmp: str, jobs: list) -> None:
    home = os.getcwd()
    for name, text, seed in jobs:
        inputs = _inputs(seed)
        folder = Path(tmp) / name
        if rank == 0:
            folder.mkdir()
            (folder / ex3.COMPRESS_FILE).write_text(text)
        dist.barrier()
        os.chdir(folder)
        try:
            out = plain(ex3.run_rank({}, inputs, inputs["cases"][0], rank, world))
        finally:
            os.chdir(home)
        torch.save(out, Path(tmp) / f"{name}-rank{rank}.pt")
        dist.barrier()


_RAN: dict[str, tuple[dict, dict]] = {}


def _on_ranks() -> dict[str, tuple[dict, dict]]:
    """``name -> (inputs, outputs)``: the reference (seed 1), the notebook's solution (seed 2)
    and every mistake (seeds 3, 4, ...), all in one gloo job of 3 ranks."""
    if not _RAN:
        jobs = [("reference", FILES[ex3.COMPRESS_FILE], 1)]
        jobs += [("solution", _file(answers.SOLUTION_CELL), 2)]
        jobs += [(m.name, _file(m.source), 3 + i) for i, m in enumerate(ALL_MISTAKES)]
        with tempfile.TemporaryDirectory() as tmp:
            spawn_gloo(_ranks_worker, 3, tmp, jobs, timeout=240)
            for name, _, seed in jobs:
                ranks = [
                    torch.load(Path(tmp) / f"{name}-rank{r}.pt", weights_only=True)
                    for r in range(3)
                ]
                _RAN[name] = (_inputs(seed), saved({"cases": [ranks]}))
    return _RAN


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_reference_and_the_solution_equal_torchs_hooks_bit_for_bit():
    for name in ("reference", "solution"):
        inputs, outputs = _on_ranks()[name]
        assert "bit for bit" in JUDGE(inputs, outputs), name
        for spec, mine, _ in ex3._outs(inputs, outputs):
            for o in mine:  # several buckets after DDP's rebuild, one at the first step
                counts = [len(step) for step in o["buckets"]]
                assert counts[0] == 1 and min(counts[1:]) >= 3, counts
                assert all(c[1] == spec["dtype"] for step in o["calls"] for c in step)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mistake", ALL_MISTAKES, ids=lambda m: m.name)
def test_every_mistake_fails_with_its_own_reason_on_real_ranks(mistake):
    inputs, outputs = _on_ranks()[mistake.name]
    with pytest.raises(CheckFailed, match=mistake.reason) as failed:
        JUDGE(inputs, outputs)
    others = [m.reason for m in ALL_MISTAKES if m is not mistake]
    assert not any(r in str(failed.value) for r in others), str(failed.value)
    if mistake.name == "returns_compressed":  # DDP copies a float16 value into float32 grads
        for spec, mine, oracle in ex3._outs(inputs, outputs):
            assert ex3.numbers_problem(spec, mine, oracle) is None


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_judge_fails_a_tampered_run_of_torchs_hook():
    inputs, outputs = _on_ranks()["reference"]
    forged = saved(outputs)
    for rank in forged["cases"][0]:  # a student who changed the oracle's and their numbers
        for side in ("oracle", "student"):
            rank[side][0]["grads"] = [g * 2 for g in rank[side][0]["grads"]]
    with pytest.raises(CheckFailed, match="within float16's rounding"):
        JUDGE(inputs, forged)


# --- the visible check -------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_visible_check_passes_the_reference_and_names_a_mistake(tmp_path, capsys):
    path = tmp_path / ex3.COMPRESS_FILE
    path.write_text(_file(answers.SOLUTION_CELL))
    ex3.visible(str(path))
    assert capsys.readouterr().out.startswith("OK: make_compress_hook")
    path.write_text(_file(answers.MISTAKES[0].source))
    with pytest.raises(CheckFailed, match="inf or NaN where torch's fp16_compress_hook"):
        ex3.visible(str(path))
    path.write_text(f"def make_compress_hook(dtype):\n    {STUB}\n")
    with pytest.raises(CheckFailed, match="finish this exercise first"):
        ex3.visible(str(path))


def test_a_file_that_uses_torchs_own_hooks_is_refused(tmp_path, monkeypatch):
    """On the grader's path (the cell) and on the ranks (the file, as the visible check
    loads it), before anything runs."""
    cheat = "%%writefile compress.py\nfrom torch.distributed.algorithms import ddp_comm_hooks\n"
    with pytest.raises(PermissionError, match="ddp_comm_hooks"):
        runner.namespace(
            {ex3.EXERCISE.cells[0]: cheat},
            ex3.EXERCISE.cells,
            tmp_path,
            (),
            ex3.EXERCISE.forbid_modules,
        )
    (tmp_path / ex3.COMPRESS_FILE).write_text(_file(cheat))
    monkeypatch.chdir(tmp_path)
    inputs = _inputs(0)
    with pytest.raises(PermissionError, match="write the code yourself"):
        ex3.run_rank({}, inputs, inputs["cases"][0], 0, 3)


# --- facts -------------------------------------------------------------------------------------


def test_torchs_fp16_hook_divides_before_the_sum_which_then_fits():
    """``_compress_hook`` computes ``buffer.to(dtype).div_(world_size)`` and all-reduces
    that: with values near 40,000 on 2 ranks the divided sum fits float16, the plain sum
    does not."""
    import inspect

    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    source = inspect.getsource(default_hooks._compress_hook)
    assert "buffer.to(dtype).div_(world_size)" in source
    assert source.index("div_(world_size)") < source.index("dist.all_reduce(")
    x = torch.tensor([40000.0, 41000.0]).half()
    assert torch.isinf(x.sum()) and torch.isfinite((x / 2).sum())
