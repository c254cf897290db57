"""The grader's self-test "lab" (``lab00_selftest``): checks and answers that
``tests/test_verdicts.py`` feeds with right, wrong, hanging, crashing and cheating student code.

The tests find it through ``DDP_LAB_EXTRA_CHECKS=selftest`` (``tests/conftest.py``), with
``tests/`` on ``PYTHONPATH``, so the grader's student and judge processes find it too.
"""
