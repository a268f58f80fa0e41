"""Sum an analysis up into the per-step figures a verdict is judged on.

The step is judged as it runs without the profiler when its unprofiled time is known (`diagnose`
measures it): the profiler slows host code several times over (Python-heavy code most) but not
the kernels, so GPU busy share = profiled kernel time / unprofiled step time (at most 100%), and
the idle the unprofiled step leaves is split among launch gaps, sync stalls and other idle as the
profiler saw them. A trace alone (`analyze_trace`) is judged as profiled.

Busy time is split into compute-bound kernels, memory-bound kernels (and memsets), copies and,
when the steps ran any, NCCL kernels: communication, a part of its own (with its calls per step),
since it moves data between GPUs and neither computes nor is bound by this GPU's memory.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from fuselab.doctor.analyze import Analysis
from fuselab.doctor.trace import CpuOp, is_communication

IDLE_PARTS = ("launch_gaps", "sync_stalls", "other_idle")
# A float32 GEMM this far below the float32 (CUDA-core) rate is held up by something other than its
# math (too small to fill the GPU, or its launch), which TF32's tensor cores do not shorten.
FP32_MATH_BOUND_PCT = 30.0


@dataclass(frozen=True)
class StepSummary:
    """Means over the analyzed steps; times in us per step."""

    profiled_wall_us: float
    unprofiled_us: float | None  # the step timed without the profiler, when it was
    wall_us: float  # the step time judged: the unprofiled one when known, else the profiled one
    parts: dict[str, float]  # compute, memory, copies, communication (with NCCL kernels) and the IDLE_PARTS, in us
    breakdown: dict[str, dict[str, float]]  # part -> {"us": per step, "share": of wall_us}; communication adds "calls"
    idle_scale: float  # the factor applied to the profiled idle parts
    idle_share: float
    gpu_busy_us: float
    busy_pct: float
    kernels: float
    graph_launches: float
    graph_kernels: float
    launched_alone: float  # kernels and copies launched one by one, not replayed from a graph
    median_kernel_us: float
    median_launched_kernel_us: float
    launches_per_s: float
    launch_delay_median_us: float
    host_issue_us: float  # host time to issue the step's work, sync waits aside (as profiled)
    syncs: float
    sync_blocked_us: float
    graph_launch_gap_us: float  # as profiled
    compute_pct: float | None  # time-weighted % of ceiling of the compute-bound kernels (each against its precision's)
    memory_pct: float | None
    compute_ceilings: dict[str, float]  # precision -> TFLOP/s ceiling, of the compute-bound matrix kernels
    gemm_us: dict[str, float]  # precision -> compute-bound matrix-multiply kernel time per step (fp32: of those at
    # FP32_MATH_BOUND_PCT of the fp32 ceiling or more, the ones TF32 speeds up)
    longest_launch_gap_us: float
    stalled_in: CpuOp | None  # the innermost host op that ran through most of the longest launch gap


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else 0.0


def _roofline_pct(analysis: Analysis, bound: str) -> float | None:
    """Time-weighted % of ceiling over the analyzed kernels on one side of the ridge."""
    weighted = total = 0.0
    for indices in analysis.step_events:
        for i in indices:
            c = analysis.costs[i]
            if c.bound == bound and c.pct_of_ceiling is not None and not is_communication(analysis.trace.gpu[i]):
                weighted += c.pct_of_ceiling * c.dur_us
                total += c.dur_us
    return weighted / total if total else None


def _matrix_kernels(analysis: Analysis) -> tuple[dict[str, float], dict[str, float]]:
    """Per precision, over the compute-bound matrix-multiply kernels (the ones a faster precision speeds up):
    their time per step, and their ceiling. float32 ones count only at FP32_MATH_BOUND_PCT of their ceiling or more."""
    gemm_us: dict[str, float] = {}
    ceilings: dict[str, float] = {}
    for indices in analysis.step_events:
        for i in indices:
            c = analysis.costs[i]
            if c.precision is None or c.bound != "compute":
                continue
            ceilings[c.precision] = c.tflops_ceiling
            if c.precision != "fp32" or (c.pct_of_ceiling or 0.0) >= FP32_MATH_BOUND_PCT:
                gemm_us[c.precision] = gemm_us.get(c.precision, 0.0) + c.dur_us / len(analysis.steps)
    return gemm_us, ceilings


def _longest_launch_gap(analysis: Analysis) -> tuple[float, CpuOp | None]:
    """The longest wait of the GPU for the host, and the innermost host op that ran through most of it."""
    gaps = [(g1 - g0, g0, g1) for step_gaps in analysis.gaps for g0, g1, kind in step_gaps if kind == "launch"]
    if not gaps:
        return 0.0, None
    length, g0, g1 = max(gaps)
    # The innermost op running at the middle of the gap, if it spans most of it.
    around = [op for tid in analysis.trace.op_threads for op in analysis.trace.ops_enclosing(tid, (g0 + g1) / 2)
              if min(op.end, g1) - max(op.ts, g0) >= 0.9 * length]
    return length, min(around, key=lambda op: op.dur, default=None)


def _judged_step(analysis: Analysis, unprofiled_us: float | None) -> tuple[float, dict[str, float], float]:
    """The step time to judge, its parts in us, and the factor applied to the profiled idle parts."""
    steps = analysis.steps
    parts = {
        "compute": _mean([s.compute_us for s in steps]),
        "memory": _mean([s.memory_us for s in steps]),
        "copies": _mean([s.copy_us for s in steps]),
    }
    if any(s.communication_kernels for s in steps):
        parts["communication"] = _mean([s.communication_us for s in steps])
    parts |= {
        "launch_gaps": _mean([s.launch_gap_us for s in steps]),
        "sync_stalls": _mean([s.sync_stall_us for s in steps]),
        "other_idle": _mean([s.other_idle_us for s in steps]),
    }
    if unprofiled_us is None:
        return _mean([s.wall_us for s in steps]), parts, 1.0
    gpu_busy = _mean([s.gpu_busy_us for s in steps])
    wall = max(unprofiled_us, gpu_busy)  # kernels the profiler timed cannot take longer than the whole step
    profiled_idle = sum(parts[p] for p in IDLE_PARTS)
    if not profiled_idle:
        parts["other_idle"] = wall - gpu_busy
        return wall, parts, 0.0
    scale = (wall - gpu_busy) / profiled_idle
    return wall, parts | {p: parts[p] * scale for p in IDLE_PARTS}, scale


def summarize(analysis: Analysis, unprofiled_us: float | None = None) -> StepSummary:
    """The figures of the analyzed steps, judged against `unprofiled_us` when it is given."""
    if unprofiled_us is not None and not (isinstance(unprofiled_us, (int, float)) and unprofiled_us > 0):
        raise ValueError(f"unprofiled_us must be a time > 0 in us, got {unprofiled_us!r}")
    steps = analysis.steps
    wall, parts, idle_scale = _judged_step(analysis, unprofiled_us)
    breakdown = {k: {"us": v, "share": v / wall if wall else 0.0} for k, v in parts.items()}
    if "communication" in breakdown:
        breakdown["communication"]["calls"] = _mean([s.communication_kernels for s in steps])
    gpu_busy = _mean([s.gpu_busy_us for s in steps])
    gap_us, stalled_in = _longest_launch_gap(analysis)
    gemm_us, compute_ceilings = _matrix_kernels(analysis)
    return StepSummary(
        profiled_wall_us=_mean([s.wall_us for s in steps]),
        unprofiled_us=unprofiled_us,
        wall_us=wall,
        parts=parts,
        breakdown=breakdown,
        idle_scale=idle_scale,
        idle_share=sum(breakdown[p]["share"] for p in IDLE_PARTS),
        gpu_busy_us=gpu_busy,
        busy_pct=100 * gpu_busy / wall if wall else 0.0,
        kernels=_mean([s.kernels for s in steps]),
        graph_launches=_mean([s.graph_launches for s in steps]),
        graph_kernels=_mean([s.graph_kernels for s in steps]),
        launched_alone=_mean([sum(not analysis.replayed[i] for i in indices) for indices in analysis.step_events]),
        median_kernel_us=statistics.median([s.median_kernel_us for s in steps]),
        median_launched_kernel_us=statistics.median([s.median_launched_kernel_us for s in steps]),
        launches_per_s=_mean([s.launches_per_s for s in steps]),
        launch_delay_median_us=_mean([s.launch_delay_us["median"] for s in steps]),
        host_issue_us=_mean([s.host_us - s.sync_blocked_us for s in steps]),
        syncs=_mean([s.syncs for s in steps]),
        sync_blocked_us=_mean([s.sync_blocked_us for s in steps]),
        graph_launch_gap_us=_mean([s.graph_launch_gap_us for s in steps]),
        compute_pct=_roofline_pct(analysis, "compute"),
        memory_pct=_roofline_pct(analysis, "memory"),
        compute_ceilings=compute_ceilings,
        gemm_us=gemm_us,
        longest_launch_gap_us=gap_us,
        stalled_in=stalled_in,
    )
