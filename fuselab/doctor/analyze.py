"""Read a trace step by step: how busy the GPU was, why it idled, how fast the host launched, what synced.

A step is a "ProfilerStep#N" range on the host (the whole trace when there is none). GPU work
belongs to the step in which the host queued it. The step's window on the GPU's timeline (idle.py)
runs from where the GPU was free for its work (its host start, or later when earlier work was still
running: a host that runs ahead) to whichever ends later, the workload's host work or its last GPU
work; the workload's host work ends where the doctor's step-boundary wait begins, since what that
wait costs once the GPU is done (closing the ranges) is the profiler's. Idle time during which the
profiler itself held the host up (its "overhead" events) is left out of the step too. Every other
microsecond is either GPU busy time (split into compute- and memory-bound kernel time by the
roofline, NCCL communication kernels, and copies) or an idle gap, split by cause: sync stall, launch gap, other idle (idle.py).

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
from fuselab.doctor.chains import optimizer_of
from fuselab.doctor.copies import CopyGroup, copy_groups
from fuselab.doctor.fusion import FusionCandidate, fusion_candidates, kernel_label
from fuselab.doctor.idle import Gap, Timeline, busy_by_kind, split_off_overhead, step_gaps
from fuselab.doctor.precision import FP32_PRECISION_MARK, tf32_allowed
from fuselab.doctor.roofline import KernelCost, kernel_costs
from fuselab.doctor.syncs import SYNC_APIS, STEP_BOUNDARY, Sync, find_syncs
from fuselab.doctor.trace import CpuOp, RuntimeCall, Span, Trace, gc_paused, is_communication, load_trace


@dataclass
class StepStats:
    name: str
    start: float  # the step's window on the GPU: from where the GPU was free for its work
    end: float
    host_start: float
    host_us: float  # the workload's host time, up to the step-boundary wait, less profiler overhead
    wall_us: float  # the step's window, less profiler overhead
    profiler_us: float  # GPU idle time left out because the profiler held up the host
    gpu_busy_us: float
    gpu_busy_pct: float
    kernels: int
    copies: int  # memcpy and memset on the GPU
    median_kernel_us: float
    compute_us: float  # busy time in compute-bound kernels
    memory_us: float  # busy time in memory-bound kernels and memsets
    copy_us: float  # busy time in memcpy
    communication_us: float  # busy time in NCCL kernels
    communication_kernels: int  # NCCL kernels (counted in `kernels` too)
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
    copies: list[CopyGroup] = field(default_factory=list)  # per step, by route


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


def _work_kinds(trace: Trace, costs: list[KernelCost]) -> list[str]:
    """What each GPU event's time counts as in the breakdown: "compute", "memory", "communication" or "copy"."""
    return ["copy" if g.kind == "memcpy" else "communication" if is_communication(g) else c.bound
            for g, c in zip(trace.gpu, costs)]


def _busy_split(timeline: Timeline, start: float, end: float, kinds: list[str], busy: float) -> dict[str, float]:
    """The busy time of the window split by kind of work, scaled to the busy time (streams may overlap)."""
    by_kind = busy_by_kind(timeline, start, end, kinds)
    total = sum(by_kind.values())
    scale = busy / total if total > 0 else 0.0
    return {kind: by_kind.get(kind, 0.0) * scale for kind in ("compute", "memory", "communication", "copy")}


