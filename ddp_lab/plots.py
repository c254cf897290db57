"""Transitional: the scaling figure moved to :mod:`ddp_lab.figures.scaling`."""

from ddp_lab.figures.scaling import plot_scaling

__all__ = ["plot_scaling"]
