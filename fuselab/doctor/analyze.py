"""Read a trace step by step: how busy the GPU was, why it idled, how fast the host launched, what synced.

A step is a "ProfilerStep#N" range on the host (the whole trace when there is none). GPU work
belongs to the step in which the host queued it. The step lasts from its host start to whichever
ends later, the workload's host work or its last GPU work; the workload's host work ends where the
doctor's step-boundary wait begins, since what that wait costs once the GPU is done (closing the
ranges) is the profiler's. Idle time during which the profiler itself held the host up (its
"overhead" events) is left out of the step too. Every other microsecond is either GPU busy time
(split into compute- and memory-bound kernel time by the roofline) or an idle gap, split by cause:

- sync stall: a host-blocking call returned during the gap (the queue had been drained and the
  host was waiting), or the gap precedes the copy a sync is waiting for;
- launch gap: the GPU waited for the host: the call that launched the next kernel was still
  being made when the GPU went idle;
- other idle: the next kernel had been queued before the gap began (stream dependencies, the
  GPU's own scheduling between back-to-back kernels), or it belongs to a CUDA graph replay that
  had already begun: the replay's kernels were all queued by its one graph launch.

Kernels replayed from a CUDA graph have no launch of their own, so launch delays are measured on
individually launched work only, and the sequences offered for fusion are made of it alone.
"""

from __future__ import annotations

import bisect
import os
import statistics
from dataclasses import asdict, dataclass, field
from typing import Callable

from fuselab.device import Ceilings, ceilings as measured_ceilings
from fuselab.doctor.fusion import FusionCandidate, fusion_candidates, kernel_label
from fuselab.doctor.roofline import KernelCost, kernel_costs
from fuselab.doctor.syncs import STEP_BOUNDARY, Sync, find_syncs
from fuselab.doctor.trace import CpuOp, GpuEvent, RuntimeCall, Span, Trace, load_trace

Gap = tuple[float, float, str]  # (start, end, "launch" | "sync" | "other" | "profiler")


@dataclass
class StepStats:
    name: str
    start: float
    end: float
    host_us: float  # the workload's host time, up to the step-boundary wait, less profiler overhead
    wall_us: float  # host start to the later of host end and GPU end, less profiler overhead
    profiler_us: float  # GPU idle time left out because the profiler held up the host
    gpu_busy_us: float
    gpu_busy_pct: float
    kernels: int
    copies: int  # memcpy and memset on the GPU
    median_kernel_us: float
    compute_us: float  # busy time in compute-bound kernels
    memory_us: float  # busy time in memory-bound kernels and copies
    launch_gap_us: float
    graph_launch_gap_us: float  # the part of launch_gap_us spent waiting for a graph replay to be launched
    sync_stall_us: float
    other_idle_us: float
    launches: int
    launches_per_s: float
    launch_delay_us: dict[str, float]  # over individually launched work
    median_launched_kernel_us: float  # over kernels launched one by one, not replayed from a graph
    graph_launches: int
    graph_kernels: int  # kernels replayed by those graph launches
    syncs: int
    sync_blocked_us: float

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Analysis:
    trace: Trace
    ceilings: Ceilings
    steps: list[StepStats]
    step_events: list[list[int]]  # per step, indices into trace.gpu, in start order
    syncs: list[list[Sync]]  # per step
    gaps: list[list[Gap]]  # per step
    costs: list[KernelCost]  # aligned with trace.gpu
    replayed: list[bool]  # aligned with trace.gpu: replayed from a CUDA graph
    fusion: list[FusionCandidate] = field(default_factory=list)


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]


def _whole_trace_step(trace: Trace) -> Span:
    starts = [g.ts for g in trace.gpu] + [r.ts for r in trace.runtime] + [o.ts for o in trace.cpu_ops]
    ends = [g.end for g in trace.gpu] + [r.end for r in trace.runtime] + [o.end for o in trace.cpu_ops]
    return Span("whole trace", min(starts), max(ends) - min(starts), 0)


