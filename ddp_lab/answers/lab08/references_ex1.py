"""Lab 8's reference answer to exercise 1 (instructor only): a profiled step's compute, its
communication, and the part of the communication the computation does not hide.

Intervals are merged (sorted, then joined where they touch); the kit's oracle instead
rasterises them (``ddp_lab.checks.lab08.ex1_step_breakdown.oracle``)."""

from __future__ import annotations

COLLECTIVES = ("gloo:", "nccl:", "ncclDevKernel", "ncclKernel")


def step_breakdown(events):
    """Per ProfilerStep#k range of one rank's trace: compute, communication, exposed (ms)."""

    def merged(spans):  # disjoint intervals covering the same time, in order
        out = []
        for start, end in sorted(s for s in spans if s[1] > s[0]):
            if out and start <= out[-1][1]:
                out[-1][1] = max(out[-1][1], end)
            else:
                out.append([start, end])
        return out

    def length(spans):
        return sum(end - start for start, end in spans)

    marks = [e for e in events if e["name"].startswith("ProfilerStep#")]
    rows = []
    for mark in sorted(marks, key=lambda e: e["ts"]):
        t0, t1 = mark["ts"], mark["ts"] + mark["dur"]
        ops, comms = [], []
        for e in events:
            span = (max(e["ts"], t0), min(e["ts"] + e["dur"], t1))  # clipped to the step
            if e.get("cat") == "cpu_op" and e["tid"] == mark["tid"]:
                ops.append(span)
            elif e["name"].startswith(COLLECTIVES):
                comms.append(span)
        compute, comm = merged(ops), merged(comms)
        both = merged(compute + comm)
        rows.append(
            {
                "step": int(mark["name"].split("#", 1)[1]),
                "step_ms": mark["dur"] / 1e3,
                "compute_ms": length(compute) / 1e3,
                "comm_ms": length(comm) / 1e3,
                # the time the collectives add to the operators: comm under no operator
                "exposed_ms": (length(both) - length(compute)) / 1e3,
            }
        )
    return rows
