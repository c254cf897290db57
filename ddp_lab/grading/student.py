"""The student process: run a student's solution cells on the grader's inputs, save outputs.

``python -m ddp_lab.grading.student LAB GRADE_ID WORKDIR`` runs (sandboxed) in ``WORKDIR``,
which holds

- ``cells.json``: ``{grade_id: source}`` of the solution cells the exercise needs,
- ``inputs.pt``: the inputs the grader drew (loaded with ``weights_only=True``),

and writes ``outputs.pt``. It takes the same path as the notebook's visible check
(:mod:`ddp_lab.checks.runner`): the cells' code in a fresh namespace, their ``%%writefile``
files written here, then ``Exercise.run`` in this process or ``Exercise.run_rank`` on every
rank of one job per case (the ranks forked from this process, which has torch loaded
already: :mod:`ddp_lab.grading.ranks`; torchrun where forking is not available). Whatever
the student's code does here (monkeypatching torch, writing files) stays in this process:
the verdict is reached by :mod:`ddp_lab.grading.judge` in another one.
"""

from __future__ import annotations

import functools
import json
import sys
import traceback
from pathlib import Path

import torch

from ddp_lab.checks.contract import exercises
from ddp_lab.checks.failure import CheckFailed
from ddp_lab.checks.runner import CELLS_FILE, INPUTS_FILE, namespace, run_here, run_ranks
from ddp_lab.checks.values import plain
from ddp_lab.grading import ranks

OUTPUTS = "outputs.pt"


def _where(err: BaseException) -> str | None:
    frames = traceback.extract_tb(err.__traceback__)
    return next(
        (f"{f.filename}, line {f.lineno}" for f in reversed(frames) if f.filename.startswith("<")),
        None,
    )


def _launcher():
    """The ranks forked from this process (no torch import per rank), else torchrun."""
    if not ranks.available():
        return None
    from ddp_lab.checks import rank_worker

    return functools.partial(ranks.fork_ranks, rank_worker.main)


def main(argv: list[str]) -> int:
    lab, grade_id, workdir = argv[0], argv[1], Path(argv[2])
    ex = exercises(lab)[grade_id]
    inputs = torch.load(workdir / INPUTS_FILE, weights_only=True)
    sources = json.loads((workdir / CELLS_FILE).read_text())
    try:
        if ex.distributed:  # write the files, check the code, then run every rank
            namespace(sources, ex.cells, workdir, ex.forbid, ex.forbid_modules)
            outputs = run_ranks(ex, lab, inputs, workdir, workdir, ex.timeout, _launcher())
        else:
            ns = namespace(sources, ex.cells, workdir, ex.forbid, ex.forbid_modules)
            outputs = plain(run_here(ex, ns, inputs, workdir))
    except CheckFailed as err:  # a failed or hung torchrun job, said in one line
        print(str(err), file=sys.stderr)
        return 1
    except Exception as err:  # the student's error, reported as the verdict's reason
        where = _where(err)
        print(f"{type(err).__name__}: {err}" + (f" ({where})" if where else ""), file=sys.stderr)
        return 1
    torch.save(outputs, workdir / OUTPUTS)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
