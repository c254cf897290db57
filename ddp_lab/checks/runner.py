"""One path from an exercise's contract to a verdict: inputs -> run -> judge.

The visible check in the notebook and the grader use the same pieces:

- :func:`namespace`: the solution cells' code executed in a fresh namespace, their
  ``%%writefile`` files written (grader);
- :func:`run_here`: ``Exercise.run`` in this process, the exercise's forbidden calls refused;
- :func:`run_ranks`: ``Exercise.run_rank`` on every rank of one torchrun job per case, each
  rank being :mod:`ddp_lab.checks.rank_worker` (the grader forks the same ranks instead);
- :func:`visible`: the quick feedback of a test cell: the exercise's small fixed inputs, the
  student's functions from the kernel (or files from the notebook's folder), the same run
  and the same judge; prints ``OK: ...`` or raises :class:`CheckFailed`.

The grader (``ddp_lab.grading``, instructor only) calls :func:`namespace`, :func:`run_here`
and :func:`run_ranks` in a fresh, sandboxed student process on inputs drawn at grading time,
and judges in another process (adding the instructor's exact comparisons).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from ddp_lab.checks import guards
from ddp_lab.checks.contract import Exercise, exercises, unsealed
from ddp_lab.checks.failure import CheckFailed, passed

#: Seed of the visible checks' inputs (the grader draws fresh ones from the OS).
VISIBLE_SEED = 0
#: What nbgrader puts into a released solution cell.
STUB = "raise NotImplementedError"
#: Where the rank worker finds the solution cells' sources (grader only).
CELLS_FILE = "cells.json"
#: The inputs of a run, saved by the caller for the rank workers.
INPUTS_FILE = "inputs.pt"


def grading() -> bool:
    """True while ``nbgrader autograde`` runs the notebook (the grader, not a student)."""
    return os.environ.get("NBGRADER_EXECUTION") == "autograde"


def split_magics(source: str) -> tuple[str, dict[str, str]]:
    """Turn a cell's source into plain Python, plus the files it would write.

    A cell that starts with ``%%writefile NAME`` is a file, not code. Other IPython lines
    (``%time``, ``!ls``) are blanked, keeping line numbers for error messages.

    Returns:
        ``(code, files)``: the Python code and a ``{filename: text}`` map.

    Example:
        >>> split_magics("%%writefile w.py\\nprint(1)\\n")
        ('', {'w.py': 'print(1)\\n'})
        >>> split_magics("%matplotlib inline\\nx = 1")
        ('\\nx = 1', {})
    """
    lines = source.split("\n")
    first = lines[0].strip().split() if lines else []
    if first[:1] == ["%%writefile"] and len(first) >= 2 and first[-1] != "-a":
        return "", {first[-1]: "\n".join(lines[1:])}
    code = ["" if line.lstrip().startswith(("%", "!")) else line for line in lines]
    return "\n".join(code), {}


def namespace(
    sources: Mapping[str, str],
    cells: tuple[str, ...] | list[str],
    workdir: Path | None = None,
    forbid: tuple[str, ...] = (),
    forbid_modules: tuple[str, ...] = (),
) -> dict:
    """Execute solution cells (in order) in a fresh namespace; write their files.

    Args:
        sources: ``grade_id -> source`` of the notebook's solution cells.
        cells: the cells to run, in order.
        workdir: where ``%%writefile NAME`` cells write ``NAME`` (None: write nothing; the
            rank workers reuse what their parent wrote).
        forbid: ``torch.distributed`` calls refused while the cells run.
        forbid_modules: modules the cells may not mention (see :mod:`~ddp_lab.checks.guards`).

    Returns:
        The namespace (its ``__name__`` is ``"__student__"``, so ``if __name__ ==
        "__main__":`` blocks do not run).

    Raises:
        LookupError: a cell is missing from the notebook.
        PermissionError: a cell mentions a forbidden module.
    """
    missing = [c for c in cells if c not in sources]
    if missing:
        raise LookupError(f"the notebook has no solution cell {missing[0]!r} (deleted?)")
    guards.refuse_mentions({c: sources[c] for c in cells}, forbid_modules)
    ns: dict = {"__name__": "__student__"}
    with guards.forbidden_calls(forbid):
        for cell in cells:
            code, files = split_magics(sources[cell])
            for name, text in files.items() if workdir is not None else ():
                (workdir / name).write_text(text)
            if code.strip():
                exec(compile(code, f"<cell {cell}>", "exec"), ns)  # noqa: S102
    return ns


def run_here(ex: Exercise, ns: Mapping, inputs: dict, workdir: Path):
    """``ex.run`` in this process, with the exercise's forbidden calls refused."""
    with guards.forbidden_calls(ex.forbid):
        return ex.run(dict(ns), inputs, workdir)


