"""The judge process: compare a student's saved outputs with the reference, print verdicts.

``python -m ddp_lab.grading.judge SPEC.json`` never imports or runs student code. It loads
each exercise's inputs and outputs, checking their SHA-256 against the grader's (taken
before the student's code ran and when it finished, so no student process can swap them),
with ``torch.load(weights_only=True)`` (which refuses pickled code), calls the exercise's
judge, and prints one JSON object: ``{grade_id: {"passed": bool, "message": str}}``. The
judge is the exercise's own (an independent oracle, as in the notebook's visible check)
followed by the instructor's exact comparisons (``ddp_lab.answers``). It refuses to judge
when a ``ddp_lab`` file it ran differs from the hashes the grader took before any student
code ran.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch

from ddp_lab.checks.contract import exercises
from ddp_lab.checks.failure import CheckFailed


def sha256(path: str | Path) -> str:
    """Hex SHA-256 of a file."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


PACKAGE_ROOT = Path(__file__).resolve().parent.parent


def package_hashes() -> dict[str, str]:
    """``relative path -> SHA-256`` of every source file of ``ddp_lab``."""
    return {str(p.relative_to(PACKAGE_ROOT)): sha256(p) for p in sorted(PACKAGE_ROOT.rglob("*.py"))}


def changed_modules(hashes: dict[str, str]) -> list[str]:
    """The ``ddp_lab`` files loaded in this process whose content differs from ``hashes``.

    The judge checks the code it actually ran (the lab's checks module and what that
    imports) against the hashes the grader took before any student code ran.
    """
    changed = []
    for mod in list(sys.modules.values()):
        path = getattr(mod, "__file__", None)
        if not path or not Path(path).resolve().is_relative_to(PACKAGE_ROOT):
            continue
        rel = str(Path(path).resolve().relative_to(PACKAGE_ROOT))
        if hashes.get(rel) != sha256(path):
            changed.append(rel)
    return sorted(changed)


def judge_one(lab: str, item: dict) -> dict:
    """Verdict for one exercise: ``{"passed", "message"}``."""
    from ddp_lab.answers import full_judge, hidden  # not imported by a confined kernel

    ex = exercises(lab)[item["grade_id"]]
    judge = full_judge(ex, hidden(lab).get(ex.grade_id))
    if sha256(item["inputs"]) != item["inputs_sha256"]:
        return {"passed": False, "message": "the grader's inputs were modified during the run"}
    if sha256(item["outputs"]) != item["outputs_sha256"]:
        return {"passed": False, "message": "the outputs were modified after your code finished"}
    try:
        inputs = torch.load(item["inputs"], weights_only=True)
        if "sealed" in item:  # the answer known by construction, kept from the student
            if sha256(item["sealed"]) != item["sealed_sha256"]:
                return {"passed": False, "message": "the grader's inputs were modified"}
            inputs.update(torch.load(item["sealed"], weights_only=True))
        outputs = torch.load(item["outputs"], weights_only=True)
    except Exception as err:  # noqa: BLE001 - unreadable or forged outputs fail the check
        return {"passed": False, "message": f"the outputs could not be read ({err})"[:500]}
    try:
        return {"passed": True, "message": judge(inputs, outputs)}
    except CheckFailed as err:
        return {"passed": False, "message": str(err)}
    except Exception as err:  # noqa: BLE001 - malformed outputs (wrong type or shape)
        return {
            "passed": False,
            "message": f"unexpected result ({type(err).__name__}: {err})"[:500],
        }


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    verdicts = {item["grade_id"]: judge_one(spec["lab"], item) for item in spec["items"]}
    changed = changed_modules(spec["package_hashes"])  # after judging: all imports are done
    if changed:
        verdicts = {
            gid: {
                "passed": False,
                "message": "the grader's code changed while "
                f"grading ({', '.join(changed)}): refusing to judge",
            }
            for gid in verdicts
        }
    print(json.dumps(verdicts))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
