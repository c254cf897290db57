"""The grader's forked ranks (ddp_lab.grading.ranks) do torchrun's job: one gloo job per
call, the first failure stops the others, a hang ends at the timeout, nothing outlives the
call; and the grader reaches the same verdicts with forked ranks as with torchrun."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
from _harness import new_leftovers, own_tmpdir
from selftest.students import GOOD_SUM

from ddp_lab.grading import ranks
from ddp_lab.grading.authoring import notebook, solution
from ddp_lab.grading.verdict import judge_notebook
from ddp_lab.launch import LaunchFailed, LaunchTimeout

pytestmark = pytest.mark.skipif(not ranks.available(), reason="ranks are forked on Linux only")


def _sum_of_ranks(args: list[str]) -> int:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(t)
    print(f"rank {os.environ['RANK']}/{os.environ['LOCAL_RANK']} of {dist.get_world_size()}")
    print(f"sum {t.item():g} in {Path.cwd().name} with {' '.join(args)}")
    dist.destroy_process_group()
    return 0


def _one_rank_fails(args: list[str]) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if dist.get_rank() == int(args[0]):
        if args[1] == "raise":
            raise ValueError("rank_sum.py line 3: wrong shape")
        if args[1] == "exit":
            sys.exit("gave up")
        os.kill(os.getpid(), signal.SIGKILL)
    dist.recv(torch.zeros(1), src=int(args[0]))  # waits for the rank that failed


def _hangs_with_a_child(args: list[str]) -> None:
    import subprocess

    import torch
    import torch.distributed as dist

    child = subprocess.Popen(["sleep", "120"])
    Path(args[0], f"child{os.environ['RANK']}").write_text(str(child.pid))
    dist.init_process_group("gloo")
    dist.recv(torch.zeros(1), src=(dist.get_rank() + 1) % dist.get_world_size())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("nproc", [2, 3])
def test_forked_ranks_run_one_gloo_job_with_torchruns_variables(nproc, tmp_path):
    (tmp_path / "here").mkdir()
    res = ranks.fork_ranks(
        _sum_of_ranks, ["a", 1], nproc=nproc, timeout=30, cwd=tmp_path / "here", logs=tmp_path
    )
    assert res.ok and sorted(res.logs) == list(range(nproc))
    total = nproc * (nproc + 1) // 2
    for r in range(nproc):
        assert res.logs[r] == f"rank {r}/{r} of {nproc}\nsum {total} in here with a 1\n"


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "how,said,code",
    [
        ("raise", "ValueError: rank_sum.py line 3: wrong shape", "exit code 1"),
        ("exit", "gave up", "exit code 1"),
        ("kill", "", "SIGKILL"),
    ],
)
def test_the_first_failing_rank_stops_the_others_at_once(how, said, code, tmp_path, monkeypatch):
    marker = own_tmpdir(monkeypatch, tmp_path)
    before = set(os.listdir("/proc"))
    t0 = time.monotonic()
    with pytest.raises(LaunchFailed) as err:
        ranks.fork_ranks(
            _one_rank_fails, ["1", how], nproc=3, timeout=50, cwd=tmp_path, logs=tmp_path
        )
    assert time.monotonic() - t0 < 20  # not the timeout: the ranks that wait were stopped
    assert str(err.value).startswith(f"rank 1 failed first ({code}"), err.value
    assert said in err.value.result.logs[1]
    assert not new_leftovers(before, marker)


@pytest.mark.timeout(60)
def test_a_hang_ends_at_the_timeout_with_every_process_it_started(tmp_path, monkeypatch):
    marker = own_tmpdir(monkeypatch, tmp_path)
    before = set(os.listdir("/proc"))
    t0 = time.monotonic()
    with pytest.raises(LaunchTimeout, match="2 ranks did not finish within 4 s"):
        ranks.fork_ranks(
            _hangs_with_a_child, [str(tmp_path)], nproc=2, timeout=4, cwd=tmp_path, logs=tmp_path
        )
    assert 4 <= time.monotonic() - t0 < 15
    for r in range(2):  # each rank's own child went with it
        pid = int((tmp_path / f"child{r}").read_text())
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text()
    assert not new_leftovers(before, marker)


def test_the_first_failure_is_the_earliest_noted_and_a_signal_counts_as_first(tmp_path):
    (tmp_path / "rank0.failed").write_text("2.5")  # rank 0 saw rank 1's connection close
    (tmp_path / "rank1.failed").write_text("2.0")
    assert ranks._first_failure({0: 1, 1: 1, 2: 0}, tmp_path) == 1
    assert ranks._first_failure({0: 1, 1: 1, 2: -9}, tmp_path) == 2  # killed: noted nothing
    assert ranks._first_failure({0: 0, 1: 0}, tmp_path) is None


def test_forking_can_be_turned_off(monkeypatch):
    monkeypatch.setenv(ranks.ENV, "0")
    assert not ranks.available()


RAISES = "%%writefile rank_sum.py\ndef rank_sum(t):\n    raise ValueError('not yet')\n"


# a hang is judged the same way too: the per-case timeout of run_ranks stops either job and
# says so in the same words (the deadlocks of test_verdicts and test_lab04 run on forked ranks)
@pytest.mark.timeout(120)
def test_the_grader_reaches_the_same_verdicts_with_forked_ranks_and_with_torchrun(monkeypatch):
    said = {}
    for fork in ("1", "0"):
        monkeypatch.setenv(ranks.ENV, fork)
        said[fork] = [
            judge_notebook(
                notebook([solution("rank_sum", source)]), "lab00_selftest", ["test_rank_sum"], 7
            )["test_rank_sum"]
            for source in (GOOD_SUM, RAISES)
        ]
    assert [v.passed for v in said["1"]] == [True, False], said["1"]
    for forked, torchrun in zip(said["1"], said["0"], strict=True):
        assert (forked.passed, forked.message) == (torchrun.passed, torchrun.message)
    assert "ValueError: not yet" in said["1"][1].message
