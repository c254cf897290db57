"""Resource limits for student code (ddp_lab.grading.limits): memory, processes, file size and
CPU time hold for a process and everything it starts, and a student who runs into one loses
that exercise with a clear message while the rest is graded as usual."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
from _harness import run_tree
from selftest.students import GOOD_SUM

from ddp_lab.grading import limits
from ddp_lab.grading.authoring import notebook, solution
from ddp_lab.grading.verdict import judge_notebook

# `import torch` (a CUDA build) alone maps about 0.8 GB of private data: 1.5 GB leaves room;
# and it takes about 2 s of CPU (more on a loaded machine): the CPU limit is tested alone
SMALL = limits.Limits(memory_mb=1536, processes=16, file_mb=4, cpu_s=60)


def _limited(code: str, lim: limits.Limits = SMALL) -> subprocess.CompletedProcess:
    return run_tree(limits.wrap([sys.executable, "-c", code], lim), timeout=120)


def test_memory_beyond_the_limit_is_refused_and_below_it_is_fine():
    ok = _limited("import torch; torch.ones(64 * 2**20); print('fine')")
    assert ok.returncode == 0 and "fine" in ok.stdout, ok.stderr
    big = _limited("import torch; torch.ones(2 * 1536 * 2**20 // 4)")  # twice the limit
    assert big.returncode != 0
    assert limits.explain(big.stderr, SMALL).startswith("your code needed more than the memory")


def test_a_file_past_the_size_limit_cannot_be_written(tmp_path):
    code = f"open({str(tmp_path / 'big')!r}, 'wb').write(b'x' * 9 * 2**20)"
    run = _limited(code)
    assert run.returncode != 0 and "File too large" in run.stderr
    assert "larger than the limit of 4 MiB" in limits.explain(run.stderr, SMALL)
    assert (tmp_path / "big").stat().st_size <= 4 * 2**20


def test_cpu_time_beyond_the_limit_stops_the_process():
    lim = dataclasses.replace(SMALL, cpu_s=2)
    run = _limited("while True: pass", lim)
    assert run.returncode == -24, run  # SIGXCPU
    assert "2 s of CPU time" in limits.explain(run.stderr, lim, run.returncode)


def test_limits_are_inherited_by_child_processes():
    code = (
        "import resource, subprocess, sys; "
        "print(subprocess.check_output([sys.executable, '-c', "
        "'import resource; print(resource.getrlimit(resource.RLIMIT_FSIZE)[0])'], text=True))"
    )
    run = _limited(code)
    assert run.stdout.strip() == str(4 * 2**20), run


@pytest.mark.skipif(not limits.pids_cgroups_available(), reason="no writable pids cgroup here")
def test_a_process_spawning_loop_is_refused_at_the_cap():
    code = (
        "import subprocess\n"
        "kids = []\n"
        "try:\n"
        "    for _ in range(3000):\n"  # bounded: a broken limit cannot take the machine down
        "        kids.append(subprocess.Popen(['sleep', '30']))\n"
        "finally:\n"
        "    print(len(kids))\n"
        "    [k.kill() for k in kids]\n"
    )
    run = _limited(code)
    assert run.returncode != 0 and int(run.stdout.strip()) < SMALL.processes, run
    assert "more than 16 processes" in limits.explain(run.stderr, SMALL)
    limits.sweep()


def test_without_cgroups_the_watcher_stops_a_growing_tree():
    from ddp_lab import proctree

    code = "import subprocess\nkids = [subprocess.Popen(['sleep', '30']) for _ in range(60)]\n"
    code += "import time; time.sleep(30)"
    run = proctree.run([sys.executable, "-c", code], timeout=60, max_processes=8)
    assert run.too_many and run.returncode is None and run.seconds < 30


def test_wrap_and_the_environment_round_trip(monkeypatch):
    monkeypatch.setenv(limits.ENV, SMALL.to_env())
    assert limits.current() == SMALL
    cmd = limits.wrap(["echo", "hi"])
    assert cmd[cmd.index("--memory-mb") + 1] == "1536" and cmd[-2:] == ["echo", "hi"]
    assert json.loads(SMALL.to_env())["cpu_s"] == 60


HOG = "import torch\ndef add(a, b):\n    torch.ones(2 * 1536 * 2**20 // 4)\n    return a + b\n"
SCRIBBLE = (
    "def add(a, b):\n    with open('log.txt', 'wb') as f:\n"
    "        [f.write(b'x' * 2**20) for _ in range(9)]\n    return a + b\n"
)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "source,said",
    [(HOG, "memory limit of 1536 MiB"), (SCRIBBLE, "larger than the limit of 4 MiB")],
    ids=["hog", "scribbler"],
)
def test_the_grader_fails_the_exercise_and_grades_the_rest(source, said, monkeypatch):
    # room for torchrun's ranks of the other exercise (torch's import alone takes CPU seconds)
    monkeypatch.setenv(limits.ENV, limits.Limits(1536, 32, 4, 120).to_env())
    nb = notebook([solution("add", source), solution("rank_sum", GOOD_SUM)])
    verdicts = judge_notebook(nb, "lab00_selftest")
    assert not verdicts["test_add"].passed and said in verdicts["test_add"].message, verdicts
    assert verdicts["test_rank_sum"].passed, verdicts["test_rank_sum"]
