"""ddp_lab.proctree: a command with a timeout, its output, and no process of its tree left.

Each test starts small Python processes (no torch); the ones that wait for a timeout or a
grace period take a few seconds.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _harness import stop_button

from ddp_lab import proctree
from ddp_lab.proctree import ProcessTree, TreeRun, process_table, run

PY = sys.executable

# Run as ``script.py root DIR``: root starts a child, the child starts a grandchild that calls
# os.setsid(); each writes "pid sid" to DIR/<role>.pid, then all three hang.
HANGS_WITH_SETSID_GRANDCHILD = """
    import os, subprocess, sys, time
    role, folder = sys.argv[1], sys.argv[2]
    if role == "grandchild":
        os.setsid()
    following = {"root": "child", "child": "grandchild"}.get(role)
    if following:
        subprocess.Popen([sys.executable, __file__, following, folder])
    path = os.path.join(folder, role + ".pid")
    with open(path + ".tmp", "w") as f:
        f.write(f"{os.getpid()} {os.getsid(0)}")
    os.replace(path + ".tmp", path)
    time.sleep(3600)
"""
ROLES = ("root", "child", "grandchild")

# Starts a daemon that writes its pid to argv[1] and sleeps; with argv[2] == "setsid" the
# daemon starts a session of its own. Waits for the pid file, lingers argv[3] s, exits 0.
LEAVES_A_DAEMON = """
    import os, subprocess, sys, time
    path, mode, linger = sys.argv[1], sys.argv[2], float(sys.argv[3])
    code = (
        "import os, sys, time; "
        "open(sys.argv[1] + '.tmp', 'w').write(str(os.getpid())); "
        "os.replace(sys.argv[1] + '.tmp', sys.argv[1]); time.sleep(3600)"
    )
    subprocess.Popen([sys.executable, "-c", code, path], start_new_session=mode == "setsid")
    while not os.path.exists(path):
        time.sleep(0.01)
    time.sleep(linger)
    print("parent done")
