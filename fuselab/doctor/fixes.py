"""The fixes for a judged step, each with the time it would save, largest saving first.

Each fix claims only time it removes, from the parts of the step's breakdown it removes it from: a
sync site its share of the sync stalls, graph capture the launch gaps before individually launched
work (the GPU waiting for a graph replay to be launched calls for less host work around the replay
instead), a chain the idle between its kernels and all but one kernel's worth of their memory time
(each kernel belongs to one chain), a lower precision the GEMM time it saves, pinned memory the copy
time it saves. Fixes can overlap (graph capture and a fused chain both remove the chain's launch
gaps). So the fixes are ranked by what each would save alone (`alone_us`), and each one's saving is
what it adds to the fixes above it, drawn from what they left of each part: a fix never claims more
than it removes, and together they never claim more than the step. A fix is listed when it would
save enough alone, however much of that the fixes above already take. A chain whose fix is graph
capture is the launch-gap fix itself, and is not listed again beside it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from fuselab.doctor.analyze import Analysis
from fuselab.doctor.chains import GRAPH_FIX
from fuselab.doctor.copies import pageable_fix_text, pinned_saving_us
from fuselab.doctor.precision import BF16_FIX, RATIO_SOURCE, TF32_FIX, lower_precision_saving
from fuselab.doctor.summary import StepSummary
from fuselab.doctor.syncs import BLOCKING_COPY_TO_GPU

MIN_SAVING_SHARE = 0.02  # fixes that would save less of the step than this are not worth listing
REPLAY_HOST_FIX = ("the step already replays from a CUDA graph, and the GPU waits for the host between replays: "
                   "trim the host work around each replay, or give each replay more work (a larger batch)")
OUTSIDE_GRAPH_FIX = "capture the kernels launched outside the CUDA graph with the rest of the step (one launch for all of it)"
APPROXIMATE_LINE = " (the profiler's line: where the function starts)"


# The pools of step time a fix can remove time from, by the breakdown parts they hold.
POOLS = {"compute": ("compute",), "memory": ("memory",), "copies": ("copies",), "idle": ("launch_gaps", "other_idle"),
         "sync_stalls": ("sync_stalls",)}
Claim = tuple[tuple[str, ...], float]  # (pools to draw from, in order; us per step)


@dataclass
class Fix:
    action: str
    saving_us: float  # estimated per step
    why: str
    rule: str = ""  # which finding it answers: "sync", "blocking-copy", "launch-gaps", "optimizer", "tf32", ...
    claims: list[Claim] | None = None  # where saving_us comes from; None: from the idle
    alone_us: float | None = None  # what it would save on its own, before the fixes above it take their part

    def claimed(self) -> list[Claim]:
        return self.claims if self.claims is not None else [(("idle",), self.saving_us)]

    def to_dict(self) -> dict:
        return {"action": self.action, "saving_us_per_step": self.saving_us, "alone_us_per_step": self.alone_us,
                "why": self.why, "rule": self.rule}


def sync_fixes(analysis: Analysis, stall_us: float) -> list[Fix]:
    """One fix per sync site, sharing the step's sync stalls among the sites by how often each syncs."""
    sites: dict[tuple[str, str | None, bool], list[float]] = defaultdict(list)
    for step_syncs in analysis.syncs:
        for s in step_syncs:
            sites[(s.cause, s.source, s.source_exact)].append(s.blocked_us)
    total = sum(len(v) for v in sites.values())
    n_steps = len(analysis.steps)
    fixes = []
    for (cause, source, exact), blocked in sites.items():
        where = f" at {source}{'' if exact else APPROXIMATE_LINE}" if source else ""
        per_step = len(blocked) / n_steps
        why = f"{per_step:g} per step, blocking the host {sum(blocked) / n_steps:.1f} us per step and draining the GPU queue each time"
        share = stall_us * len(blocked) / total
        if cause == BLOCKING_COPY_TO_GPU:
            fixes.append(Fix(f"copy without blocking{where}: from pinned memory (x.pin_memory(), once) with "
                             "x.to('cuda', non_blocking=True), so the host does not wait for the GPU to drain first",
                             share, why, "blocking-copy", [(("sync_stalls",), share)]))
            continue
        fixes.append(Fix(f"remove the {cause}{where} (keep the value on the GPU, or read it back once per step without blocking)",
                         share, why, "sync", [(("sync_stalls",), share)]))
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
                         f"the GPU waited {capture_gaps:.0f} us per step for the host to launch", "launch-gaps"))
    if replay_gaps > 0:
        fixes.append(Fix(REPLAY_HOST_FIX, replay_gaps, f"the GPU waited {replay_gaps:.0f} us per step for the host to launch the graph",
                         "graph-replay-host"))
    return fixes


