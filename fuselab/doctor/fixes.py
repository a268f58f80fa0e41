"""The fixes for a judged step, each with the time it would save, largest saving first.

Graph capture is offered only for the launch gaps before individually launched work; the GPU
waiting for a graph replay to be launched calls for less host work around the replay instead.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from fuselab.doctor.analyze import Analysis
from fuselab.doctor.fusion import GRAPH_FIX
from fuselab.doctor.summary import StepSummary

MIN_SAVING_SHARE = 0.02  # fixes that would save less of the step than this are not worth listing
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


def sync_fixes(analysis: Analysis, stall_us: float) -> list[Fix]:
    """One fix per sync site, sharing the step's sync stalls among the sites by how often each syncs."""
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


def launch_fixes(s: StepSummary) -> list[Fix]:
    """Graph capture for the waits before work launched one by one; less host work for the waits before replays."""
    # Graph capture removes only the waits for launches made one by one; waits for a graph launch,
    # and all waits of a step with nothing launched outside a graph, are host work around replays.
    replay_gaps = s.graph_launch_gap_us * s.idle_scale if s.launched_alone else s.parts["launch_gaps"]
    capture_gaps = s.parts["launch_gaps"] - replay_gaps
    fixes = []
    if capture_gaps > 0:
        after = " once the syncs are gone (capture forbids them)" if s.syncs else ""
        fixes.append(Fix((OUTSIDE_GRAPH_FIX if s.graph_kernels else GRAPH_FIX) + after, capture_gaps,
                         f"the GPU waited {capture_gaps:.0f} us per step for the host to launch"))
    if replay_gaps > 0:
        fixes.append(Fix(REPLAY_HOST_FIX, replay_gaps, f"the GPU waited {replay_gaps:.0f} us per step for the host to launch the graph"))
    return fixes


def fusion_fixes(analysis: Analysis, idle_scale: float) -> list[Fix]:
    """One fix per recurring kernel sequence: one kernel instead of n."""
    n_steps = len(analysis.steps)
    fixes = []
    for cand in analysis.fusion:
        # The idle between a sequence's kernels shrinks without the profiler as the step's idle does.
        per_step = (cand.kernels_us + (cand.total_us - cand.kernels_us) * idle_scale) / n_steps
        saving = per_step * (1 - 1 / len(cand.labels))
        fixes.append(Fix(f"{' -> '.join(cand.labels)}: {cand.fix}", saving,
                         f"{cand.count / n_steps:g} per step, {per_step:.0f} us per step"))
    return fixes


def compute_advice(s: StepSummary) -> Fix:
    """What is left to do for a compute-bound step: nothing from fusion or graphs; maybe reach the ceiling."""
    reached = f" at {s.compute_pct:.0f}% of the bf16 ceiling" if s.compute_pct is not None else ""
    advice = "nothing to gain from fusion or graphs: the step is compute-bound on large matrix multiplies" + reached
    if s.compute_pct is not None and s.compute_pct < 50:
        advice += "; they are well below the ceiling: use bf16 rather than fp32, and dimensions in multiples of 64"
    return Fix(advice, 0.0, f"{100 * s.breakdown['compute']['share']:.0f}% of the step is compute-bound kernel time")


def ranked_fixes(analysis: Analysis, s: StepSummary, verdict: str) -> list[Fix]:
    """The fixes worth listing, by estimated saving; a compute-bound step's advice first."""
    candidates = sync_fixes(analysis, s.parts["sync_stalls"]) + launch_fixes(s) + fusion_fixes(analysis, s.idle_scale)
    fixes = sorted((f for f in candidates if f.saving_us >= MIN_SAVING_SHARE * s.wall_us), key=lambda f: -f.saving_us)
    if verdict == "compute-bound":
        fixes.insert(0, compute_advice(s))
    return fixes
