"""Lab 8 (profiling and performance), instructor only: reference answers, the grader's
additions, mistakes, the notebook's sections.

Per exercise ``N``: ``references_exN.py`` (the reference answer), ``exN.py`` (``HIDDEN``,
``MISTAKES`` whose first entry is the sample class's, ``MORE_MISTAKES`` for the distributed
exercise 3, ``SOLUTION_CELL``) and ``exN_cells.py`` (the notebook section, ``CELLS``);
``notebook.py`` builds the solution notebook from them
(``python -m ddp_lab.answers.lab08.notebook``).

Not in the student kit (see :mod:`ddp_lab.answers`).
"""

from ddp_lab.answers.lab08 import ex1, ex2, ex3, ex4

HIDDEN = {**ex1.HIDDEN, **ex2.HIDDEN, **ex3.HIDDEN, **ex4.HIDDEN}
MISTAKES = [*ex1.MISTAKES, *ex2.MISTAKES, *ex3.MISTAKES, *ex4.MISTAKES]
MORE_MISTAKES = list(ex3.MORE_MISTAKES)

__all__ = ["HIDDEN", "MISTAKES", "MORE_MISTAKES"]
