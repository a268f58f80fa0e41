"""Turn an analysis into a verdict: the dominant cost, the evidence for it, and ranked fixes.

summary.summarize (the step's figures) -> rules.judge (one rule per finding) -> the evidence text
(here) -> fixes.ranked_fixes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from fuselab.device import Ceilings
from fuselab.doctor.analyze import Analysis
from fuselab.doctor.fixes import Fix, ranked_fixes
from fuselab.doctor.rules import IDLE_SHARE, judge
from fuselab.doctor.summary import StepSummary, summarize
from fuselab.doctor.views import Views, views as detail_views


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

    @cached_property
    def views(self) -> Views | None:
        """The top-kernels, region and stream tables; None without the analysis."""
        a = self.analysis
        return None if a is None else detail_views(a, self.unprofiled_us_per_step or self.wall_us_per_step)

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
            out.update(self.views.to_dict())
        return out


def _summary_evidence(s: StepSummary, c: Ceilings) -> list[str]:
    """What the step's figures show, before any rule's own findings."""
    unprofiled = s.unprofiled_us is not None
    b = s.breakdown
    evidence = [f"GPU busy {s.busy_pct:.0f}% of a {s.wall_us:.0f} us step; {s.kernels:.0f} kernels per step, "
                f"median {s.median_kernel_us:.1f} us"]
    if unprofiled:
        evidence.append(f"unprofiled, a step takes {s.unprofiled_us:.0f} us (the profiler slowed the host "
                        f"{s.profiled_wall_us / s.unprofiled_us:.1f}x); profiled, {s.profiled_wall_us:.0f} us")
    evidence.append(
        f"idle {100 * s.idle_share:.0f}% of the step: launch gaps (GPU waited for the host) {100 * b['launch_gaps']['share']:.0f}%, "
        f"sync stalls {100 * b['sync_stalls']['share']:.0f}%, other {100 * b['other_idle']['share']:.0f}%"
        + (" (the unprofiled idle, split as the profiler saw it)" if unprofiled else "")
    )
    launch_delay = (f"launch delay median {s.launch_delay_median_us:.1f} us (call to kernel start)"
                    if s.launched_alone else "")
    if s.graph_kernels:
        plural = "" if s.graph_launches == 1 else "es"
        evidence.append(f"{s.graph_kernels:g} kernels per step replayed from {s.graph_launches:g} graph launch{plural} "
                        f"(no launches of their own); host made {s.launches_per_s:,.0f} launches/s"
                        + (f"; {s.launched_alone:g} kernels and copies per step launched alone, {launch_delay}"
                           if s.launched_alone else ""))
    else:
        evidence.append("; ".join(filter(None, [f"host launched {s.launches_per_s:,.0f} kernels/s", launch_delay])))
    host_line = (f"host took {s.host_issue_us:.0f} us per step to issue its work (sync waits aside)"
                 + (" under the profiler" if unprofiled else "") + f", against {s.gpu_busy_us:.0f} us of GPU work: ")
    if not unprofiled:
        host_line += "it cannot keep the GPU fed" if s.host_issue_us >= s.gpu_busy_us else "it could run ahead of the GPU"
    else:
        host_line += (f"unprofiled, the GPU still idles {100 * s.idle_share:.0f}% of the step" if s.idle_share >= IDLE_SHARE
                      else "unprofiled, it keeps the GPU fed")
    evidence.append(host_line)
    if s.syncs:
        evidence.append(f"{s.syncs:g} host-blocking syncs per step, blocking the host {s.sync_blocked_us:.0f} us per step")
    kernel_us = s.parts["compute"] + s.parts["memory"]
    for bound, pct in (("compute", s.compute_pct), ("memory", s.memory_pct)):
        share = s.parts[bound] / kernel_us if kernel_us else 0.0
        ceiling = f"{c.bf16_tflops:g} TFLOP/s bf16" if bound == "compute" else f"{c.copy_bandwidth_gbs:g} GB/s copy"
        reached = f" at {pct:.0f}% of the {ceiling} ceiling ({c.source})" if pct is not None else ""
        evidence.append(f"{bound}-bound kernels: {100 * share:.0f}% of GPU busy time{reached}")
    return evidence


def verdict_for(analysis: Analysis, batch_test: dict | None = None, unprofiled_us: float | None = None) -> Diagnosis:
    """Decide what bounds the analyzed steps and what to do about it.

    `unprofiled_us` is the step's time measured without the profiler; given, the step is judged
    against it rather than against the profiled step, whose host time the profiler inflates.
    """
    s = summarize(analysis, unprofiled_us)
    finding = judge(s, batch_test)
    return Diagnosis(
        verdict=finding.verdict, evidence=_summary_evidence(s, analysis.ceilings) + list(finding.evidence),
        breakdown=s.breakdown, fixes=ranked_fixes(analysis, s, finding.verdict), steps=len(analysis.steps),
        kernels_per_step=s.kernels, syncs_per_step=s.syncs, gpu_busy_pct=s.busy_pct, wall_us_per_step=s.profiled_wall_us,
        graph_launches_per_step=s.graph_launches, graph_kernels_per_step=s.graph_kernels, unprofiled_us_per_step=unprofiled_us,
        batch_test=batch_test, analysis=analysis,
    )
