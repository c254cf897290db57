"""The student process: run a student's solution cells on the grader's inputs, save outputs.

``python -m ddp_lab.grading.student LAB GRADE_ID WORKDIR`` runs in ``WORKDIR``, which holds

- ``cells.json``: ``{grade_id: source}`` of the solution cells the exercise needs,
- ``inputs.pt``: the inputs the grader drew (loaded with ``weights_only=True``),

and writes ``outputs.pt``. Whatever the student's code does here (monkeypatching torch,
writing files) stays in this process: the verdict is reached by ``ddp_lab.grading.judge``
in another one. Distributed exercises start ``torchrun -m ddp_lab.grading.student
--rank-worker ...`` from here, one job per ``inputs["cases"]`` entry.
"""

from __future__ import annotations

import gc
import json
import os
import re
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from ddp_lab.grading.exercise import Exercise, exercises
from ddp_lab.grading.notebook import split_magics

OUTPUTS = "outputs.pt"


def mentions(source: str, module: str) -> bool:
    """True when ``source`` names ``module`` (``a.b`` or ``from a import b``).

    Example:
        >>> mentions("from ddp_lab import checks as c", "ddp_lab.checks")
        True
    """
    package, _, leaf = module.rpartition(".")
    pattern = rf"from\s+{re.escape(package)}\s+import\s+[^\n]*\b{re.escape(leaf)}\b"
    return module in source or bool(package and re.search(pattern, source))


#: Modules no solution cell may use: they hold the reference answers.
ALWAYS_FORBIDDEN = ("ddp_lab.checks",)


def build_namespace(
    workdir: Path, cells: list[str], write_files: bool = True, forbid_modules: tuple[str, ...] = ()
) -> dict:
    """Execute the solution cells (in order) in a fresh namespace; write their files.

    A ``%%writefile NAME`` cell becomes the file ``workdir/NAME`` (unless ``write_files``
    is False: torchrun ranks reuse what the parent wrote). The namespace's ``__name__`` is
    ``"__student__"``, so ``if __name__ == "__main__":`` blocks do not run.

    Raises:
        PermissionError: a cell mentions a forbidden module (``ddp_lab.checks`` and the
            exercise's ``forbid_modules``).
    """
    sources = json.loads((workdir / "cells.json").read_text())
    ns: dict = {"__name__": "__student__"}
    for grade_id in cells:
        if grade_id not in sources:
            raise LookupError(f"the notebook has no solution cell {grade_id!r} (deleted?)")
        for name in (*ALWAYS_FORBIDDEN, *forbid_modules):
            if mentions(sources[grade_id], name):
                raise PermissionError(
                    f"solution cell {grade_id} uses {name}, which holds the reference "
                    "answer: write the code yourself"
                )
        code, files = split_magics(sources[grade_id])
        for name, text in files.items() if write_files else ():
            (workdir / name).write_text(text)
        if code.strip():
            exec(compile(code, f"<cell {grade_id}>", "exec"), ns)  # noqa: S102
    return ns


def load_module_file(path: str | Path) -> dict:
    """Run a file the student's ``%%writefile`` cell wrote; return its namespace."""
    import runpy

    return runpy.run_path(str(path), run_name="__student__")


def _forbidden(name: str):
    def refuse(*args, **kwargs):
        raise RuntimeError(
            f"torch.distributed.{name} is not allowed in this exercise: build it from "
            "send/recv (isend/irecv) yourself"
        )

    return refuse


def run_rank_worker(lab: str, grade_id: str, workdir: Path, case_index: int) -> None:
    """One rank of a distributed exercise (started by torchrun): run, save ``rank<r>.pt``."""
    ex = exercises(lab)[grade_id]
    inputs = torch.load(workdir / "inputs.pt", weights_only=True)
    case = inputs["cases"][case_index]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ns = build_namespace(
        workdir, list(ex.cells), write_files=False, forbid_modules=ex.forbid_modules
    )
    saved = {name: getattr(dist, name) for name in ex.forbid}
    for name in ex.forbid:
        setattr(dist, name, _forbidden(name))
    try:
        out = ex.run_rank(ns, inputs, case, rank, world)
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
    torch.save(out, workdir / f"case{case_index}-rank{rank}.pt")
    del out, ns  # the student's objects go while the group still exists
    dist.barrier()
    gc.collect()  # see ddp_lab.dist.teardown
    dist.destroy_process_group()


def run_distributed(ex: Exercise, lab: str, inputs: dict, workdir: Path) -> dict:
    """Run every case of a distributed exercise under torchrun; collect per-rank outputs."""
    from ddp_lab.launch import LaunchError, torchrun

    build_namespace(workdir, list(ex.cells), forbid_modules=ex.forbid_modules)  # files
    results = []
    per_case = ex.timeout / max(1, len(inputs["cases"]))
    for i, case in enumerate(inputs["cases"]):
        try:
            torchrun(
                "ddp_lab.grading.student",
                ["--rank-worker", lab, ex.grade_id, str(workdir), str(i)],
                nproc=case["world_size"],
                module=True,
                timeout=per_case,
                cwd=str(workdir),
                stream=False,
            )
        except LaunchError as err:
            raise RuntimeError(_short(str(err))) from None
        results.append(
            [
                torch.load(workdir / f"case{i}-rank{r}.pt", weights_only=True)
                for r in range(case["world_size"])
            ]
        )
    return {"cases": results}


def _short(text: str, lines: int = 12) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--rank-worker":
        lab, grade_id, workdir, case = argv[1:5]
        run_rank_worker(lab, grade_id, Path(workdir), int(case))
        return 0
    lab, grade_id, workdir = argv[0], argv[1], Path(argv[2])
    ex = exercises(lab)[grade_id]
    inputs = torch.load(workdir / "inputs.pt", weights_only=True)
    try:
        if ex.run_rank is not None:
            outputs = run_distributed(ex, lab, inputs, workdir)
        else:
            ns = build_namespace(workdir, list(ex.cells), forbid_modules=ex.forbid_modules)
            outputs = ex.run(ns, inputs, workdir)
    except Exception as err:  # the student's error, reported as the verdict's reason
        tb = traceback.extract_tb(err.__traceback__)
        where = next(
            (
                f"{f.filename}, line {f.lineno}"
                for f in reversed(tb)
                if f.filename.startswith("<cell")
            ),
            None,
        )
        print(f"{type(err).__name__}: {err}" + (f" ({where})" if where else ""), file=sys.stderr)
        return 1
    torch.save(outputs, workdir / OUTPUTS)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main(sys.argv[1:]))
