"""Shared test set-up: one thread per process, gloo-friendly torchrun, runners for the CLI."""

from __future__ import annotations

import os
import signal
import warnings

# Set before torch is imported by any test: 2 cores, several processes per test.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
# The grader's self-test lab (tests/selftest), for this process and every child it starts.
_TESTS = os.path.dirname(os.path.abspath(__file__))
os.environ["DDP_LAB_EXTRA_CHECKS"] = "selftest"
os.environ["PYTHONPATH"] = os.pathsep.join(
    [_TESTS, *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)]
)

import pytest  # noqa: E402
from _harness import run_trainer  # noqa: E402


@pytest.fixture
def trainer(tmp_path):
    """Run ``ddp_lab.train`` (plain python for nproc=1, real torchrun otherwise) into tmp dirs.

    Returns a function ``trainer(name, args, nproc=1) -> (CompletedProcess, out_dir)``.
    """

    def run(name: str, args: list[str], nproc: int = 1, **kwargs):
        out = tmp_path / name
        proc = run_trainer([*args, "--out", str(out), "--no-progress"], nproc=nproc, **kwargs)
        return proc, out

    return run


_LAST_TEST = ["none (the first test of this worker)"]


@pytest.fixture(autouse=True)
def _sigint_as_python_sets_it(request):
    """Every test starts with Python's own SIGINT handler, as a fresh worker does: a test may
    press the stop button (``_harness.stop_button``), and an ignored, default or stray
    handler loses the press. A handler left by a test or a fixture before is put back, and
    named in a warning with the test that ran last."""
    found = signal.getsignal(signal.SIGINT)
    if found is not signal.default_int_handler and found is not None:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        warnings.warn(f"SIGINT's handler was {found!r} after {_LAST_TEST[0]}", stacklevel=1)
    yield
    _LAST_TEST[0] = request.node.nodeid


# `make test` runs the suite on 2 workers (pytest-xdist, --dist loadgroup
# --no-loadscope-reorder). A test file keeps its tests on one worker, in order (its module
# fixtures are built once); a lab's test files and its grader rounds in test_mistakes form one
# group; each lab's sample-class autograde is a group of its own. Tests that look for leftover
# processes look for their own tmp folder (_harness.own_tmpdir), never for a name that a test
# beside them may run.
#
# The groups are handed out in the order of the collection, the longest first, so that the
# last ones are short and both workers finish together: the tests below (a few minutes each)
# and the groups they pull forward, then the other groups by their weight (a slow test counts
# 30, any other 1). A worker takes its next group while it still has up to 2 tests to run, so
# long one-test groups at the end can queue up to three deep on one worker. In CI of a2740d0,
# xdist's default --loadscope-reorder (by number of tests) put all nine sample-class
# autogrades last and the workers ended 94 s apart; with this order (CI of 6b92e61) 11 s.
_FIRST = (
    "test_grading.py::test_autograde_scores_the_sample_class",
    "test_mistakes.py::test_mistakes_fail_their_own_exercises_in_the_grader",
    "test_student_kit.py::test_a_kit_from_a_fresh_clone",
    "test_student_kit.py::test_a_student_sees_one_readable_message",  # shares its install
    "test_grading_array.py::test_job_array",
)


def _group(item: pytest.Item) -> str:
    file = item.path.name
    callspec = getattr(item, "callspec", None)
    lab = callspec.params.get("lab") if callspec else None
    if file.startswith("test_lab"):
        return file.removeprefix("test_")[:5]  # test_lab03_parts.py -> lab03
    if file == "test_mistakes.py" and isinstance(lab, str):
        return lab[:5]
    if "test_autograde_scores_the_sample_class" in item.name:
        return f"autograde-{lab}"  # one course per lab (its own temporary folder)
    return file


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    groups = {item: _group(item) for item in items}
    first = {groups[i] for i in items if any(f in i.nodeid for f in _FIRST)}
    weight: dict[str, int] = {}
    for item in items:
        slow = item.get_closest_marker("slow") is not None
        weight[groups[item]] = weight.get(groups[item], 0) + (30 if slow else 1)
    for item in items:
        item.add_marker(pytest.mark.xdist_group(groups[item]))
    # stable: a group's tests keep their order
    items.sort(key=lambda i: (groups[i] not in first, -weight[groups[i]], groups[i]))
