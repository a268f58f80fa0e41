"""Several streams: how busy each one is, and how much the work on different streams overlaps.

A stream runs its work one item at a time, so a copy and a kernel that run at once are on
different streams: the copy/compute overlap is the time when both run, the copy hidden behind the
kernel. NCCL kernels are communication, not compute; the time they overlap compute kernels is
communication hidden the same way. Times are per analyzed step.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from fuselab.doctor.analyze import Analysis
from fuselab.doctor.trace import GpuEvent, is_communication

Intervals = list[tuple[float, float]]


@dataclass
class StreamRow:
    device: int
    stream: int
    busy_us: float  # per step
    share: float  # of the step
    kernels: float  # per step, communication kernels included
    copies: float  # memcpy and memset, per step
    communication_us: float  # in NCCL kernels, per step

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Streams:
    rows: list[StreamRow]  # busiest first
    copy_us: float  # time when some copy runs, per step
    copy_compute_overlap_us: float  # time when a copy and a compute kernel run at once
    communication_us: float  # time when some NCCL kernel runs
    communication_compute_overlap_us: float  # time when an NCCL kernel and a compute kernel run at once

    def to_dict(self) -> dict:
        return {"per_stream": [r.to_dict() for r in self.rows], "copy_us": self.copy_us,
                "copy_compute_overlap_us": self.copy_compute_overlap_us, "communication_us": self.communication_us,
                "communication_compute_overlap_us": self.communication_compute_overlap_us}


def union(events: list[GpuEvent]) -> Intervals:
    """The time covered by events given in start order, as disjoint intervals."""
    merged: Intervals = []
    for g in events:
        if merged and g.ts <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], g.end))
        else:
            merged.append((g.ts, g.end))
    return merged


def overlap_us(a: Intervals, b: Intervals) -> float:
    """The time two sets of disjoint, ordered intervals have in common."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _length(intervals: Intervals) -> float:
    return sum(t1 - t0 for t0, t1 in intervals)


def streams(a: Analysis, step_us: float) -> Streams:
    """Per-stream busy time and cross-stream overlap of the analyzed steps; `step_us` is the step the shares are of."""
    per_stream: dict[tuple[int, int], dict[str, float]] = {}
    totals = {"copy": 0.0, "copy_compute": 0.0, "communication": 0.0, "communication_compute": 0.0}
    for indices in a.step_events:
        events = [a.trace.gpu[i] for i in indices]  # in start order
        by_stream: dict[tuple[int, int], list[GpuEvent]] = {}
        for g in events:
            by_stream.setdefault((g.device, g.stream), []).append(g)
        for key, stream_events in by_stream.items():
            row = per_stream.setdefault(key, {"busy": 0.0, "kernels": 0, "copies": 0, "communication": 0.0})
            row["busy"] += _length(union(stream_events))
            row["kernels"] += sum(g.kind == "kernel" for g in stream_events)
            row["copies"] += sum(g.kind != "kernel" for g in stream_events)
            row["communication"] += sum(g.dur for g in stream_events if is_communication(g))
        compute = union([g for g in events if g.kind == "kernel" and not is_communication(g)])
        copies = union([g for g in events if g.kind == "memcpy"])
        communication = union([g for g in events if is_communication(g)])
        totals["copy"] += _length(copies)
        totals["copy_compute"] += overlap_us(copies, compute)
        totals["communication"] += _length(communication)
        totals["communication_compute"] += overlap_us(communication, compute)
    n = max(len(a.steps), 1)
    rows = [StreamRow(device, stream, v["busy"] / n, v["busy"] / n / step_us if step_us > 0 else 0.0,
                      v["kernels"] / n, v["copies"] / n, v["communication"] / n)
            for (device, stream), v in per_stream.items()]
    rows.sort(key=lambda r: -r.busy_us)
    return Streams(rows, totals["copy"] / n, totals["copy_compute"] / n, totals["communication"] / n,
                   totals["communication_compute"] / n)
