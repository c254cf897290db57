"""What lab 8's exercises share: the lab's name and the names a profiled trace uses.

None of this is an answer to an exercise: the names are those of the trainer's
``--profile`` ranges (:mod:`ddp_lab.profiling`) and of the backends' collective events.
"""

from __future__ import annotations

from ddp_lab.profiling import COLLECTIVE_PREFIXES, PHASES, PREFIX

LAB = "lab08_profiling"

__all__ = ["COLLECTIVE_PREFIXES", "LAB", "PHASES", "PREFIX"]
