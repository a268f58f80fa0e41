"""Turn an analysis into a verdict: the dominant cost, the evidence for it, and ranked fixes.

The rules, in order:
1. the GPU idles for at least IDLE_SHARE of the step: it is sync-bound when the idle follows syncs
   more than launches; else launch-bound when the host, its sync waits aside, takes at least as
   long to issue a step's work as the GPU takes to run it; else the host runs ahead and the idle
   is only each step starting on an empty queue (after the step-boundary wait): the kernels decide;
2. else, kernels are tiny (median under TINY_KERNEL_US, many per step): their time is the fixed
   cost of a launch, so the step is launch-bound even when they run back to back;
3. else the kernels decide: compute- or memory-bound by where their time goes on the roofline.
A batch test (time at 10x the batch nearly unchanged) turns a kernel-bound verdict into
launch-bound unless the GPU was kept busy, in which case the fixed cost is kernel work (reading
weights) and the verdict stands.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass, field

from fuselab.doctor.analyze import Analysis
from fuselab.doctor.fusion import GRAPH_FIX
from fuselab.doctor.trace import CpuOp

VERDICTS = ("launch-bound", "sync-bound", "memory-bound", "compute-bound")
IDLE_SHARE = 0.30
TINY_KERNEL_US = 5.0
TINY_KERNEL_MIN_COUNT = 20
FLAT_BATCH_RATIO = 1.5  # time at 10x the batch over time at 1x, below which the step does not scale
BUSY_FOR_BATCH_TEST = 90.0  # % GPU busy above which a flat batch test means kernel work, not launches
LONE_STALL_SHARE = 0.25  # one launch gap this much of the step is a host stall worth naming
MIN_SAVING_SHARE = 0.02  # fixes that would save less of the step than this are not worth listing


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
    wall_us_per_step: float
    batch_test: dict | None = None
    analysis: Analysis | None = field(default=None, repr=False)

    def to_dict(self) -> dict:
        a = self.analysis
        out = {
            "verdict": self.verdict,
            "evidence": self.evidence,
            "steps": self.steps,
            "wall_us_per_step": self.wall_us_per_step,
            "kernels_per_step": self.kernels_per_step,
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


def verdict_for(analysis: Analysis, batch_test: dict | None = None) -> Diagnosis:
    """Decide what bounds the analyzed steps and what to do about it."""
    steps = analysis.steps
    wall = _mean([s.wall_us for s in steps])
    parts = {
        "compute": _mean([s.compute_us for s in steps]),
        "memory": _mean([s.memory_us for s in steps]),
        "launch_gaps": _mean([s.launch_gap_us for s in steps]),
        "sync_stalls": _mean([s.sync_stall_us for s in steps]),
        "other_idle": _mean([s.other_idle_us for s in steps]),
    }
    breakdown = {k: {"us": v, "share": v / wall if wall else 0.0} for k, v in parts.items()}
    busy_pct = 100 * sum(s.gpu_busy_us for s in steps) / sum(s.wall_us for s in steps)
    kernels = _mean([s.kernels for s in steps])
    syncs = _mean([s.syncs for s in steps])
    median_kernel = statistics.median([s.median_kernel_us for s in steps])
    idle_share = sum(breakdown[p]["share"] for p in ("launch_gaps", "sync_stalls", "other_idle"))
    gpu_busy = _mean([s.gpu_busy_us for s in steps])
    host_issue = _mean([s.host_us - s.sync_blocked_us for s in steps])
    compute_pct, memory_pct = _roofline_pct(analysis, "compute"), _roofline_pct(analysis, "memory")
    c = analysis.ceilings

    evidence = [
        f"GPU busy {busy_pct:.0f}% of a {wall:.0f} us step; {kernels:.0f} kernels per step, median {median_kernel:.1f} us",
        f"idle {100 * idle_share:.0f}% of the step: launch gaps (GPU waited for the host) {100 * breakdown['launch_gaps']['share']:.0f}%, "
        f"sync stalls {100 * breakdown['sync_stalls']['share']:.0f}%, other {100 * breakdown['other_idle']['share']:.0f}%",
        f"host launched {_mean([s.launches_per_s for s in steps]):,.0f} kernels/s; launch delay median "
        f"{_mean([s.launch_delay_us['median'] for s in steps]):.1f} us (call to kernel start)",
    ]
    evidence.append(
        f"host took {host_issue:.0f} us per step to issue its work (sync waits aside), against {gpu_busy:.0f} us of GPU work: "
        + ("it cannot keep the GPU fed" if host_issue >= gpu_busy else "it could run ahead of the GPU")
    )
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
    elif median_kernel < TINY_KERNEL_US and kernels >= TINY_KERNEL_MIN_COUNT:
        verdict = "launch-bound"
        evidence.append(f"median kernel {median_kernel:.1f} us (< {TINY_KERNEL_US:g} us): kernels this short cost about what launching them does")
    else:
        verdict = "compute-bound" if parts["compute"] >= parts["memory"] else "memory-bound"
    gap_us, stalled_in = _longest_launch_gap(analysis)
    if verdict == "launch-bound" and stalled_in is not None and gap_us >= LONE_STALL_SHARE * wall:
        # One host op holding the GPU idle this long is not launch overhead, and a graph would hide
        # it only if the op's host work can be captured: name it.
        evidence.append(f"one GPU wait of {gap_us:.0f} us ({100 * gap_us / wall:.0f}% of a step) passed almost all inside "
                        f"host op {stalled_in.name}, which ran {stalled_in.dur:.0f} us")
    if batch_test is not None:
        ratio = batch_test["ratio"]
        evidence.append(f"batch test: {batch_test['factor']}x the batch took {ratio:.2f}x the time"
                        + (" (does not scale with the batch: a fixed cost per step)" if ratio < FLAT_BATCH_RATIO else ""))
        if ratio < FLAT_BATCH_RATIO and verdict in ("memory-bound", "compute-bound") and busy_pct < BUSY_FOR_BATCH_TEST:
            verdict = "launch-bound"

    fixes = _sync_fixes(analysis, parts["sync_stalls"])
    if parts["launch_gaps"] > 0:
        after = " once the syncs are gone (capture forbids them)" if syncs else ""
        fixes.append(Fix(GRAPH_FIX + after, parts["launch_gaps"],
                         f"the GPU waited {parts['launch_gaps']:.0f} us per step for the host to launch"))
    for cand in analysis.fusion:
        per_step = cand.total_us / len(steps)
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
        kernels_per_step=kernels, syncs_per_step=syncs, gpu_busy_pct=busy_pct, wall_us_per_step=wall,
        batch_test=batch_test, analysis=analysis,
    )