"""


@pytest.fixture(autouse=True)
def _no_leftovers_even_when_a_test_fails(tmp_path):
    """After each test, SIGKILL any process whose pid file is in tmp_path and still runs it."""
    yield
    for pid_file in tmp_path.glob("*.pid"):
        with contextlib.suppress(OSError, ValueError):
            pid = int(pid_file.read_text().split()[0])
            if str(tmp_path).encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGKILL)


def _script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(body))
    return path


def _pids_and_sids(folder: Path) -> list[tuple[int, int]]:
    """(pid, sid) of root, child and grandchild of HANGS_WITH_SETSID_GRANDCHILD."""
    return [tuple(map(int, (folder / f"{r}.pid").read_text().split())) for r in ROLES]


def _running(pid: int) -> bool:
    """True while ``pid`` is a live process (an unreaped zombie counts as gone)."""
    return pid in process_table()


@pytest.mark.timeout(30)
def test_normal_command_returns_its_output_and_exit_code(tmp_path):
    code = "import os, sys; print('out', os.getcwd()); print('err', file=sys.stderr); sys.exit(3)"
    res = run([PY, "-c", code], timeout=20, cwd=tmp_path)
    assert isinstance(res, TreeRun)
    assert res.returncode == 3
    assert res.stdout == f"out {tmp_path.resolve()}\n"
    assert res.stderr == "err\n"
    assert (res.timed_out, res.killed) == (False, 0)
    assert 0 < res.seconds < 20


@pytest.mark.timeout(30)
def test_env_is_the_complete_environment_and_stdin_is_empty():
    code = (
        "import os, sys; print(os.environ.get('X'), 'HOME' in os.environ, repr(sys.stdin.read()))"
    )
    res = run([PY, "-c", code], timeout=20, env={"X": "1"})
    assert res.returncode == 0, res.stderr
    assert res.stdout == "1 False ''\n"


@pytest.mark.timeout(30)
def test_timeout_kills_the_tree_including_a_grandchild_in_its_own_session(tmp_path):
    script = _script(tmp_path, HANGS_WITH_SETSID_GRANDCHILD)

    res = run([PY, str(script), "root", str(tmp_path)], timeout=5, grace=1.0)

    assert res.timed_out and res.returncode is None
    assert res.killed == 3  # root, child, grandchild
    assert res.seconds < 5 + 1.0 + 5
    (root, root_sid), _, (grandchild, grandchild_sid) = _pids_and_sids(tmp_path)
    assert root_sid == root and grandchild_sid == grandchild  # it left the root's session
    assert not any(_running(pid) for pid, _ in _pids_and_sids(tmp_path))


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("mode", "linger"),
    [
        ("same-session", 0.0),  # the parent exits at once: found through the session
        ("setsid", 1.5),  # its own session: found through its parent, while that lives
    ],
)
def test_daemon_left_behind_after_a_normal_exit_is_killed(tmp_path, mode, linger):
    daemon_pid = tmp_path / "daemon.pid"
    script = _script(tmp_path, LEAVES_A_DAEMON)

    res = run([PY, str(script), str(daemon_pid), mode, str(linger)], timeout=20, grace=1.0)

    assert (res.returncode, res.timed_out, res.stdout) == (0, False, "parent done\n")
    assert res.killed == 1
    pid = int(daemon_pid.read_text())
    assert not _running(pid), pid


@pytest.mark.timeout(60)
def test_output_larger_than_the_pipe_buffer_does_not_deadlock():
    code = "import sys; sys.stdout.write('x' * 3_000_000); sys.stderr.write('y' * 2_000_000)"
    res = run([PY, "-c", code], timeout=45)
    assert res.returncode == 0 and not res.timed_out
    assert (len(res.stdout), len(res.stderr)) == (3_000_000, 2_000_000)


@pytest.mark.timeout(30)
def test_keyboard_interrupt_kills_the_tree_and_reraises(tmp_path):
    script = _script(tmp_path, HANGS_WITH_SETSID_GRANDCHILD)

    pid_files = [tmp_path / f"{role}.pid" for role in ROLES]
    with stop_button(pid_files, within=20) as pressed, pytest.raises(KeyboardInterrupt):
        run([PY, str(script), "root", str(tmp_path)], timeout=25, grace=1.0)
        pytest.fail(
            "run() returned without the interrupt: "
            + ("it was pressed" if pressed else "the pid files did not appear within 20 s")
        )

    assert not any(_running(pid) for pid, _ in _pids_and_sids(tmp_path))


@pytest.mark.timeout(10)
def test_process_table_lists_this_process_with_its_parent_group_and_session():
    me = process_table()[os.getpid()]
    assert (me.ppid, me.pgid, me.sid) == (os.getppid(), os.getpgrp(), os.getsid(0))


@pytest.mark.timeout(30)
def test_process_tree_terminate_counts_the_root_and_reaps_it():
    proc = subprocess.Popen([PY, "-c", "import time; time.sleep(60)"], start_new_session=True)
    tree = ProcessTree(proc)
    assert tree.alive(tree.refresh()) == [proc.pid]
    assert tree.terminate(grace=1.0) == 1
    assert proc.returncode is not None and tree.killed == 1
    assert tree.terminate(grace=1.0) == 0  # nothing left: a second call is harmless


@pytest.mark.timeout(10)
def test_bad_arguments_fail_before_starting_anything():
    with pytest.raises(TypeError, match="sequence of arguments"):
        run("echo hi", timeout=5)
    with pytest.raises(ValueError, match="timeout"):
        run(["true"], timeout=0)
    with pytest.raises(ValueError, match="grace"):
        run(["true"], timeout=5, grace=-1)


def test_launch_uses_the_shared_grace_period():
    from ddp_lab.launch import start

    assert start.GRACE_S == proctree.GRACE_S
    assert not hasattr(start, "_Tree") and not hasattr(start, "_process_table")
