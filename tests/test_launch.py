"""ddp_lab.launch: torchrun from a notebook, with per-rank logs, a timeout and no leftovers.

The ``slow`` tests start real 2-rank gloo jobs (a few seconds each on a 2-core machine); the
others check the pieces (log following, the live view, messages) without starting anything.
"""

from __future__ import annotations

import json
import os
import re
import textwrap
import threading
import time
from pathlib import Path

import pytest
from _harness import stop_button

from ddp_lab import proctree
from ddp_lab.launch import (
    LaunchError,
    LaunchFailed,
    LaunchResult,
    LaunchTimeout,
    torchrun,
    write_result,
)
from ddp_lab.launch import logs as launch_logs
from ddp_lab.launch import messages as launch_messages
from ddp_lab.launch.__main__ import main as launch_main

ALL_REDUCE = """
    import sys
    import torch
    import torch.distributed as dist
    from ddp_lab.launch import write_result

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    print(f"rank {rank} says hello, sum {t.item():g}")
    print(f"rank {rank} stderr line", file=sys.stderr)
    write_result({"sum": t, "world_size": dist.get_world_size(), "argv": sys.argv[1:]})
    dist.destroy_process_group()
"""

RANK1_RAISES = """
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    print(f"rank {rank} started")
    dist.barrier()
    if rank == 1:
        raise ValueError("boom from rank 1")
    dist.barrier()  # rank 0 waits for rank 1, which has died
"""

RANK1_EXITS = """
    import os, sys
    rank = os.environ["RANK"]
    if rank == "1":
        print("rank 1 gives up", file=sys.stderr)
        sys.exit(3)
    print(f"rank {rank} done")
"""

# Rank 1 fails once; torchrun restarts both ranks and the second attempt succeeds.
FAILS_ONCE = """
    import os
    import torch.distributed as dist
    from ddp_lab.launch import write_result

    dist.init_process_group("gloo")
    rank, attempt = dist.get_rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    print(f"rank {rank} attempt {attempt}")
    dist.barrier()
    if rank == 1 and attempt == 0:
        raise RuntimeError("injected fault")
    dist.barrier()
    write_result({"attempt": attempt})
    dist.destroy_process_group()
"""

