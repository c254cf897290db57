"""The nbgrader step that makes points depend on verdicts reached outside the kernel.

``nbgrader_config.py`` puts :class:`OutOfKernelVerdicts` right after nbgrader's
``Execute`` in ``Autograde.autograde_preprocessors``. For every autograded test cell it
judges the exercise with :func:`ddp_lab.grading.verdict.judge_notebook` (fresh processes,
fresh inputs, the solution cells' source from the submitted notebook) and rewrites the
cell's outputs:

- what the cell printed in the student's kernel is kept as plain text, marked "not
  graded" (so an in-kernel error, stderr line or return value no longer decides anything);
- the verdict follows: a stdout line when it passed, an ``error`` output when it failed,
  which nbgrader's ``SaveAutoGrades`` turns into zero points.

A test cell without an exercise in ``ddp_lab.checks`` fails: no points without a verdict.

:class:`ConfinedExecute` replaces nbgrader's ``Execute``: the same, except that the
student's kernel starts confined (:mod:`ddp_lab.grading.sandbox`).
"""

from __future__ import annotations

from jupyter_client.manager import AsyncKernelManager
from nbformat import NotebookNode
from nbgrader.preprocessors import Execute, NbGraderPreprocessor

from ddp_lab.grading import limits
from ddp_lab.grading.sandbox import confine

# ``nbgrader_config.py`` imports this module in every nbgrader command (generate_assignment,
# db, export, ...): what needs torch (the exercises, the notebook helpers, the verdicts) is
# imported where a notebook is judged, so that the other commands start without torch.


def _output_text(output: NotebookNode) -> str:
    kind = output.get("output_type")
    if kind == "stream":
        return output.get("text", "")
    if kind == "error":
        return f"{output.get('ename', 'Error')}: {output.get('evalue', '')}\n"
    if kind in ("execute_result", "display_data"):
        text = output.get("data", {}).get("text/plain", "")
        return ("".join(text) if isinstance(text, list) else text) + "\n"
    return ""


def rewrite_outputs(cell: NotebookNode, passed: bool, message: str) -> None:
    """Replace a test cell's outputs by its in-kernel text (not graded) and the verdict."""
    kernel_text = "".join(_output_text(o) for o in cell.get("outputs", [])).strip()
    outputs = []
    if kernel_text:
        outputs.append(
            NotebookNode(
                output_type="stream",
                name="stdout",
                text=("In your kernel (feedback only, not graded):\n" + kernel_text + "\n"),
            )
        )
    if passed:
        outputs.append(
            NotebookNode(
                output_type="stream",
                name="stdout",
                text=(f"Grader (outside your kernel, fresh inputs): PASSED - {message}\n"),
            )
        )
    else:
        outputs.append(
            NotebookNode(
                output_type="error",
                ename="VerdictFailed",
                evalue=message,
                traceback=[f"Grader (outside your kernel, fresh inputs): FAILED - {message}"],
            )
        )
    cell.outputs = outputs


class OutOfKernelVerdicts(NbGraderPreprocessor):
    """nbgrader preprocessor: every test cell's points come from an out-of-kernel verdict."""

    def preprocess(self, nb: NotebookNode, resources: dict):
        from ddp_lab.checks.contract import exercises
        from ddp_lab.grading.notebook import is_test, nbgrader_meta
        from ddp_lab.grading.verdict import judge_notebook

        lab = resources["nbgrader"]["notebook"]
        tests = [c for c in nb.cells if is_test(c)]
        try:
            table = exercises(lab)
        except KeyError:
            table = {}
        known = [
            nbgrader_meta(c)["grade_id"] for c in tests if nbgrader_meta(c)["grade_id"] in table
        ]
        verdicts = judge_notebook(nb, lab, known) if known else {}
        for cell in tests:
            gid = nbgrader_meta(cell)["grade_id"]
            if gid in verdicts:
                v = verdicts[gid]
                self.log.info("%s: %s", gid, "passed" if v.passed else "FAILED")
                rewrite_outputs(cell, v.passed, v.message)
            else:
                rewrite_outputs(cell, False, f"no out-of-kernel check is registered for {gid}")
        return nb, resources


class ConfinedKernelManager(AsyncKernelManager):
    """A kernel manager that starts the kernel through :func:`ddp_lab.grading.sandbox.confine`
    (the course read-only and its answers hidden, the notebook's own folder writable) and
    under the resource limits of :mod:`ddp_lab.grading.limits`."""

    def format_kernel_cmd(self, extra_arguments: list[str] | None = None) -> list[str]:
        cmd = super().format_kernel_cmd(extra_arguments)
        cwd = (self._launch_args or {}).get("cwd")
        # no GPU in the kernel either: the same notebook runs the same way on every host
        cmd = ["env", "CUDA_VISIBLE_DEVICES=", *cmd]
        return confine(limits.wrap(cmd), keep=[cwd] if cwd else [])


class ConfinedExecute(Execute):
    """nbgrader's ``Execute`` (configured as ``c.Execute``), with a confined kernel."""

    def __init__(self, *args, **kwargs):
        kwargs["kernel_manager_class"] = ConfinedKernelManager
        super().__init__(*args, **kwargs)
