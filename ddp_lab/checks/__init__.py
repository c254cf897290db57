"""The assertions behind the notebooks' test cells.

Each lab has a module here (``ddp_lab.checks.lab01`` ...) with two kinds of checks:

- **visible checks**, called by a test cell inside the student's kernel for quick, friendly
  feedback: they print what they checked, or raise :class:`CheckFailed` saying what was
  expected and what came back;
- **exercises** (``EXERCISES``), which the grader runs *outside* the kernel on inputs drawn
  at grading time (see ``ddp_lab.grading``). Only these decide the points.

A test cell looks like::

    checks.average_gradients(average_gradients)      # visible, in-kernel
    ### BEGIN HIDDEN TESTS
    checks.verdict("test_ex2_average_gradients")     # judged outside the kernel
    ### END HIDDEN TESTS
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

import torch


class CheckFailed(AssertionError):
    """A check that did not hold; the message says what was expected and what came back."""


def passed(message: str) -> None:
    """Print a success line for a check (stdout, short)."""
    print(f"OK: {message}")


def require(condition: bool, message: str) -> None:
    """Raise :class:`CheckFailed` with ``message`` unless ``condition`` holds.

    Example:
        >>> require(1 + 1 == 2, "arithmetic")
    """
    if not condition:
        raise CheckFailed(message)


def assert_close(
    got, expected: torch.Tensor, what: str, atol: float = 1e-6, rtol: float = 1e-5
) -> None:
    """Check that ``got`` is a tensor of ``expected``'s shape with values close to it.

    Raises:
        CheckFailed: naming ``what``, the expected and received shapes or values, and the
            largest difference.

    Example:
        >>> assert_close(torch.ones(2), torch.ones(2), "the average")
    """
    if not isinstance(got, torch.Tensor):
        raise CheckFailed(f"{what}: expected a tensor, got {type(got).__name__}")
    if tuple(got.shape) != tuple(expected.shape):
        raise CheckFailed(f"{what}: expected shape {tuple(expected.shape)}, got {tuple(got.shape)}")
    got_d, exp_d = got.detach().double().cpu(), expected.detach().double().cpu()
    if not bool(torch.isfinite(got_d).all()):
        raise CheckFailed(f"{what}: contains NaN or inf")
    diff = (got_d - exp_d).abs()
    tol = atol + rtol * exp_d.abs()
    if bool((diff > tol).any()):
        i = int(torch.argmax(diff - tol))
        raise CheckFailed(
            f"{what}: max abs difference {diff.max().item():.3g} (allowed {atol:g} + "
            f"{rtol:g}*|expected|); e.g. at flat index {i}: expected "
            f"{exp_d.flatten()[i].item():.6g}, got {got_d.flatten()[i].item():.6g}"
        )


def make_verdict(lab: str, notebook: str | None = None) -> Callable[[str], None]:
    """A lab's ``verdict(grade_id)`` function for hidden test cells.

    Under ``nbgrader autograde`` it only says that the grader decides (the grader judges
    outside the kernel and overwrites this cell's outcome). Run by hand (an instructor in
    ``solutions/``), it judges the *saved* notebook file now and raises on failure.
    """
    notebook = notebook or f"{lab}.ipynb"

    def verdict(grade_id: str) -> None:
        if os.environ.get("NBGRADER_EXECUTION") == "autograde":
            print(f"{grade_id}: judged by the grader outside this kernel, on fresh inputs")
            return
        from ddp_lab.grading.verdict import judge_notebook

        if not Path(notebook).is_file():
            raise CheckFailed(
                f"{notebook} not found in {os.getcwd()}: run the notebook from its folder"
            )
        v = judge_notebook(notebook, lab, [grade_id])[grade_id]
        if not v.passed:
            raise CheckFailed(f"{grade_id} (judged on the saved notebook): {v.message}")
        passed(f"{grade_id} (judged outside this kernel on the saved notebook): {v.message}")

    return verdict


def launch_problem(err: Exception, filename: str) -> str:
    """The student's error from a failed torchrun job (``ddp_lab.launch.LaunchError``):
    the first rank that raised, its message, and the line of ``filename`` it came from."""
    logs = getattr(getattr(err, "result", None), "logs", None) or {}
    for rank in sorted(r for r in logs if r >= 0):
        lines = [re.sub(r"^\[rank\d+\]:\s?", "", line) for line in logs[rank].splitlines()]
        errors = [line.strip() for line in lines if re.match(r"\s*[\w.]*(Error|Exception)\b", line)]
        if errors:
            places = re.findall(rf'File "[^"]*{re.escape(filename)}", line (\d+)', logs[rank])
            at = f" ({filename} line {places[-1]})" if places else ""
            return f"{filename} failed on rank {rank}: {errors[-1][:400]}{at}"
    return f"{filename} failed: {str(err).splitlines()[0]}"
