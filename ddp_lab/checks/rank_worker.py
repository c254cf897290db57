"""One rank of a distributed exercise: ``torchrun -m ddp_lab.checks.rank_worker LAB ID DIR I``.

Started by :func:`ddp_lab.checks.runner.run_ranks` (the visible check and the grader alike)
in the folder that holds the student's ``%%writefile`` files: under torchrun, or forked by
the grader with torchrun's variables set (``launch=``; the same :func:`main` either way).
Each rank joins a gloo group, runs the exercise's ``run_rank`` on case ``I`` of
``DIR/inputs.pt`` with the exercise's guards in place, and saves its outputs as
``DIR/case<I>-rank<r>.pt``. Solution cells that are plain code (not files) come from
``DIR/cells.json`` when the grader wrote one.

An error of the student's code ends the rank with one line (the error, and the line of the
student's file), so the launcher stops the other ranks and the check can quote it.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from ddp_lab.checks import guards
from ddp_lab.checks.contract import exercises
from ddp_lab.checks.runner import CELLS_FILE, INPUTS_FILE, namespace
from ddp_lab.checks.values import plain


def main(argv: list[str]) -> int:
    """Run one rank; see the module docstring."""
    lab, grade_id, workdir, index = argv[0], argv[1], Path(argv[2]), int(argv[3])
    ex = exercises(lab)[grade_id]
    inputs = torch.load(workdir / INPUTS_FILE, weights_only=True)
    case = inputs["cases"][index]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cells_file = workdir / CELLS_FILE
    sources = json.loads(cells_file.read_text()) if cells_file.is_file() else {}
    code_cells = [c for c in ex.cells if c in sources]
    with guards.exit_on_student_error(ex.files[0] if ex.files else "<cell"):
        ns = namespace(sources, code_cells, None, ex.forbid, ex.forbid_modules)
        with guards.forbidden_calls(ex.forbid):
            out = plain(ex.run_rank(ns, inputs, case, rank, world))
    torch.save(out, workdir / f"case{index}-rank{rank}.pt")
    del out, ns  # the student's objects go while the group still exists
    dist.barrier()
    gc.collect()  # objects in reference cycles are freed before the group (gloo aborts else)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
