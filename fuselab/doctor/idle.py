"""The GPU's own timeline: each step's window on it, and why the GPU idled inside that window.

A host that runs ahead (no sync at step ends, as with torch.profiler's own `prof.step()`) queues a
step's kernels long before the GPU reaches them, while the GPU is still busy with earlier steps.
So a step's window on the GPU starts where the GPU was free for it: at the step's host start, or
later, when work queued before it (earlier steps, or work outside any step) was still running; it
ends at the later of its host end and its last GPU work. Idle time is where no GPU work at all ran
(any step's, any stream's), so another step's work in the window is never idle.

Each idle gap is split by cause:
- sync: a host-blocking call returned during the gap (the queue had been drained and the host was
  waiting), or the gap precedes the copy a sync is waiting for;
- launch: the GPU waited for the host to launch the work that ends the gap: that launch call was
  still in progress when the GPU went idle. Only the part of the gap until the call returned (plus
  LAUNCH_LATENCY_US for the work to reach the GPU) is the host's; a launch made long before the work
  started says the GPU waited for something else;
- other: the next work had been queued before the gap began (stream dependencies, the GPU's own
  scheduling between back-to-back kernels), or it belongs to a CUDA graph replay already begun: the
  replay's kernels were all queued by its one graph launch;
- profiler: the profiler itself held the host up (its "overhead" events), not the workload.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from fuselab.doctor.syncs import Sync
from fuselab.doctor.trace import GpuEvent, RuntimeCall, Span, Trace

Gap = tuple[float, float, str]  # (start, end, "launch" | "sync" | "other" | "profiler")
# From a launch call's return to its kernel starting on an idle GPU: under 5 us on an H200 with the
# profiler on; four times that is still the host's.
LAUNCH_LATENCY_US = 20.0


@dataclass
class Timeline:
    """All GPU events of a trace (sorted by start) as one timeline, with what the gap rules need of each."""

    events: list[GpuEvent]
    starts: list[float]
    ended_before: list[float]  # [i]: the latest end among events[:i]; one longer than events
    replay_begun: list[bool]  # [i]: replayed from a graph whose replay had already started

    @classmethod
    def of(cls, trace: Trace, replayed: list[bool]) -> Timeline:
        ended_before, latest = [], float("-inf")
        begun, seen = [], set()
        for g, from_graph in zip(trace.gpu, replayed):
            ended_before.append(latest)
            latest = max(latest, g.end)
            begun.append(from_graph and g.correlation in seen)
            if from_graph:
                seen.add(g.correlation)
        ended_before.append(latest)
        return cls(trace.gpu, [g.ts for g in trace.gpu], ended_before, begun)

    def window(self, host_start: float, host_end: float, own: list[int]) -> tuple[float, float]:
        """A step's window on the GPU, given its host span and its own events (indices in start order)."""
        if not own:
            return host_start, host_end
        first = self.events[own[0]].ts
        # Every event before the step's first one is another's: the GPU was free for this step once they ended.
        start = max(host_start, min(self.ended_before[own[0]], first))
        return start, max([host_end] + [self.events[i].end for i in own])

    def idle_intervals(self, start: float, end: float) -> list[tuple[float, float, int | None]]:
        """Where no GPU work ran in [start, end]: (from, to, the index of the event that ends it, None for the tail)."""
        i = bisect.bisect_left(self.starts, start)
        cursor = max(start, self.ended_before[i])
        out = []
        while i < len(self.events) and self.starts[i] < end:
            g = self.events[i]
            if g.ts > cursor:
                out.append((cursor, g.ts, i))
            cursor = max(cursor, g.end)
            i += 1
        if end > cursor:
            out.append((cursor, end, None))
        return out


def split_off_overhead(g0: float, g1: float, overhead: list[Span]) -> list[tuple[float, float, bool]]:
    """The pieces of [g0, g1], each flagged True where the profiler's own overhead covers it."""
    pieces, cursor = [], g0
    for o in overhead:
        lo, hi = max(o.ts, cursor), min(o.end, g1)
        if hi <= lo:
            continue
        if lo > cursor:
            pieces.append((cursor, lo, False))
        pieces.append((lo, hi, True))
        cursor = hi
    if g1 > cursor:
        pieces.append((cursor, g1, False))
    return pieces


def _causes(timeline: Timeline, g0: float, g1: float, next_index: int | None, call_of: dict[int, RuntimeCall],
            sync_ends: list[float], sync_copies: set[int]) -> list[tuple[float, float, str]]:
    """[g0, g1] cut into pieces by cause (see the module docstring)."""
    pos = bisect.bisect_left(sync_ends, g0)
    if (pos < len(sync_ends) and sync_ends[pos] <= g1) or next_index in sync_copies:
        return [(g0, g1, "sync")]
    if next_index is None:
        return [(g0, g1, "launch")]  # nothing left to run: the GPU waits for whatever the host does next
    if timeline.replay_begun[next_index]:
        # Inside a replay the GPU runs the graph's own schedule; the launch call (which the
        # profiler can keep in progress for the whole replay) is not what it waits for.
        return [(g0, g1, "other")]
    call = call_of.get(timeline.events[next_index].correlation)
    if call is None:
        return [(g0, g1, "launch")]  # no launch recorded: counted as the host's, the cautious side
    if call.end < g0:
        return [(g0, g1, "other")]
    waited = min(g1, call.end + LAUNCH_LATENCY_US)
    return [(g0, waited, "launch")] + ([(waited, g1, "other")] if g1 > waited else [])


def step_gaps(trace: Trace, timeline: Timeline, start: float, end: float, call_of: dict[int, RuntimeCall],
              syncs: list[Sync], sync_copies: set[int], replayed: list[bool]) -> tuple[list[Gap], float]:
    """The idle gaps in a step's window by cause, the profiler's overhead split off, and the us of launch
    gaps spent waiting for a graph replay to be launched."""
    sync_ends = sorted(s.end for s in syncs)
    gaps: list[Gap] = []
    graph_launch_gap = 0.0
    for g0, g1, next_index in timeline.idle_intervals(start, end):
        next_replayed = next_index is not None and replayed[next_index]
        for c0, c1, kind in _causes(timeline, g0, g1, next_index, call_of, sync_ends, sync_copies):
            for p0, p1, by_profiler in split_off_overhead(c0, c1, trace.profiler_overhead):
                gaps.append((p0, p1, "profiler" if by_profiler else kind))
                if kind == "launch" and next_replayed and not by_profiler:
                    graph_launch_gap += p1 - p0
    return gaps, graph_launch_gap


def busy_by_kind(timeline: Timeline, start: float, end: float, kind_of: list[str]) -> dict[str, float]:
    """GPU time in [start, end] per kind of work (kind_of[i] for event i), clipped to the window.

    Overlapping work (several streams) is counted per event, so the sums can exceed the busy time;
    callers scale them to it.
    """
    out: dict[str, float] = {}
    i = bisect.bisect_left(timeline.starts, start)
    # Events that began before the window may still run into it; ended_before bounds how far back to look.
    j = i
    while j > 0 and timeline.ended_before[j] > start:
        j -= 1
    for k in range(j, len(timeline.events)):
        g = timeline.events[k]
        if g.ts >= end:
            break
        overlap = min(g.end, end) - max(g.ts, start)
        if overlap > 0:
            out[kind_of[k]] = out.get(kind_of[k], 0.0) + overlap
    return out