def _workload_host_end(trace: Trace, step: Span) -> float:
    """Where the doctor's step-boundary wait inside the step begins; the step's end when it has none."""
    for a in trace.annotations:
        if a.name == STEP_BOUNDARY and a.tid == step.tid and step.ts <= a.ts <= step.end:
            return a.ts
    return step.end


def _split_off_overhead(g0: float, g1: float, overhead: list[Span]) -> list[tuple[float, float, bool]]:
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


def _assign_to_steps(trace: Trace, steps: list[Span], call_of: dict[int, RuntimeCall]) -> list[list[int]]:
    starts = [s.ts for s in steps]
    members: list[list[int]] = [[] for _ in steps]
    for i, g in enumerate(trace.gpu):
        call = call_of.get(g.correlation)
        t = call.ts if call is not None else g.ts
        pos = bisect.bisect_right(starts, t) - 1
        if pos >= 0 and t <= steps[pos].end:
            members[pos].append(i)
    return members


def _launching_ops(trace: Trace, call_of: dict[int, RuntimeCall]) -> dict[int, CpuOp | None]:
    """The CPU op that launched each GPU event, by the event's index."""
    op_of: dict[int, CpuOp | None] = {}
    for i, g in enumerate(trace.gpu):
        call = call_of.get(g.correlation)
        op_of[i] = trace.op_for(g.external_id or (call.external_id if call else None))
    return op_of


def _syncs_per_step(syncs: list[Sync], steps: list[Span]) -> list[list[Sync]]:
    """The syncs (in time order) that start within each step."""
    starts = [s.ts for s in syncs]
    return [syncs[bisect.bisect_left(starts, step.ts):bisect.bisect_right(starts, step.end)] for step in steps]


def _graph_replayed(trace: Trace, call_of: dict[int, RuntimeCall]) -> list[bool]:
    """Which GPU events a graph launch queued: linked to a cudaGraphLaunch call, or marked as a graph node."""
    out = []
    for g in trace.gpu:
        call = call_of.get(g.correlation)
        out.append(g.graph_node is not None or (call is not None and call.launches_graph))
    return out


def _idle_intervals(
    indices: list[int], events: list[GpuEvent], replayed: list[bool], start: float, end: float,
) -> list[tuple[float, float, int | None, bool]]:
    """The GPU's idle intervals in [start, end]: (from, to, the index of the GPU event that ends the
    interval or None for the tail, whether that event's graph replay had already begun)."""
    intervals = []
    cursor = start
    replays_begun: set[int | None] = set()  # correlation ids of the graph launches whose kernels have started
    for i, g in zip(indices, events):
        if g.ts > cursor:
            intervals.append((cursor, g.ts, i, replayed[i] and g.correlation in replays_begun))
        if replayed[i]:
            replays_begun.add(g.correlation)
        cursor = max(cursor, g.end)
    if end > cursor:
        intervals.append((cursor, end, None, False))
    return intervals


def _gap_kind(trace: Trace, g0: float, g1: float, next_index: int | None, replay_begun: bool,
              call_of: dict[int, RuntimeCall], sync_ends: list[float], sync_copies: set[int]) -> str:
    """Why the GPU idled over [g0, g1] before the event at next_index: "sync", "launch" or "other"."""
    pos = bisect.bisect_left(sync_ends, g0)
    if (pos < len(sync_ends) and sync_ends[pos] <= g1) or next_index in sync_copies:
        return "sync"
    if replay_begun:
        # Inside a replay the GPU runs the graph's own schedule; the launch call (which the
        # profiler can keep in progress for the whole replay) is not what it waits for.
        return "other"
    call = call_of.get(trace.gpu[next_index].correlation) if next_index is not None else None
    # The GPU waited for the host when the launch was still in progress as it went idle; a
    # kernel with no recorded launch (or a tail with nothing left to run) counts the same way.
    return "launch" if call is None or call.end >= g0 else "other"


