"""The trainer's ``--profile`` traces drawn: one step per rank as a timeline.

Per rank two lanes: the training thread's phases (``ddp_lab: data / forward / backward /
optimizer`` ranges, in colour; white is time the thread spent outside them) and the
backend's collectives (``gloo:all_reduce`` and the like on CPU, NCCL kernels on CUDA, in
dark grey), so that the overlap of communication with the backward pass, and what is left exposed
after it, can be seen. Times are relative to the start of the step on each rank.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from ddp_lab.figures.style import COLORS
from ddp_lab.profiling import COLLECTIVE_PREFIXES, PHASES, PREFIX

__all__ = ["COLLECTIVE_PREFIXES", "load_events", "step_marks", "step_timeline"]


def load_events(path: str | Path) -> list[dict]:
    """The complete events (``"ph": "X"``) of a Chrome trace, times in microseconds."""
    with open(path) as f:
        trace = json.load(f)
    return [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]


def step_marks(events: list[dict]) -> list[dict]:
    """The profiler's ``ProfilerStep#k`` ranges of a trace, one per recorded step, in time
    order."""
    return sorted(
        (e for e in events if e["name"].startswith("ProfilerStep#")), key=lambda e: e["ts"]
    )


def _step(events: list[dict], step: int | None) -> tuple[float, float]:
    marks = step_marks(events)
    if not marks:
        raise ValueError("no ProfilerStep in the trace: was it written by --profile?")
    mark = marks[-1] if step is None else marks[step]
    return mark["ts"], mark["ts"] + mark["dur"]


def step_timeline(paths: Sequence[str | Path], step: int | None = None, title: str = "") -> Figure:
    """One recorded step of every rank's trace (``paths`` in rank order; ``step``: the
    index among the recorded steps, default the last)."""
    fig, ax = plt.subplots(figsize=(11, 0.6 + 1.1 * len(paths)))
    colors = dict(zip(PHASES, COLORS, strict=False))
    longest = 0.0
    for rank, path in enumerate(paths):
        events = load_events(path)
        t0, t1 = _step(events, step)
        longest = max(longest, (t1 - t0) / 1e3)
        y = 2 * (len(paths) - 1 - rank)
        for e in events:
            if not (t0 <= e["ts"] < t1):
                continue
            start, width = (e["ts"] - t0) / 1e3, e["dur"] / 1e3
            name = e["name"]
            if name.startswith(PREFIX) and name[len(PREFIX) :] in colors:
                phase = name[len(PREFIX) :]
                ax.barh(y + 0.5, width, left=start, height=0.8, color=colors[phase], label=phase)
            elif name.startswith(COLLECTIVE_PREFIXES):
                ax.barh(y - 0.5, width, left=start, height=0.8, color="0.2", label="collective")
        where = ax.get_yaxis_transform()
        ax.text(-0.01, y, f"rank {rank}", ha="right", va="center", transform=where)
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))
    ax.legend(
        unique.values(),
        unique.keys(),
        loc="lower right",
        bbox_to_anchor=(1, 1.0),
        fontsize=8,
        ncol=5,
        frameon=False,
    )
    ax.set_xlim(0, longest * 1.02 or 1)
    ax.set_yticks([])
    ax.set_xlabel("ms since the step began (upper lane: training thread, lower: collectives)")
    ax.set_title(title or "one profiled step per rank", loc="left")
    fig.tight_layout()
    plt.close(fig)
    return fig
