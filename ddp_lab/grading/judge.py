"""The judge process: compare a student's saved outputs with the reference, print verdicts.

``python -m ddp_lab.grading.judge SPEC.json`` never imports or runs student code. It loads
each exercise's inputs (checking their SHA-256 against the grader's, so a student process
cannot swap them) and outputs with ``torch.load(weights_only=True)`` (which refuses
pickled code), calls the exercise's ``judge``, and prints one JSON object:
``{grade_id: {"passed": bool, "message": str}}``.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch

from ddp_lab.checks import CheckFailed
from ddp_lab.grading.exercise import exercises


def sha256(path: str | Path) -> str:
    """Hex SHA-256 of a file."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def package_digest() -> str:
    """SHA-256 over the source files of ``ddp_lab``: the grader's code must not change."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def judge_one(lab: str, item: dict) -> dict:
    """Verdict for one exercise: ``{"passed", "message"}``."""
    ex = exercises(lab)[item["grade_id"]]
    if sha256(item["inputs"]) != item["inputs_sha256"]:
        return {"passed": False, "message": "the grader's inputs were modified during the run"}
    try:
        inputs = torch.load(item["inputs"], weights_only=True)
        outputs = torch.load(item["outputs"], weights_only=True)
    except Exception as err:  # noqa: BLE001 - unreadable or forged outputs fail the check
        return {"passed": False, "message": f"the outputs could not be read ({err})"[:500]}
    try:
        return {"passed": True, "message": ex.judge(inputs, outputs)}
    except CheckFailed as err:
        return {"passed": False, "message": str(err)}
    except Exception as err:  # noqa: BLE001 - malformed outputs (wrong type or shape)
        return {"passed": False,
                "message": f"unexpected result ({type(err).__name__}: {err})"[:500]}


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    if package_digest() != spec["package_digest"]:
        verdicts = {item["grade_id"]: {"passed": False, "message":
                    "ddp_lab's files changed while grading: the grader was tampered with"}
                    for item in spec["items"]}
    else:
        verdicts = {item["grade_id"]: judge_one(spec["lab"], item) for item in spec["items"]}
    print(json.dumps(verdicts))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