def _step_gaps(trace: Trace, indices: list[int], events: list[GpuEvent], start: float, end: float, call_of: dict[int, RuntimeCall],
               replayed: list[bool], syncs: list[Sync], sync_copies: set[int]) -> tuple[list[Gap], float]:
    """The step's idle gaps by cause, the profiler's own overhead split off, and the us of launch gaps
    spent waiting for a graph replay to be launched."""
    sync_ends = sorted(s.end for s in syncs)
    gaps: list[Gap] = []
    graph_launch_gap = 0.0
    for g0, g1, next_index, replay_begun in _idle_intervals(indices, events, replayed, start, end):
        kind = _gap_kind(trace, g0, g1, next_index, replay_begun, call_of, sync_ends, sync_copies)
        next_replayed = next_index is not None and replayed[next_index]
        for p0, p1, by_profiler in _split_off_overhead(g0, g1, trace.profiler_overhead):
            gaps.append((p0, p1, "profiler" if by_profiler else kind))
            if kind == "launch" and next_replayed and not by_profiler:
                graph_launch_gap += p1 - p0
    return gaps, graph_launch_gap


def _busy_us(events: list[GpuEvent], start: float) -> float:
    """GPU busy time from start on, time when streams overlap counted once."""
    busy = 0.0
    cursor = start
    for g in events:
        busy += max(0.0, g.end - max(g.ts, cursor))
        cursor = max(cursor, g.end)
    return busy


def _bound_split(indices: list[int], costs: list[KernelCost], busy: float) -> tuple[float, float]:
    """Busy time in compute- and in memory-bound kernels, scaled to the busy time (streams may overlap)."""
    by_bound = {"compute": 0.0, "memory": 0.0}
    for i in indices:
        by_bound[costs[i].bound] += costs[i].dur_us
    scale = busy / sum(by_bound.values()) if sum(by_bound.values()) > 0 else 0.0
    return by_bound["compute"] * scale, by_bound["memory"] * scale


def _step_stats(
    trace: Trace, step: Span, indices: list[int], call_of: dict[int, RuntimeCall], costs: list[KernelCost],
    replayed: list[bool], syncs: list[Sync], sync_copies: set[int],
) -> tuple[StepStats, list[Gap]]:
    """The statistics of one step, and its idle gaps by cause."""
    events = [trace.gpu[i] for i in indices]
    host_end = _workload_host_end(trace, step)
    host_stalled = _split_off_overhead(step.ts, host_end, trace.profiler_overhead)
    host_us = host_end - step.ts - sum(p1 - p0 for p0, p1, by_profiler in host_stalled if by_profiler)
    end = max([host_end] + [g.end for g in events])
    gaps, graph_launch_gap = _step_gaps(trace, indices, events, step.ts, end, call_of, replayed, syncs, sync_copies)
    idle = {"launch": 0.0, "sync": 0.0, "other": 0.0, "profiler": 0.0}
    for g0, g1, kind in gaps:
        idle[kind] += g1 - g0
    busy = _busy_us(events, step.ts)
    compute_us, memory_us = _bound_split(indices, costs, busy)

    kernel_durs = [g.dur for g in events if g.kind == "kernel"]
    launched = [not replayed[i] for i in indices]
    launched_kernel_durs = [g.dur for g, own in zip(events, launched) if own and g.kind == "kernel"]
    # A replayed kernel's delay from the graph launch is its place in the graph, not launch latency.
    delays = [g.ts - call_of[g.correlation].ts for g, own in zip(events, launched) if own and g.correlation in call_of]
    launches = len({g.correlation for g in events if g.correlation in call_of})  # a graph launch counts once
    graph_launches = len({g.correlation for g, own in zip(events, launched) if not own})
    wall = end - step.ts - idle["profiler"]
    stats = StepStats(
        name=step.name, start=step.ts, end=end, host_us=host_us, wall_us=wall, profiler_us=idle["profiler"], gpu_busy_us=busy,
        gpu_busy_pct=100 * busy / wall if wall > 0 else 0.0, kernels=len(kernel_durs), copies=len(events) - len(kernel_durs),
        median_kernel_us=statistics.median(kernel_durs) if kernel_durs else 0.0,
        compute_us=compute_us, memory_us=memory_us,
        launch_gap_us=idle["launch"], graph_launch_gap_us=graph_launch_gap, sync_stall_us=idle["sync"], other_idle_us=idle["other"],
        launches=launches, launches_per_s=launches / host_us * 1e6 if host_us > 0 else 0.0,
        launch_delay_us={
            "median": statistics.median(delays) if delays else 0.0,
            "p90": _quantile(delays, 0.9) if delays else 0.0,
            "max": max(delays) if delays else 0.0,
        },
        median_launched_kernel_us=statistics.median(launched_kernel_durs) if launched_kernel_durs else 0.0,
        graph_launches=graph_launches, graph_kernels=len(kernel_durs) - len(launched_kernel_durs),
        syncs=len(syncs), sync_blocked_us=sum(s.blocked_us for s in syncs),
    )
    return stats, gaps


