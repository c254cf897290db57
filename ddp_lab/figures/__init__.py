"""Figures of the labs, one module per lab (``ddp_lab.figures.lab01`` ...).

Each function draws one concept (a collective, a ring step, a cost model) with matplotlib
and returns the Figure; notebooks call them so that cells stay short. The shared colours
and drawing helpers are in :mod:`ddp_lab.figures.style`.
"""

import os

import matplotlib

# Before any lab module imports pyplot: without a display (a grader, CI) draw off-screen.
if not os.environ.get("DISPLAY") and "inline" not in matplotlib.get_backend().lower():
    matplotlib.use("Agg")