def fusion_fixes(analysis: Analysis, idle_scale: float) -> list[Fix]:
    """One fix per chain: the known fix for it, else one kernel instead of n; one per optimizer for the
    chains of its step (a fused optimizer removes them all), named after the costliest."""
    n_steps = len(analysis.steps)
    fixes = []
    by_optimizer: dict[str, tuple[Fix, list[float]]] = {}  # optimizer -> its fix, [chains per step, us per step]
    for cand in analysis.fusion:
        per_step = (cand.kernels_us + (cand.total_us - cand.kernels_us) * idle_scale) / n_steps
        idle = (cand.total_us - cand.kernels_us) * idle_scale / n_steps
        kernels = cand.saving_us(idle_scale) / n_steps - idle
        if cand.rule == "optimizer" and cand.optimizer in by_optimizer:
            fix, totals = by_optimizer[cand.optimizer]
            totals[0] += cand.count / n_steps
            totals[1] += per_step
            fix.saving_us += idle + kernels
            fix.claims += [(("idle",), idle), (("memory", "compute"), kernels)]
            fix.why = f"{totals[0]:g} per step, {totals[1]:.0f} us per step, its other update chains included"
            continue
        what = f"{cand.optimizer}'s step: " if cand.optimizer else ""
        fix = Fix(f"{what}{' -> '.join(cand.labels)}: {cand.fix}", idle + kernels,
                  f"{cand.count / n_steps:g} per step, {per_step:.0f} us per step", cand.rule,
                  [(("idle",), idle), (("memory", "compute"), kernels)])
        if cand.rule == "optimizer" and cand.optimizer:
            by_optimizer[cand.optimizer] = (fix, [cand.count / n_steps, per_step])
        fixes.append(fix)
    return fixes


def precision_fixes(s: StepSummary) -> list[Fix]:
    """TF32 or bf16 for float32 GEMMs, bf16 for TF32 ones: the GEMM time saved at the same share of the faster ceiling."""
    fixes = []
    fp32_us, tf32_us = s.gemm_us.get("fp32", 0.0), s.gemm_us.get("tf32", 0.0)
    if fp32_us:
        tf32_gain, bf16_gain = lower_precision_saving(fp32_us, "fp32", "tf32"), lower_precision_saving(fp32_us, "fp32", "bf16")
        fixes.append(Fix(TF32_FIX, tf32_gain,
                         f"float32 matmuls take {fp32_us:.0f} us per step on the CUDA cores; TF32 would save ~{tf32_gain:.0f} us, "
                         f"bf16 ~{bf16_gain:.0f} us ({RATIO_SOURCE})", "tf32", [(("compute", "memory"), tf32_gain)]))
    if tf32_us:
        gain = lower_precision_saving(tf32_us, "tf32", "bf16")
        fixes.append(Fix(BF16_FIX, gain, f"TF32 matmuls take {tf32_us:.0f} us per step; bf16 runs twice as fast ({RATIO_SOURCE})",
                         "bf16", [(("compute", "memory"), gain)]))
    return fixes


def copy_fixes(analysis: Analysis) -> list[Fix]:
    """Pinned memory for each route that copies from or to pageable host memory."""
    return [Fix(pageable_fix_text(g), pinned_saving_us(g),
                f"{g.count:g} per step {g.label}, {g.bytes / 1e6:,.1f} MB at {g.gbs:.1f} GB/s; pinned memory copies "
                "at the link's rate and lets the host run on", "pageable-copy", [(("copies",), pinned_saving_us(g))])
            for g in analysis.copies if pinned_saving_us(g) > 0]


def compute_advice(s: StepSummary) -> Fix:
    """What is left to do for a compute-bound step: nothing from fusion or graphs; maybe reach the ceiling."""
    ceilings = ", ".join(f"{p} {t:g} TFLOP/s" for p, t in sorted(s.compute_ceilings.items())) or "bf16"
    reached = f" at {s.compute_pct:.0f}% of their ceiling ({ceilings})" if s.compute_pct is not None else ""
    advice = "nothing to gain from fusion or graphs: the step is compute-bound on large matrix multiplies" + reached
    if s.compute_pct is not None and s.compute_pct < 50:
        advice += "; they are well below it: use dimensions in multiples of 64, and larger matrices per call"
    return Fix(advice, 0.0, f"{100 * s.breakdown['compute']['share']:.0f}% of the step is compute-bound kernel time",
               "compute-advice", [], 0.0)


def _within_step(fixes: list[Fix], s: StepSummary) -> list[Fix]:
    """The fixes worth listing, ranked by what each saves alone, each saving what the fixes above it leave."""
    left = {pool: sum(s.parts[p] for p in parts) for pool, parts in POOLS.items()}
    kept = []
    for f in sorted(fixes, key=lambda f: -f.saving_us):
        if f.saving_us < MIN_SAVING_SHARE * s.wall_us:
            continue
        drawn = 0.0
        for pools, amount in f.claimed():
            for pool in pools:
                take = min(amount, left[pool])
                left[pool] -= take
                amount -= take
                drawn += take
        if drawn < f.saving_us - 1e-6:
            f.why += f"; {f.saving_us - drawn:.0f} us of the {f.saving_us:.0f} it saves alone the fixes above already take"
        f.alone_us, f.saving_us = f.saving_us, drawn
        kept.append(f)
    return kept


def ranked_fixes(analysis: Analysis, s: StepSummary, verdict: str) -> list[Fix]:
    """The fixes worth listing, by estimated saving; a compute-bound step's advice first."""
    launch = launch_fixes(s)
    chains = fusion_fixes(analysis, s.idle_scale)
    if any(f.rule == "launch-gaps" for f in launch):
        chains = [f for f in chains if f.rule != "graph"]
    candidates = sync_fixes(analysis, s.parts["sync_stalls"]) + launch + chains + precision_fixes(s) + copy_fixes(analysis)
    fixes = _within_step(candidates, s)
    if verdict == "compute-bound":
        fixes.insert(0, compute_advice(s))
    return fixes
