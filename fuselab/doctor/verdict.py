"""Turn an analysis into a verdict: the dominant cost, the evidence for it, and ranked fixes.

The step is judged as it runs without the profiler when its unprofiled time is known (`diagnose`
measures it): the profiler slows host code several times over (Python-heavy code most) but not
the kernels, so GPU busy share = profiled kernel time / unprofiled step time (at most 100%), and
the idle the unprofiled step leaves is split among launch gaps, sync stalls and other idle as the
profiler saw them. A trace alone (`analyze_trace`) is judged as profiled.

The rules, in order:
1. the GPU idles for at least IDLE_SHARE of the step: it is sync-bound when the idle follows syncs
   more than launches; else launch-bound when the host, its sync waits aside, takes at least as
   long to issue a step's work as the GPU takes to run it; else the host runs ahead and the idle
   is only each step starting on an empty queue (after the step-boundary wait): the kernels decide;
2. else, individually launched kernels are tiny (median under TINY_KERNEL_US, many per step):
   their time is the fixed cost of a launch, so the step is launch-bound even when they run back
   to back; kernels replayed from a CUDA graph do not count, their launches are already gone;
3. else the kernels decide: compute- or memory-bound by where their time goes on the roofline.
A batch test (time at 10x the batch nearly unchanged) turns a kernel-bound verdict into
launch-bound unless the GPU was kept busy, in which case the fixed cost is kernel work (reading
weights) and the verdict stands.
Graph capture is offered only for the launch gaps before individually launched work; the GPU
waiting for a graph replay to be launched calls for less host work around the replay instead.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass, field

from fuselab.doctor.analyze import Analysis
from fuselab.doctor.fusion import GRAPH_FIX
from fuselab.doctor.trace import CpuOp

IDLE_SHARE = 0.30
TINY_KERNEL_US = 5.0
TINY_KERNEL_MIN_COUNT = 20
FLAT_BATCH_RATIO = 1.5  # time at 10x the batch over time at 1x, below which the step does not scale
BUSY_FOR_BATCH_TEST = 90.0  # % GPU busy above which a flat batch test means kernel work, not launches
LONE_STALL_SHARE = 0.25  # one launch gap this much of the step is a host stall worth naming
MIN_SAVING_SHARE = 0.02  # fixes that would save less of the step than this are not worth listing
IDLE_PARTS = ("launch_gaps", "sync_stalls", "other_idle")
REPLAY_HOST_FIX = ("the step already replays from a CUDA graph, and the GPU waits for the host between replays: "
                   "trim the host work around each replay, or give each replay more work (a larger batch)")
OUTSIDE_GRAPH_FIX = "capture the kernels launched outside the CUDA graph with the rest of the step (one launch for all of it)"


@dataclass
class Fix:
    action: str
    saving_us: float  # estimated per step
    why: str

    def to_dict(self) -> dict:
        return {"action": self.action, "saving_us_per_step": self.saving_us, "why": self.why}


@dataclass
class Diagnosis:
    verdict: str
    evidence: list[str]
    breakdown: dict[str, dict[str, float]]  # part -> {"us": per step, "share": of the step}
    fixes: list[Fix]
    steps: int
    kernels_per_step: float
    syncs_per_step: float
    gpu_busy_pct: float
    wall_us_per_step: float  # as profiled
    graph_launches_per_step: float = 0.0
    graph_kernels_per_step: float = 0.0
    unprofiled_us_per_step: float | None = None  # the step timed without the profiler, when it was
    batch_test: dict | None = None
    analysis: Analysis | None = field(default=None, repr=False)

    def to_dict(self) -> dict:
        a = self.analysis
        out = {
            "verdict": self.verdict,
            "evidence": self.evidence,
            "steps": self.steps,
            "wall_us_per_step": self.wall_us_per_step,
            "unprofiled_us_per_step": self.unprofiled_us_per_step,
            "kernels_per_step": self.kernels_per_step,
            "graph_launches_per_step": self.graph_launches_per_step,
            "graph_kernels_per_step": self.graph_kernels_per_step,
            "syncs_per_step": self.syncs_per_step,
            "gpu_busy_pct": self.gpu_busy_pct,
            "breakdown": self.breakdown,
            "fixes": [f.to_dict() for f in self.fixes],
            "batch_test": self.batch_test,
        }
        if a is not None:
            out["trace"] = a.trace.path
            out["ceilings"] = {"copy_bandwidth_gbs": a.ceilings.copy_bandwidth_gbs,
                               "bf16_tflops": a.ceilings.bf16_tflops, "source": a.ceilings.source}
            out["per_step"] = [s.to_dict() for s in a.steps]
            out["syncs"] = [s.to_dict() for step in a.syncs for s in step]
            out["fusion_candidates"] = [c.to_dict() for c in a.fusion]
        return out


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else 0.0


def _roofline_pct(analysis: Analysis, bound: str) -> float | None:
    """Time-weighted % of ceiling over the analyzed kernels on one side of the ridge."""
    weighted = total = 0.0
    for indices in analysis.step_events:
        for i in indices:
            c = analysis.costs[i]
            if c.bound == bound and c.pct_of_ceiling is not None:
                weighted += c.pct_of_ceiling * c.dur_us
                total += c.dur_us
    return weighted / total if total else None


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


def _sync_fixes(analysis: Analysis, stall_us: float) -> list[Fix]:
    sites: dict[tuple[str, str | None], list[float]] = defaultdict(list)
    for step_syncs in analysis.syncs:
        for s in step_syncs:
            sites[(s.cause, s.source)].append(s.blocked_us)
    total = sum(len(v) for v in sites.values())
    n_steps = len(analysis.steps)
    fixes = []
    for (cause, source), blocked in sites.items():
        where = f" at {source}" if source else ""
        per_step = len(blocked) / n_steps
        fixes.append(Fix(
            f"remove the {cause}{where} (keep the value on the GPU, or read it back once per step without blocking)",
            stall_us * len(blocked) / total,
            f"{per_step:g} per step, blocking the host {sum(blocked) / n_steps:.1f} us per step and draining the GPU queue each time",
        ))
    return fixes


def _judged_step(analysis: Analysis, unprofiled_us: float | None) -> tuple[float, dict[str, float], float]:
    """The step time to judge, its parts in us, and the factor applied to the profiled idle parts."""
    steps = analysis.steps
    parts = {
        "compute": _mean([s.compute_us for s in steps]),
        "memory": _mean([s.memory_us for s in steps]),
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


def verdict_for(analysis: Analysis, batch_test: dict | None = None, unprofiled_us: float | None = None) -> Diagnosis:
    """Decide what bounds the analyzed steps and what to do about it.

    `unprofiled_us` is the step's time measured without the profiler; given, the step is judged
    against it rather than against the profiled step, whose host time the profiler inflates.
    """
    if unprofiled_us is not None and not (isinstance(unprofiled_us, (int, float)) and unprofiled_us > 0):
        raise ValueError(f"unprofiled_us must be a time > 0 in us, got {unprofiled_us!r}")
    steps = analysis.steps
    profiled_wall = _mean([s.wall_us for s in steps])
    wall, parts, idle_scale = _judged_step(analysis, unprofiled_us)
    breakdown = {k: {"us": v, "share": v / wall if wall else 0.0} for k, v in parts.items()}
    gpu_busy = _mean([s.gpu_busy_us for s in steps])
    busy_pct = 100 * gpu_busy / wall if wall else 0.0
    kernels = _mean([s.kernels for s in steps])
    graph_launches = _mean([s.graph_launches for s in steps])
    graph_kernels = _mean([s.graph_kernels for s in steps])
    launched_alone = _mean([sum(not analysis.replayed[i] for i in indices) for indices in analysis.step_events])
    syncs = _mean([s.syncs for s in steps])
    median_kernel = statistics.median([s.median_kernel_us for s in steps])
    median_launched_kernel = statistics.median([s.median_launched_kernel_us for s in steps])
    idle_share = sum(breakdown[p]["share"] for p in IDLE_PARTS)
    host_issue = _mean([s.host_us - s.sync_blocked_us for s in steps])
    compute_pct, memory_pct = _roofline_pct(analysis, "compute"), _roofline_pct(analysis, "memory")
    c = analysis.ceilings

    evidence = [f"GPU busy {busy_pct:.0f}% of a {wall:.0f} us step; {kernels:.0f} kernels per step, median {median_kernel:.1f} us"]
    if unprofiled_us is not None:
        evidence.append(f"unprofiled, a step takes {unprofiled_us:.0f} us (the profiler slowed the host "
                        f"{profiled_wall / unprofiled_us:.1f}x); profiled, {profiled_wall:.0f} us")
    evidence.append(
        f"idle {100 * idle_share:.0f}% of the step: launch gaps (GPU waited for the host) {100 * breakdown['launch_gaps']['share']:.0f}%, "
        f"sync stalls {100 * breakdown['sync_stalls']['share']:.0f}%, other {100 * breakdown['other_idle']['share']:.0f}%"
        + (" (the unprofiled idle, split as the profiler saw it)" if unprofiled_us is not None else "")
    )
    launch_delay = (f"launch delay median {_mean([s.launch_delay_us['median'] for s in steps]):.1f} us (call to kernel start)"
                    if launched_alone else "")
    rate = _mean([s.launches_per_s for s in steps])
    if graph_kernels:
        plural = "" if graph_launches == 1 else "es"
        evidence.append(f"{graph_kernels:g} kernels per step replayed from {graph_launches:g} graph launch{plural} (no launches of their own); "
                        f"host made {rate:,.0f} launches/s"
                        + (f"; {launched_alone:g} kernels and copies per step launched alone, {launch_delay}" if launched_alone else ""))
    else:
        evidence.append("; ".join(filter(None, [f"host launched {rate:,.0f} kernels/s", launch_delay])))
    host_line = (f"host took {host_issue:.0f} us per step to issue its work (sync waits aside)"
                 + (" under the profiler" if unprofiled_us is not None else "") + f", against {gpu_busy:.0f} us of GPU work: ")
    if unprofiled_us is None:
        host_line += "it cannot keep the GPU fed" if host_issue >= gpu_busy else "it could run ahead of the GPU"
    else:
        host_line += (f"unprofiled, the GPU still idles {100 * idle_share:.0f}% of the step" if idle_share >= IDLE_SHARE
                      else "unprofiled, it keeps the GPU fed")
    evidence.append(host_line)
    if syncs:
        evidence.append(f"{syncs:g} host-blocking syncs per step, blocking the host {_mean([s.sync_blocked_us for s in steps]):.0f} us per step")
    for bound, pct in (("compute", compute_pct), ("memory", memory_pct)):
        share = parts[bound] / (parts["compute"] + parts["memory"]) if parts["compute"] + parts["memory"] else 0.0
        ceiling = f"{c.bf16_tflops:g} TFLOP/s bf16" if bound == "compute" else f"{c.copy_bandwidth_gbs:g} GB/s copy"
        reached = f" at {pct:.0f}% of the {ceiling} ceiling ({c.source})" if pct is not None else ""
        evidence.append(f"{bound}-bound kernels: {100 * share:.0f}% of GPU busy time{reached}")

    synced_idle = syncs and parts["sync_stalls"] >= parts["launch_gaps"]
    if idle_share >= IDLE_SHARE and (synced_idle or host_issue >= gpu_busy):
        verdict = "sync-bound" if synced_idle else "launch-bound"
    elif median_launched_kernel < TINY_KERNEL_US and kernels - graph_kernels >= TINY_KERNEL_MIN_COUNT:
        verdict = "launch-bound"
        which = "individually launched kernel" if graph_kernels else "kernel"
        evidence.append(f"median {which} {median_launched_kernel:.1f} us (< {TINY_KERNEL_US:g} us): "
                        "kernels this short cost about what launching them does")
    else:
        verdict = "compute-bound" if parts["compute"] >= parts["memory"] else "memory-bound"
    gap_us, stalled_in = _longest_launch_gap(analysis)
    if verdict == "launch-bound" and stalled_in is not None and gap_us >= LONE_STALL_SHARE * profiled_wall:
        # One host op holding the GPU idle this long is not launch overhead, and a graph would hide
        # it only if the op's host work can be captured: name it.
        evidence.append(f"one GPU wait of {gap_us:.0f} us ({100 * gap_us / profiled_wall:.0f}% of a profiled step) passed almost all "
                        f"inside host op {stalled_in.name}, which ran {stalled_in.dur:.0f} us")
    if batch_test is not None:
        ratio = batch_test["ratio"]
        evidence.append(f"batch test: {batch_test['factor']}x the batch took {ratio:.2f}x the time"
                        + (" (does not scale with the batch: a fixed cost per step)" if ratio < FLAT_BATCH_RATIO else ""))
        if ratio < FLAT_BATCH_RATIO and verdict in ("memory-bound", "compute-bound") and busy_pct < BUSY_FOR_BATCH_TEST:
            verdict = "launch-bound"

    fixes = _sync_fixes(analysis, parts["sync_stalls"])
    # Graph capture removes only the waits for launches made one by one; waits for a graph launch,
    # and all waits of a step with nothing launched outside a graph, are host work around replays.
    replay_gaps = (_mean([s.graph_launch_gap_us for s in steps]) * idle_scale if launched_alone
                   else parts["launch_gaps"])
    capture_gaps = parts["launch_gaps"] - replay_gaps
    if capture_gaps > 0:
        after = " once the syncs are gone (capture forbids them)" if syncs else ""
        fixes.append(Fix((OUTSIDE_GRAPH_FIX if graph_kernels else GRAPH_FIX) + after, capture_gaps,
                         f"the GPU waited {capture_gaps:.0f} us per step for the host to launch"))
    if replay_gaps > 0:
        fixes.append(Fix(REPLAY_HOST_FIX, replay_gaps, f"the GPU waited {replay_gaps:.0f} us per step for the host to launch the graph"))
    for cand in analysis.fusion:
        # The idle between a sequence's kernels shrinks without the profiler as the step's idle does.
        per_step = (cand.kernels_us + (cand.total_us - cand.kernels_us) * idle_scale) / len(steps)
        saving = per_step * (1 - 1 / len(cand.labels))  # one kernel instead of n
        fixes.append(Fix(f"{' -> '.join(cand.labels)}: {cand.fix}", saving,
                         f"{cand.count / len(steps):g} per step, {per_step:.0f} us per step"))
    fixes = sorted((f for f in fixes if f.saving_us >= MIN_SAVING_SHARE * wall), key=lambda f: -f.saving_us)
    if verdict == "compute-bound":
        reached = f" at {compute_pct:.0f}% of the bf16 ceiling" if compute_pct is not None else ""
        advice = ("nothing to gain from fusion or graphs: the step is compute-bound on large matrix multiplies" + reached)
        if compute_pct is not None and compute_pct < 50:
            advice += "; they are well below the ceiling: use bf16 rather than fp32, and dimensions in multiples of 64"
        fixes.insert(0, Fix(advice, 0.0, f"{100 * breakdown['compute']['share']:.0f}% of the step is compute-bound kernel time"))

    return Diagnosis(
        verdict=verdict, evidence=evidence, breakdown=breakdown, fixes=fixes, steps=len(steps),
        kernels_per_step=kernels, syncs_per_step=syncs, gpu_busy_pct=busy_pct, wall_us_per_step=profiled_wall,
        graph_launches_per_step=graph_launches, graph_kernels_per_step=graph_kernels, unprofiled_us_per_step=unprofiled_us,
        batch_test=batch_test, analysis=analysis,
    )