# Rank 1 sleeps, rank 0 waits for it in a barrier: a hang. Each worker writes its pid first.
HANGS = """
    import os, sys, time
    pid_file = os.path.join(sys.argv[1], f"pid{os.environ['RANK']}")
    with open(pid_file + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(pid_file + ".tmp", pid_file)
    import torch.distributed as dist

    dist.init_process_group("gloo")
    print(f"rank {dist.get_rank()} entering the hang", flush=True)
    if dist.get_rank() == 1:
        time.sleep(3600)
    dist.barrier()
"""


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def _script(tmp_path: Path, body: str, name: str = "worker.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def _gone(pid: int) -> bool:
    """True when no process (not even an unreaped zombie) has this pid."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return not os.path.exists(f"/proc/{pid}")
    return False


def _processes_mentioning(text: str) -> list[str]:
    """Command lines of live processes that contain ``text``."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != os.getpid():
            try:
                cmdline = Path(f"/proc/{name}/cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue
            if text.encode() in cmdline:
                found.append(f"{name}: {cmdline.decode(errors='replace')}")
    return found


# --- real launches ------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_all_reduce_returns_result_and_every_ranks_log(tmp_path, capsys):
    script = _script(tmp_path, ALL_REDUCE)
    res = torchrun(
        str(script), ["--flag", "two words"], nproc=2, timeout=90, log_dir=str(tmp_path / "logs")
    )

    assert res.ok and res.returncode == 0
    assert res.result == {"sum": [3.0], "world_size": 2, "argv": ["--flag", "two words"]}
    assert "rank 0 says hello, sum 3" in res.logs[0]
    assert "rank 1 says hello, sum 3" in res.logs[1]
    assert "rank 1 stderr line" in res.logs[1] and "rank 1" not in res.logs[0]
    assert -1 in res.logs  # torchrun's own output, kept apart
    kept = Path(res.log_dir)  # log_dir=: the files stay, one new folder per launch
    assert kept.parent == tmp_path / "logs" and (kept / "result.json").exists()
    assert len(list(kept.glob("torchrun/*/attempt_0/*/stdout.log"))) == 2
    assert "--standalone" in res.command  # a free port every time
    assert not any("master" in arg or "rdzv" in arg for arg in res.command)

    out = capsys.readouterr().out.splitlines()
    assert "[rank0] rank 0 says hello, sum 3" in out
    assert not any("rank 1" in line for line in out)  # other ranks: errors only
    assert re.fullmatch(r"torchrun: 2 processes, exit 0, \d+\.\d s", out[-1])
    assert len(out) <= 4


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_failing_rank_raises_launch_failed_naming_rank_and_error(tmp_path, capsys):
    script = _script(tmp_path, RANK1_RAISES)
    with pytest.raises(LaunchFailed) as info:
        torchrun(str(script), nproc=2, timeout=90)
    message = str(info.value)
    assert "exit code 1" in message
    assert "rank 1 failed first" in message
    assert "ValueError: boom from rank 1" in message
    assert len(message.splitlines()) <= launch_messages.TAIL_LINES + 2  # a tail, not a wall
    assert info.value.result is not None and info.value.result.returncode != 0
    out = capsys.readouterr().out
    assert "[rank1] ValueError: boom from rank 1" in out
    assert 'File "' not in out  # no traceback frames in the live view


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_check_false_returns_the_failed_result(tmp_path, capsys):
    # No torch import in the workers: a quick launch whose rank 1 exits with status 3.
    script = _script(tmp_path, RANK1_EXITS)
    res = torchrun(str(script), nproc=2, timeout=50, check=False, stream=False)
    assert res.returncode != 0 and not res.ok
    assert "rank 1 gives up" in res.logs[1] and "rank 0 done" in res.logs[0]
    assert launch_messages.first_failure(res) == (1, 3)
    assert res.result is None
    assert capsys.readouterr().out == ""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_restart_after_a_fault_is_logged_and_the_last_attempt_reports(tmp_path, capsys):
    script = _script(tmp_path, FAILS_ONCE)
    res = torchrun(str(script), nproc=2, max_restarts=1, timeout=90)
    assert res.ok and res.result == {"attempt": 1}
    for rank in range(2):
        before, marker, after = res.logs[rank].partition("--- torchrun restart 1 ---")
        assert marker and f"rank {rank} attempt 0" in before and f"rank {rank} attempt 1" in after
    out = capsys.readouterr().out.splitlines()
    assert "torchrun: restarting all workers (restart 1)" in out
    assert "[rank1] RuntimeError: injected fault" in out
    assert len(out) <= 8


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_timeout_kills_torchrun_and_every_worker(tmp_path):
    script = _script(tmp_path, HANGS)
    started = time.monotonic()
    with pytest.raises(LaunchTimeout) as info:
        torchrun(str(script), [str(tmp_path)], nproc=2, timeout=10, stream=False)
    assert time.monotonic() - started < 10 + proctree.GRACE_S + 10

    message = str(info.value)
    assert "did not finish within 10 s" in message
    assert re.search(r"killed [3-9] processes", message)  # torchrun and two workers
    assert "Last lines of rank 1" in message
    pids = [int((tmp_path / f"pid{rank}").read_text()) for rank in range(2)]
    assert all(_gone(pid) for pid in pids), pids
    assert _processes_mentioning(str(tmp_path)) == []


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_keyboard_interrupt_kills_everything_and_reraises(tmp_path):
    script = _script(tmp_path, HANGS)
    pid_files = [tmp_path / f"pid{rank}" for rank in range(2)]

    # the launch's own timeout is only a net, long enough for ranks started beside other jobs
    with stop_button(pid_files, within=140, delay=1.0) as pressed:
        with pytest.raises(KeyboardInterrupt):
            try:
                torchrun(str(script), [str(tmp_path)], nproc=2, timeout=150, stream=False)
            except LaunchTimeout as err:
                why = "pressed" if pressed else "the ranks' pid files did not appear"
                pytest.fail(f"no KeyboardInterrupt ({why}): {err}")

    pids = [int(p.read_text()) for p in pid_files]
    assert all(_gone(pid) for pid in pids), pids
    assert _processes_mentioning(str(tmp_path)) == []


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_two_launches_at_once_do_not_collide(tmp_path, capsys):
    results: dict[int, LaunchResult | BaseException] = {}

    def run(i: int) -> None:
        folder = tmp_path / f"job{i}"
        folder.mkdir()
        script = _script(folder, ALL_REDUCE)
        try:
            results[i] = torchrun(str(script), [str(i)], nproc=2, timeout=90, stream=False)
        except BaseException as err:  # reported below, not lost in the thread
            results[i] = err

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(2):
        res = results[i]
        assert isinstance(res, LaunchResult), res
        assert res.ok and res.result["sum"] == [3.0] and res.result["argv"] == [str(i)]
    assert capsys.readouterr().out == ""


# --- the pieces, without starting processes -------------------------------------------------


@pytest.mark.timeout(10)
def test_summary_view_shows_rank0_and_only_error_lines_of_others(capsys):
    printer = launch_logs.Printer("summary")
    printer.line(-1, "W1129 08:00:35 torchrun agent warning")
    printer.line(0, "epoch 1 loss 0.5")
    printer.line(1, "epoch 1 loss 0.5")
    printer.line(1, "[rank1]: Traceback (most recent call last):")
    printer.line(1, '[rank1]:   File "w.py", line 9, in <module>')
    printer.line(1, '[rank1]:     raise ValueError("boom")')
    printer.line(1, "[rank1]: ValueError: boom")
    printer.line(0, "10%|#  | 1/10\r50%|#####  | 5/10\r")
    for line in [
        "[rank0]: Traceback (most recent call last):",
        "[rank0]:   File ...",
        "[rank0]: KeyError: 'x'",
        "",
        "During handling of the above exception, another exception occurred:",
        "",
        "Traceback (most recent call last):",
        '  File "w.py", line 3',
        "RuntimeError: connection closed by peer",
    ]:
        printer.line(0, line)
    printer.line(0, "after the traceback")
    assert capsys.readouterr().out.splitlines() == [
        "[rank0] epoch 1 loss 0.5",
        "[rank1] ValueError: boom",
        "[rank0] 50%|#####  | 5/10",
        "[rank0] KeyError: 'x'",
        "[rank0] RuntimeError: connection closed by peer",
        "[rank0] after the traceback",
    ]


@pytest.mark.timeout(10)
def test_summary_view_is_capped_but_keeps_errors(capsys):
    printer = launch_logs.Printer("summary")
    for step in range(1000):
        printer.line(0, f"step {step}")
    printer.line(0, "RuntimeError: late failure")
    out = capsys.readouterr().out.splitlines()
    assert len(out) == launch_logs.SUMMARY_MAX_LINES + 2
    assert "result.logs" in out[-2] and out[-1] == "[rank0] RuntimeError: late failure"


@pytest.mark.timeout(10)
@pytest.mark.parametrize("mode", [None, "all"])
def test_other_stream_modes(mode, capsys):
    printer = launch_logs.Printer(mode)
    printer.line(-1, "agent line")
    printer.line(1, "rank 1 line")
    printer.note("torchrun: 2 processes, exit 0, 1.0 s")
    out = capsys.readouterr().out.splitlines()
    if mode is None:
        assert out == []
    else:
        assert out == ["[torchrun] agent line", "[rank1] rank 1 line", out[-1]]


@pytest.mark.timeout(10)
def test_follower_returns_only_complete_lines(tmp_path):
    path = tmp_path / "stdout.log"
    follower = launch_logs.Follower(path)
    assert follower.read() == []  # the file does not exist yet
    path.write_bytes(b"one\ntw")
    assert follower.read() == ["one"]
    with open(path, "ab") as f:
        f.write(b"o\nthree")
    assert follower.read() == ["two"]
    assert follower.read(final=True) == ["three"]


def _result(logs: dict[int, str], returncode: int = 1) -> LaunchResult:
    return LaunchResult(returncode, logs, None, 2.0, ["torchrun"])


@pytest.mark.timeout(10)
def test_failure_message_names_root_cause_and_quotes_a_short_tail():
    agent = textwrap.dedent("""\
        Root Cause (first observed failure):
        [0]:
          time      : 2026-11-29_08:00:35
          host      : localhost
          rank      : 1 (local_rank: 1)
          exitcode  : -9 (pid: 3254)
    """)
    rank1 = "".join(f"step {i}\n" for i in range(100)) + "[rank1]: MemoryError\n"
    res = _result({-1: agent, 0: "fine\n", 1: rank1})
    rank, code = launch_messages.first_failure(res)
    assert (rank, code) == (1, -9)
    message = launch_messages.failure_message(res, "train.py", rank, code)
    lines = message.splitlines()
    assert "exit code 1" in lines[0] and "rank 1 failed first (SIGKILL" in lines[0]
    assert lines[-1] == "    MemoryError" and len(lines) == launch_messages.TAIL_LINES + 1


@pytest.mark.timeout(10)
def test_failing_rank_is_guessed_from_logs_without_torchrun_report():
    res = _result({-1: "", 0: "ok\n", 1: "ddp_lab.train: error: --lr must be positive\n"})
    assert launch_messages.first_failure(res) == (1, None)
    assert launch_messages.first_failure(_result({-1: "", 0: "", 1: ""})) == (None, None)


@pytest.mark.timeout(10)
def test_write_result_is_atomic_rank0_only_and_a_noop_outside_torchrun(tmp_path, monkeypatch):
    target = tmp_path / "result.json"
    monkeypatch.delenv("DDP_LAB_RESULT", raising=False)
    write_result({"a": 1})  # no variable: nothing happens
    monkeypatch.setenv("DDP_LAB_RESULT", str(target))
    monkeypatch.setenv("RANK", "1")
    write_result({"a": 1})
    assert not target.exists()
    monkeypatch.setenv("RANK", "0")
    write_result({"a": 1, "path": tmp_path})
    assert json.loads(target.read_text()) == {"a": 1, "path": str(tmp_path)}
    assert [p.name for p in tmp_path.iterdir()] == ["result.json"]  # no temp file left
    with pytest.raises(TypeError):
        write_result([1, 2])  # type: ignore[arg-type]


@pytest.mark.timeout(10)
def test_bad_arguments_fail_before_starting_anything(tmp_path):
    with pytest.raises(FileNotFoundError, match="no script 'missing.py'"):
        torchrun("missing.py", cwd=str(tmp_path))
    script = _script(tmp_path, "pass\n")
    with pytest.raises(ValueError, match="nproc"):
        torchrun(str(script), nproc=0)
    with pytest.raises(ValueError, match="stream"):
        torchrun(str(script), stream="loud")
    with pytest.raises(ValueError, match="timeout"):
        torchrun(str(script), timeout=0)
    assert issubclass(LaunchFailed, LaunchError) and issubclass(LaunchTimeout, LaunchError)
    assert issubclass(LaunchError, RuntimeError)


@pytest.mark.timeout(10)
def test_cli_reports_a_missing_script_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert launch_main(["--nproc", "2", "missing.py", "--", "--flag"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "no script 'missing.py'" in err[0]
