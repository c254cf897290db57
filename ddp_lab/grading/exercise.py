"""Transitional: the exercise contract moved to :mod:`ddp_lab.checks.contract`."""

from ddp_lab.checks.contract import Exercise, exercises, lab_module, lab_of_notebook

__all__ = ["Exercise", "exercises", "lab_module", "lab_of_notebook"]
