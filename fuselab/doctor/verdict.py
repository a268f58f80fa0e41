"""Turn an analysis into a verdict: the dominant cost, the evidence for it, and ranked fixes.

summary.summarize (the step's figures) -> rules.judge (one rule per finding) -> the evidence text
(here) -> fixes.ranked_fixes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from fuselab.device import Ceilings
from fuselab.doctor.analyze import Analysis
from fuselab.doctor.copies import copies_evidence
from fuselab.doctor.fixes import Fix, ranked_fixes
from fuselab.doctor.precision import RATIO_SOURCE
from fuselab.doctor.rules import IDLE_SHARE, judge
from fuselab.doctor.summary import StepSummary, summarize
from fuselab.doctor.views import Views, views as detail_views


HOST_AHEAD_DELAY = 3  # kernels' worth of launch delay that says the work waited in a queue, not for a launch


@dataclass
class Diagnosis:
    verdict: str
    evidence: list[str]
    breakdown: dict[str, dict[str, float]]  # part -> {"us": per step, "share": of the step}; communication adds "calls"
    fixes: list[Fix]
    steps: int
    kernels_per_step: float
    syncs_per_step: float
    gpu_busy_pct: float
    wall_us_per_step: float  # as profiled
    graph_launches_per_step: float = 0.0
    graph_kernels_per_step: float = 0.0
    unprofiled_us_per_step: float | None = None  # the step timed without the profiler, when it was
    profiled_verdict: str | None = None  # the verdict on the profiled step, when the unprofiled one was judged
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
            "profiled_verdict": self.profiled_verdict,
            "profiler_slowdown": (self.wall_us_per_step / self.unprofiled_us_per_step
                                  if self.unprofiled_us_per_step else None),
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
            out["copies"] = [g.to_dict() for g in a.copies]
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
    queued = s.launch_delay_median_us > HOST_AHEAD_DELAY * max(s.median_kernel_us, 1.0)
    launch_delay = (f"launch delay median {s.launch_delay_median_us:.1f} us (call to kernel start"
                    + ("; the host runs ahead and the work waits in the GPU's queue" if queued else "") + ")"
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
    busy = s.parts["compute"] + s.parts["memory"] + s.parts["copies"] + s.parts.get("communication", 0.0)
    for bound, pct in (("compute", s.compute_pct), ("memory", s.memory_pct)):
        share = s.parts[bound] / busy if busy else 0.0
        evidence.append(f"{bound}-bound kernels: {100 * share:.0f}% of GPU busy time{_ceiling_text(s, c, bound, pct)}")
    if "communication" in b:
        comm = b["communication"]
        evidence.append(f"communication (NCCL kernels): {comm['calls']:g} per step, {comm['us']:.0f} us per step, "
                        f"{100 * comm['us'] / busy if busy else 0.0:.0f}% of GPU busy time")
    return evidence


def _ceiling_text(s: StepSummary, c: Ceilings, bound: str, pct: float | None) -> str:
    """ " at N% of the ... ceiling (source)", naming each precision's ceiling for compute-bound matrix kernels."""
    if pct is None:
        return ""
    if bound == "memory":
        return f" at {pct:.0f}% of the {c.copy_bandwidth_gbs:g} GB/s copy ceiling ({c.source})"
    scaled = sorted(p for p in s.compute_ceilings if p not in ("bf16", "fp16"))
    ceilings = ", ".join(f"{s.compute_ceilings[p]:.4g} TFLOP/s {p}" for p in scaled)
    if not scaled:
        return f" at {pct:.0f}% of the {c.bf16_tflops:g} TFLOP/s bf16 ceiling ({c.source})"
    return f" at {pct:.0f}% of their ceilings ({ceilings}: {RATIO_SOURCE}, {c.bf16_tflops:g} TFLOP/s bf16 from {c.source})"


def _sync_line_note(analysis: Analysis) -> str | None:
    approximate = {s.source for step in analysis.syncs for s in step if s.source and not s.source_exact}
    if not approximate:
        return None
    return ("sync lines from the trace's stacks are the profiler's: the line a function starts on (line 0 for a "
            "script's top level), not the statement; `fuselab doctor SCRIPT` records each sync's exact line")


def verdict_for(analysis: Analysis, batch_test: dict | None = None, unprofiled_us: float | None = None) -> Diagnosis:
    """Decide what bounds the analyzed steps and what to do about it.

    `unprofiled_us` is the step's time measured without the profiler; given, the step is judged
    against it rather than against the profiled step, whose host time the profiler inflates.
    """
    s = summarize(analysis, unprofiled_us)
    finding = judge(s, batch_test)
    evidence = _summary_evidence(s, analysis.ceilings) + list(finding.evidence)
    profiled = judge(summarize(analysis), batch_test).verdict if unprofiled_us is not None else None
    if profiled is not None and profiled != finding.verdict:
        evidence.append(f"as profiled the step would read {profiled}; without the profiler it is {finding.verdict}, "
                        "and the verdict is the unprofiled one")
    evidence += [line for line in (copies_evidence(analysis.copies, s.wall_us), _sync_line_note(analysis)) if line]
    return Diagnosis(
        verdict=finding.verdict, evidence=evidence,
        breakdown=s.breakdown, fixes=ranked_fixes(analysis, s, finding.verdict), steps=len(analysis.steps),
        kernels_per_step=s.kernels, syncs_per_step=s.syncs, gpu_busy_pct=s.busy_pct, wall_us_per_step=s.profiled_wall_us,
        graph_launches_per_step=s.graph_launches, graph_kernels_per_step=s.graph_kernels, unprofiled_us_per_step=unprofiled_us,
        profiled_verdict=profiled, batch_test=batch_test, analysis=analysis,
    )
