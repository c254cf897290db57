"""Copy detection (ddp_lab.grading.integrity): a measure robust to renamed variables and
reformatting, and the class report of ``make autograde`` on the sample class."""

from __future__ import annotations

import pytest
from _harness import ROOT, solution_sources

from ddp_lab.grading import integrity as I
from ddp_lab.grading import sample_class

LABS = sample_class.labs()
RING = """
def ring(t, n):
    chunks = list(t.chunk(n))
    for step in range(n - 1):
        send = chunks[(step + 1) % n]
        recv = torch.empty_like(send)
        total = send + recv
    return total
"""


def test_renaming_and_reformatting_do_not_change_the_fingerprints():
    renamed = RING.replace("chunks", "pieces").replace("step", "s").replace("total", "acc")
    reformatted = "\n\n# mine\n" + renamed.replace("    ", "        ").replace(", ", ",")
    assert I.fingerprints(RING) == I.fingerprints(reformatted)
    assert I.similarity(I.fingerprints(RING), I.fingerprints(reformatted)) == 1.0


def test_a_different_program_is_not_similar():
    other = """
def average(grads):
    out = []
    for g in zip(*grads):
        out.append(torch.stack(g).mean(0))
    return out
"""
    assert I.similarity(I.fingerprints(RING), I.fingerprints(other), minimum=1) < 0.2


def test_api_names_and_constants_count_but_variable_names_do_not():
    a = I.normalized_tokens("x = dist.all_reduce(t, op=dist.ReduceOp.SUM)")
    assert a == I.normalized_tokens("y = dist.all_reduce(u, op=dist.ReduceOp.SUM)")
    assert a != I.normalized_tokens("y = dist.broadcast(u, op=dist.ReduceOp.SUM)")
    assert I.normalized_tokens("x = 2") != I.normalized_tokens("x = 3")


def test_the_given_scaffolding_does_not_count():
    stub = 'def f(a):\n    """Long docstring"""\n    raise NotImplementedError()'
    given = I.fingerprints(stub)
    assert I.without(I.fingerprints(stub), [given]) == set()


@pytest.mark.parametrize("lab", LABS)
def test_a_disguised_copy_runs_and_is_recognised(lab):
    for cell, source in solution_sources(lab).items():
        copy = sample_class.disguise(source)
        assert copy != source, f"{cell}: nothing was disguised"
        code = copy.split("\n", 1)[1] if copy.startswith("%%writefile") else copy
        compile(code, cell, "exec")  # still valid Python
        a, b = I.fingerprints(source), I.fingerprints(copy)
        assert I.similarity(a, b) == pytest.approx(1.0) or len(a) < I.MIN_FINGERPRINTS, cell


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    root = tmp_path_factory.mktemp("course")
    for part in ("labs", "solutions", "ddp_lab"):
        (root / part).symlink_to(ROOT / part)
    sample_class.write_class(root / "grading" / "submitted")
    rows = I.class_report(root)
    I.write_report(rows, root / "grading" / "integrity.csv")
    assert (root / "grading" / "integrity.csv").read_text().startswith(",".join(I.REPORT_FIELDS))
    return rows


@pytest.mark.parametrize("lab", LABS)
def test_the_copycat_and_the_classmate_are_flagged_as_a_pair(report, lab):
    copied = f"student:{sample_class.COPIED_FROM}"
    cat = [r for r in report if r["student"] == "copycat" and r["lab"] == lab]
    assert cat and any(r["flagged"] and copied in [r["closest"], *r["also"].split()] for r in cat)
    flagged = [r for r in cat if r["flagged"]]
    assert len(flagged) >= len(cat) - 1, f"only {len(flagged)} of {len(cat)} cells flagged"
    back = [r for r in report if r["student"] == sample_class.COPIED_FROM and r["lab"] == lab]
    assert any(
        r["flagged"] and "student:copycat" in [r["closest"], *r["also"].split()] for r in back
    )


@pytest.mark.parametrize("lab", LABS)
def test_independent_blank_and_mistake_students_are_not_flagged(report, lab):
    for student in ("blank", "mistake"):
        rows = [r for r in report if r["student"] == student and r["lab"] == lab]
        assert rows, f"{student} has no rows in {lab}"
        assert not [r for r in rows if r["flagged"]], rows
    assert all(float(r["score"]) == 0 for r in report if r["student"] == "blank")