def run_ranks(
    ex: Exercise,
    lab: str,
    inputs: dict,
    workdir: Path,
    folder: Path,
    timeout: float,
    launch: Callable[..., object] | None = None,
) -> dict:
    """Run every case of a distributed exercise on its ranks; collect each rank's outputs.

    Args:
        ex, lab: the exercise and its lab.
        inputs: the inputs (also saved as ``workdir/inputs.pt`` here for the rank workers).
        workdir: where the ranks read the inputs and write ``case<i>-rank<r>.pt``.
        folder: the ranks' working folder, where the student's ``%%writefile`` files are.
        timeout: seconds for all cases together.
        launch: how one case's ranks start (default: torchrun); called as
            ``launch(args, nproc=, timeout=, cwd=, logs=)`` with the rank worker's
            arguments, it raises :class:`~ddp_lab.launch.LaunchError` as torchrun does (the
            grader forks the ranks from its student process: ``ddp_lab.grading.ranks``).

    Returns:
        ``{"cases": [[rank 0's outputs, rank 1's, ...], ...]}``.

    Raises:
        CheckFailed: a job failed (the student's error and line) or hung (stopped).
    """
    from ddp_lab.launch import LaunchError, LaunchTimeout, torchrun
    from ddp_lab.launch.messages import student_problem

    torch.save(inputs, workdir / INPUTS_FILE)
    filename = ex.files[0] if ex.files else "your code"
    per_case = timeout / max(1, len(inputs["cases"]))
    results = []
    for i, case in enumerate(inputs["cases"]):
        n = case["world_size"]
        args = [lab, ex.grade_id, str(workdir), str(i)]
        try:
            if launch is None:
                torchrun(
                    "ddp_lab.checks.rank_worker",
                    args,
                    nproc=n,
                    module=True,
                    timeout=per_case,
                    cwd=str(folder),
                    stream=False,
                )
            else:
                launch(args, nproc=n, timeout=per_case, cwd=folder, logs=workdir / f"case{i}")
        except LaunchTimeout:
            raise CheckFailed(
                f"{filename} did not finish within {per_case:g} s on {n} ranks and was "
                "stopped: the ranks are waiting for each other (a collective that only some "
                "ranks call, a recv before any send, or ranks that run different numbers of "
                "steps?)"
            ) from None
        except LaunchError as err:
            raise CheckFailed(student_problem(err, filename)) from None
        results.append(
            [torch.load(workdir / f"case{i}-rank{r}.pt", weights_only=True) for r in range(n)]
        )
    return {"cases": results}


def _unfinished(ex: Exercise, folder: Path) -> str | None:
    """Why a visible check cannot run yet (a file missing or still the stub), or None."""
    for name in ex.files:
        path = folder / name
        if not path.is_file():
            return f"{name} not found in {folder}: run the cell that starts with %%writefile {name}"
        if STUB in path.read_text():
            return f"{name} still holds the released stub ({STUB}): finish this exercise first"
    return None


def visible(
    lab: str,
    grade_id: str,
    functions: Mapping[str, Callable] | None = None,
    folder: str | Path = ".",
    inputs: dict | None = None,
) -> None:
    """The visible check of a test cell: small fixed inputs -> the student's code -> judge.

    Args:
        lab, grade_id: which exercise.
        functions: the student's functions from the kernel (``{"split_batch": fn}``), for
            exercises that run in one process.
        folder: where the notebook's ``%%writefile`` cells wrote the files (distributed
            exercises run them on every rank under torchrun).
        inputs: the inputs to use (default: ``visible_inputs`` drawn with
            :data:`VISIBLE_SEED`).

    Prints the judge's success message as ``OK: ...`` and returns None: a test cell whose
    last line is the check shows that line once, and gives nbgrader's Validate no output
    value to read as a score.

    Raises:
        CheckFailed: what is wrong, or why the check cannot run yet (a code the exercise
            refuses, too: shown in the notebook as one message, without the grader's frames).
    """
    ex = exercises(lab)[grade_id]
    if inputs is None:
        make = ex.visible_inputs or ex.make_inputs
        inputs = make(torch.Generator().manual_seed(VISIBLE_SEED))
    folder = Path(folder).resolve()
    with tempfile.TemporaryDirectory(prefix="ddp_lab-check-") as tmp:
        workdir = Path(tmp)
        if ex.distributed:
            if grading():  # the grader runs the same ranks right after, outside the kernel
                print(f"{ex.title}: run by the grader outside this kernel (see its verdict)")
                return
            if why := _unfinished(ex, folder):
                raise CheckFailed(why)
            outputs = run_ranks(ex, lab, unsealed(inputs), workdir, folder, ex.timeout)
        else:
            try:
                outputs = run_here(ex, functions or {}, unsealed(inputs), workdir)
            except NotImplementedError:
                names = list(functions or {}) or ["your function"]
                who = " and ".join([", ".join(names[:-1]), names[-1]] if names[1:] else names)
                verb = "raise" if names[1:] else "raises"
                raise CheckFailed(
                    f"{who} still {verb} NotImplementedError: finish this exercise first "
                    "(replace the stub by your code and run its cell)"
                ) from None
            except CheckFailed:
                raise
            except PermissionError as err:  # a call or module the exercise refuses
                raise CheckFailed(str(err)) from None
            except Exception as err:  # noqa: BLE001 - the student's error, said in one line
                raise CheckFailed(f"your code raised {type(err).__name__}: {err}") from None
        # what the grader saves and its judge loads: plain values only
        torch.save(outputs, workdir / "outputs.pt")
        outputs = torch.load(workdir / "outputs.pt", weights_only=True)
    passed(ex.judge(inputs, outputs))


def write_cells(workdir: Path, sources: Mapping[str, str], cells) -> None:
    """Save the solution cells' sources where the rank workers look for them."""
    (workdir / CELLS_FILE).write_text(json.dumps({c: sources[c] for c in cells if c in sources}))