def _step_stats(
    trace: Trace, timeline: Timeline, step: Span, indices: list[int], call_of: dict[int, RuntimeCall], kinds: list[str],
    replayed: list[bool], syncs: list[Sync], sync_copies: set[int],
) -> tuple[StepStats, list[Gap]]:
    """The statistics of one step, and its idle gaps by cause."""
    events = [trace.gpu[i] for i in indices]
    host_end = _workload_host_end(trace, step)
    host_stalled = split_off_overhead(step.ts, host_end, trace.profiler_overhead)
    host_us = host_end - step.ts - sum(p1 - p0 for p0, p1, by_profiler in host_stalled if by_profiler)
    start, end = timeline.window(step.ts, host_end, indices)
    gaps, graph_launch_gap = step_gaps(trace, timeline, start, end, call_of, syncs, sync_copies, replayed)
    idle = {"launch": 0.0, "sync": 0.0, "other": 0.0, "profiler": 0.0}
    for g0, g1, kind in gaps:
        idle[kind] += g1 - g0
    busy = max(0.0, end - start - sum(idle.values()))
    split = _busy_split(timeline, start, end, kinds, busy)

    kernel_durs = [g.dur for g in events if g.kind == "kernel"]
    launched = [not replayed[i] for i in indices]
    launched_kernel_durs = [g.dur for g, own in zip(events, launched) if own and g.kind == "kernel"]
    # A replayed kernel's delay from the graph launch is its place in the graph, not launch latency.
    delays = [g.ts - call_of[g.correlation].ts for g, own in zip(events, launched) if own and g.correlation in call_of]
    launches = len({g.correlation for g in events if g.correlation in call_of})  # a graph launch counts once
    graph_launches = len({g.correlation for g, own in zip(events, launched) if not own})
    wall = end - start - idle["profiler"]
    stats = StepStats(
        name=step.name, start=start, end=end, host_start=step.ts, host_us=host_us, wall_us=wall, profiler_us=idle["profiler"],
        gpu_busy_us=busy, gpu_busy_pct=100 * busy / wall if wall > 0 else 0.0, kernels=len(kernel_durs),
        copies=len(events) - len(kernel_durs), median_kernel_us=statistics.median(kernel_durs) if kernel_durs else 0.0,
        compute_us=split["compute"], memory_us=split["memory"], copy_us=split["copy"],
        communication_us=split["communication"], communication_kernels=sum(map(is_communication, events)),
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


def _tf32_at_launch(trace: Trace, call_of: dict[int, RuntimeCall]) -> list[bool | None]:
    """Whether TF32 was allowed when each GPU event was launched, from the doctor's marks; None without marks."""
    marks = [a for a in trace.annotations if a.name.startswith(FP32_PRECISION_MARK)]
    if not marks:
        return [None] * len(trace.gpu)
    times = [m.ts for m in marks]
    out: list[bool | None] = []
    for g in trace.gpu:
        call = call_of.get(g.correlation)
        pos = bisect.bisect_right(times, call.ts if call else g.ts) - 1
        out.append(tf32_allowed(marks[pos].name.removeprefix(FP32_PRECISION_MARK)) if pos >= 0 else None)
    return out


def _syncing_ops(trace: Trace) -> set[int]:
    """External ids of the ops that made a blocking synchronize call."""
    return {r.external_id for r in trace.runtime if r.external_id and r.name in SYNC_APIS}


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
    if skip_steps >= len(steps) and trace.steps:
        raise ValueError(f"skipping {skip_steps} warm-up steps (--warmup) would leave none of the {len(steps)} steps "
                         f"of {trace.path}: give --warmup {len(steps) - 1} or less")
    steps = steps[skip_steps:] if trace.steps else steps
    call_of = {r.correlation: r for r in trace.runtime if r.correlation is not None}

    report("roofline")
    op_of = _launching_ops(trace, call_of)
    costs = kernel_costs(trace.gpu, op_of, ceilings, _tf32_at_launch(trace, call_of))
    replayed = _graph_replayed(trace, call_of)
    timeline = Timeline.of(trace, replayed)
    kinds = _work_kinds(trace, costs)

    report("syncs")
    all_syncs = find_syncs(trace)
    # Copies launched by a blocking call: the gap before them is part of that sync's round trip.
    sync_corr = {c for s in all_syncs for c in s.correlations}
    sync_copies = {i for i, g in enumerate(trace.gpu) if g.kind == "memcpy" and g.correlation in sync_corr}

    report("steps")
    members = _assign_to_steps(trace, steps, call_of)
    per_step_syncs = _syncs_per_step(all_syncs, steps)
    per_step = [
        _step_stats(trace, timeline, step, idx, call_of, kinds, replayed, step_syncs, sync_copies)
        for step, idx, step_syncs in zip(steps, members, per_step_syncs)
    ]
    stats = [step_stats for step_stats, _ in per_step]
    gaps = [step_gaps for _, step_gaps in per_step]

    report("fusion candidates")
    labels = [kernel_label(g, op_of[i]) for i, g in enumerate(trace.gpu)]
    fusion = fusion_candidates(members, trace.gpu, labels, replayed, optimizer_of(trace.gpu, call_of, trace.annotations))
    copies = copy_groups(trace.gpu, members, call_of, _syncing_ops(trace))
    return Analysis(trace, ceilings, stats, members, per_step_syncs, gaps, costs, replayed, fusion, copies)


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
    with gc_paused():  # the analysis, too, makes many objects and no cycles
        return analyze(trace, ceilings or measured_ceilings(probe), skip_steps=skip_steps, on_stage=on_stage)
