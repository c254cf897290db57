"""``make time-labs``: run every solution notebook top to bottom, as a student would, and time it.

``python -m ddp_lab.grading.smoke [--lab LAB] [--budget S] [--root DIR]`` copies each
``solutions/<lab>/<lab>.ipynb`` into a scratch folder (notebooks are never executed inside
``solutions/`` or ``labs/``, so no run artefact can reach a release), executes it with the
course kernel outside of nbgrader (so the demos that the grader skips run too), and prints
one line per lab: wall time, the slowest cells, and the first error if a cell raised.

Exit status 1 when a notebook raised or took longer than ``--budget`` seconds (default 180,
the course's promise for a 2-core laptop), 0 otherwise.

Example:
    >>> main(["--lab", "lab01_data_parallel"])  # doctest: +SKIP
    lab01_data_parallel      41.2 s  ok   slowest: ex3 8.1 s, ...
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

PROG = "ddp_lab.grading.smoke"


def run_notebook(
    path: Path, cell_timeout: float = 600
) -> tuple[float, list[tuple[str, float]], str]:
    """Execute a copy of the notebook at ``path`` in a scratch folder.

    Returns:
        ``(seconds, [(cell_id, seconds), ...], error)``: total wall time, every code cell's
        time, and the first error (``""`` when every cell ran).
    """
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.read(path, as_version=4)
    with tempfile.TemporaryDirectory(prefix=f"ddp_lab-smoke-{path.stem}-") as tmp:
        work = Path(tmp) / path.stem
        work.mkdir()
        shutil.copy(path, work / path.name)
        env_backup = os.environ.pop("NBGRADER_EXECUTION", None)  # run as a student would
        client = NotebookClient(
            nb,
            timeout=cell_timeout,
            kernel_name="python3",
            resources={"metadata": {"path": str(work)}},
        )
        t0 = time.monotonic()
        error = ""
        try:
            client.execute()
        except CellExecutionError as exc:
            first = [line for line in str(exc).splitlines() if line.strip()]
            error = first[-1][:300] if first else "a cell raised"
        finally:
            if env_backup is not None:
                os.environ["NBGRADER_EXECUTION"] = env_backup
        seconds = time.monotonic() - t0
    cells = []
    for cell in nb.cells:
        timing = cell.get("metadata", {}).get("execution", {})
        start, end = timing.get("iopub.execute_input"), timing.get("shell.execute_reply")
        if cell.cell_type == "code" and start and end:
            took = (datetime.fromisoformat(end) - datetime.fromisoformat(start)).total_seconds()
            cells.append((cell.get("id", "?"), took))
    return seconds, cells, error


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--root", default=".", help="course root (holds solutions/)")
    p.add_argument("--lab", action="append", help="only this lab (repeatable)")
    p.add_argument("--budget", type=float, default=180, help="seconds allowed per notebook")
    args = p.parse_args(argv)
    root = Path(args.root).resolve()
    labs = sorted(p.name for p in (root / "solutions").glob("lab*") if p.is_dir())
    if args.lab:
        unknown = sorted(set(args.lab) - set(labs))
        if unknown:
            print(f"{PROG}: error: no such lab: {', '.join(unknown)}", file=sys.stderr)
            return 2
        labs = [lab for lab in labs if lab in args.lab]
    failed = 0
    for lab in labs:
        print(f"{lab:<24} running ...", flush=True)
        seconds, cells, error = run_notebook(root / "solutions" / lab / f"{lab}.ipynb")
        slowest = ", ".join(f"{cid} {s:.1f} s" for cid, s in sorted(cells, key=lambda c: -c[1])[:3])
        over = seconds > args.budget
        verdict = "ERROR" if error else ("OVER BUDGET" if over else "ok")
        failed += bool(error) or over
        print(f"{lab:<24} {seconds:6.1f} s  {verdict:<11} slowest: {slowest}", flush=True)
        if error:
            print(f"{'':<24} {error}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
