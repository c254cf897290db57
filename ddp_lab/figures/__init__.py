"""Figures of the labs, one module per lab (``ddp_lab.figures.lab01`` ...).

Each function draws one concept (a collective, a ring step, a cost model) with matplotlib
and returns the Figure; notebooks call them so that cells stay short.
"""
