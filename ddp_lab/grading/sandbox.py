"""Confine student code while grading: the course read-only, answers and other people's work hidden.

During ``make autograde`` student code runs in two places: the notebook's kernel (started
by nbgrader) and the fresh processes that re-run each exercise for its verdict. Both are
started through :func:`confine`, which (on Linux, as root or with unprivileged user
namespaces) gives them their own mount namespace in which

- the course root (and the ``ddp_lab`` package, wherever it is installed) is read-only;
- ``solutions/``, ``ddp_lab/answers`` (the reference answers), ``grading/submitted``,
  ``grading/autograded``, ``grading/feedback``, ``grading/source_solutions`` and the
  gradebook are hidden (an empty folder, an empty file);
- only the process's own working folder and the temporary folder (``TMPDIR``) stay writable.

So a submission cannot copy the instructor's solution or a classmate's notebook, cannot
edit the grader's code or the gradebook, and cannot leave files for later runs.

``python -m ddp_lab.grading.sandbox --root DIR [--keep DIR] [--hide PATH] -- CMD ...`` is the
command form (it re-executes itself under ``unshare``). Where no mount namespace can be made
(macOS, containers without user namespaces), :func:`available` is False, and
``make autograde`` says so: grade inside a container instead (README, "Grading sandbox").

Example:
    >>> confine(["python", "-c", "print(1)"], roots=["/course"])  # doctest: +SKIP
    ['unshare', '-m', '--propagation', 'private', '/.../python', '-m', ...]
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path

PROG = "ddp_lab.grading.sandbox"
PACKAGE_DIR = Path(__file__).resolve().parent.parent
# what student code must never see, relative to a course root
HIDDEN = (
    "solutions",
    "ddp_lab/answers",
    "grading/submitted",
    "grading/autograded",
    "grading/feedback",
    "grading/source_solutions",
    "grading/gradebook.db",
)
# set to "off" by `make autograde --sandbox off` (for platforms without namespaces)
ENV_SWITCH = "DDP_LAB_SANDBOX"


@functools.cache
def _unshare_flags() -> tuple[str, ...] | None:
    """``unshare`` flags that give a private mount namespace here, or None."""
    if not sys.platform.startswith("linux") or not shutil.which("unshare"):
        return None
    for flags in (("-m",), ("-r", "-m")):
        cmd = ["unshare", *flags, "--propagation", "private", "sh", "-c", "mount -t tmpfs x /mnt"]
        try:
            probe = subprocess.run(cmd, capture_output=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            continue
        if probe.returncode == 0:
            return flags
    return None


def available() -> bool:
    """True when student processes can be confined here (and nobody switched it off)."""
    return os.environ.get(ENV_SWITCH, "auto") != "off" and _unshare_flags() is not None


def course_roots() -> list[Path]:
    """Course roots to protect: the repository ``ddp_lab`` comes from and the current folder
    (nbgrader runs in the course root), where they hold an ``nbgrader_config.py``."""
    roots = []
    for root in (PACKAGE_DIR.parent, Path.cwd().resolve()):
        if (root / "nbgrader_config.py").is_file() and root not in roots:
            roots.append(root)
    return roots


def confine(
    cmd: list[str],
    roots: Iterable[str | Path] | None = None,
    keep: Iterable[str | Path] = (),
    hide: Iterable[str | Path] = (),
) -> list[str]:
    """``cmd`` prefixed so that it runs confined, or ``cmd`` itself where that is impossible.

    Args:
        cmd: the command (the student's kernel or exercise runner).
        roots: course roots to make read-only and to hide the answers of (default:
            :func:`course_roots`).
        keep: folders under a root that stay visible and writable (the kernel's own folder).
        hide: further files or folders to hide (other exercises' scratch folders).

    Returns:
        the command to run.
    """
    if not available():
        return list(cmd)
    roots = course_roots() if roots is None else [Path(r) for r in roots]
    keep = [Path(k) for k in keep]
    scratch = Path(tempfile.gettempdir()).resolve()
    if any(scratch.is_relative_to(r) for r in roots):  # TMPDIR inside the course
        keep.append(scratch)
    args = [*_unshare_flags(), "--propagation", "private"]
    inner = [sys.executable, "-m", PROG]
    for root in roots:
        inner += ["--root", str(root)]
    for path in keep:
        inner += ["--keep", str(path)]
    for path in hide:
        inner += ["--hide", str(path)]
    return ["unshare", *args, *inner, "--", *cmd]


def _mount(*args: str) -> None:
    proc = subprocess.run(["mount", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise OSError(f"mount {' '.join(args)}: {proc.stderr.strip()}")


def _read_only(path: Path) -> None:
    _mount("--bind", str(path), str(path))
    _mount("-o", "remount,bind,ro", str(path))


def setup(roots: list[Path], keep: list[Path], hide: list[Path]) -> None:
    """Inside a fresh mount namespace: apply the rules of :func:`confine`.

    Order matters: the course read-only, its answers covered by empty folders (with the
    kept folders' paths made inside them), the kept folders mounted back writable, then the
    extra hidden paths (which may lie inside a kept folder), then the covers made read-only.
    """
    held = [(path, os.open(path, os.O_PATH | os.O_DIRECTORY)) for path in keep]
    for root in roots:
        _read_only(root)
    if not any(PACKAGE_DIR.is_relative_to(root) for root in roots):
        _read_only(PACKAGE_DIR)
    covers = []
    for target in [root / rel for root in roots for rel in HIDDEN]:
        if target.is_dir():
            _mount("-t", "tmpfs", "-o", "size=64k,mode=755", "hidden", str(target))
            covers.append(target)
            for path, _ in held:
                if path.is_relative_to(target):
                    path.mkdir(parents=True, exist_ok=True)
        elif target.exists():
            _mount("--bind", "/dev/null", str(target))
    for path, fd in sorted(held, key=lambda item: len(item[0].parts)):
        source = f"/proc/{os.getpid()}/fd/{fd}"
        _mount("--no-canonicalize", "--bind", source, str(path))
        _mount("-o", "remount,bind,rw", str(path))
        os.close(fd)
    for target in hide:
        if target.is_dir():
            _mount("-t", "tmpfs", "-o", "ro,size=4k,mode=555", "hidden", str(target))
        elif target.exists():
            _mount("--bind", "/dev/null", str(target))
    for target in covers:
        _mount("-o", "remount,ro", str(target))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--root", action="append", default=[], type=Path)
    p.add_argument("--keep", action="append", default=[], type=Path)
    p.add_argument("--hide", action="append", default=[], type=Path)
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        p.error("no command given")
    cwd = os.getcwd()
    try:
        setup([r.resolve() for r in args.root], [k.resolve() for k in args.keep], args.hide)
    except OSError as err:
        print(f"{PROG}: cannot confine the student's code: {err}", file=sys.stderr)
        return 70
    try:
        os.chdir(cwd)  # onto the mounts just made
    except OSError:
        print(f"{PROG}: the working folder {cwd} is hidden: pass it as --keep", file=sys.stderr)
        return 70
    os.execvp(cmd[0], cmd)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