def analyze(
    trace: Trace,
    ceilings: Ceilings,
    skip_steps: int = 0,
    on_stage: Callable[[str], None] | None = None,
) -> Analysis:
    """Per-step statistics, syncs, roofline and fusion candidates of a loaded trace."""
    if not isinstance(skip_steps, int) or skip_steps < 0:
        raise ValueError(f"skip_steps must be an int >= 0, got {skip_steps!r}")
    if not trace.gpu:
        raise ValueError(
            f"{trace.path}: the trace has no GPU events (kernels, copies): it was recorded without CUDA activity "
            "or on a machine without a GPU, so there is nothing to diagnose on the device side"
        )
    report = on_stage or (lambda stage: None)
    steps = trace.steps or [_whole_trace_step(trace)]
    if skip_steps and len(steps) > skip_steps:
        steps = steps[skip_steps:]
    call_of = {r.correlation: r for r in trace.runtime if r.correlation is not None}

    report("roofline")
    op_of = _launching_ops(trace, call_of)
    costs = kernel_costs(trace.gpu, op_of, ceilings)
    replayed = _graph_replayed(trace, call_of)

    report("syncs")
    all_syncs = find_syncs(trace)
    # Copies launched by a blocking call: the gap before them is part of that sync's round trip.
    sync_corr = {c for s in all_syncs for c in s.correlations}
    sync_copies = {i for i, g in enumerate(trace.gpu) if g.kind == "memcpy" and g.correlation in sync_corr}

    report("steps")
    members = _assign_to_steps(trace, steps, call_of)
    per_step_syncs = _syncs_per_step(all_syncs, steps)
    per_step = [
        _step_stats(trace, step, idx, call_of, costs, replayed, step_syncs, sync_copies)
        for step, idx, step_syncs in zip(steps, members, per_step_syncs)
    ]
    stats = [step_stats for step_stats, _ in per_step]
    gaps = [step_gaps for _, step_gaps in per_step]

    report("fusion candidates")
    labels = [kernel_label(g, op_of[i]) for i, g in enumerate(trace.gpu)]
    fusion = fusion_candidates(members, trace.gpu, labels, replayed)
    return Analysis(trace, ceilings, stats, members, per_step_syncs, gaps, costs, replayed, fusion)


def analyze_file(
    path: str | os.PathLike,
    probe: str | os.PathLike | None = None,
    ceilings: Ceilings | None = None,
    skip_steps: int = 0,
    on_stage: Callable[[str], None] | None = None,
) -> Analysis:
    """Load a trace file and analyze it against the given ceilings, a probe result, or this machine's."""
    if ceilings is not None and probe is not None:
        raise ValueError("give either ceilings or probe, not both")
    if ceilings is not None and not isinstance(ceilings, Ceilings):
        raise TypeError(f"ceilings must be a fuselab.device.Ceilings, got {type(ceilings).__name__}")
    (on_stage or (lambda stage: None))("reading trace")
    trace = load_trace(path)
    return analyze(trace, ceilings or measured_ceilings(probe), skip_steps=skip_steps, on_stage=on_stage)
