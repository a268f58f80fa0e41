"""The rules that decide what bounds a step, one function per finding.

The verdict rules, in order; the first that finds something decides:
0. `copies_dominate`: copies between host and device (or device to device) take at least
   COPY_SHARE of the step and more of it than any other part: the step is copy-bound, whatever the
   idle around them (a pageable copy keeps the host waiting while the driver stages it);
1. `gpu_idles`: the GPU idles for at least IDLE_SHARE of the step: it is sync-bound when the idle
   follows syncs more than launches; else launch-bound when the host, its sync waits aside, takes at
   least as long to issue a step's work as the GPU takes to run it; else the host runs ahead and the
   idle is only each step starting on an empty queue (after the step-boundary wait): the kernels decide;
2. `tiny_kernels`: individually launched kernels are tiny (median under TINY_KERNEL_US, many per
   step): their time is the fixed cost of a launch, so the step is launch-bound even when they run
   back to back; kernels replayed from a CUDA graph do not count, their launches are already gone;
3. `kernels_decide`: compute- or memory-bound by where the kernels' time goes on the roofline.
Then `lone_host_stall` names the host op behind a launch-bound verdict when one held the GPU idle
for much of a step, and `batch_test_verdict` (time at 10x the batch nearly unchanged) turns a
kernel-bound verdict into launch-bound unless the GPU was kept busy, in which case the fixed cost
is kernel work (reading weights) and the verdict stands.
"""

from __future__ import annotations

from dataclasses import dataclass

from fuselab.doctor.summary import StepSummary

IDLE_SHARE = 0.30
COPY_SHARE = 0.30
TINY_KERNEL_US = 5.0
TINY_KERNEL_MIN_COUNT = 20
FLAT_BATCH_RATIO = 1.5  # time at 10x the batch over time at 1x, below which the step does not scale
BUSY_FOR_BATCH_TEST = 90.0  # % GPU busy above which a flat batch test means kernel work, not launches
LONE_STALL_SHARE = 0.25  # one launch gap this much of the step is a host stall worth naming


@dataclass(frozen=True)
class Finding:
    verdict: str
    evidence: tuple[str, ...] = ()  # what the rule saw, beyond the summary's own evidence


def copies_dominate(s: StepSummary) -> Finding | None:
    copies = s.parts["copies"]
    if s.wall_us and copies >= COPY_SHARE * s.wall_us and all(copies >= v for k, v in s.parts.items() if k != "copies"):
        return Finding("copy-bound")
    return None


def gpu_idles(s: StepSummary) -> Finding | None:
    synced_idle = bool(s.syncs) and s.parts["sync_stalls"] >= s.parts["launch_gaps"]
    if s.idle_share >= IDLE_SHARE and (synced_idle or s.host_issue_us >= s.gpu_busy_us):
        return Finding("sync-bound" if synced_idle else "launch-bound")
    return None


def tiny_kernels(s: StepSummary) -> Finding | None:
    if s.median_launched_kernel_us < TINY_KERNEL_US and s.kernels - s.graph_kernels >= TINY_KERNEL_MIN_COUNT:
        which = "individually launched kernel" if s.graph_kernels else "kernel"
        return Finding("launch-bound", (f"median {which} {s.median_launched_kernel_us:.1f} us (< {TINY_KERNEL_US:g} us): "
                                        "kernels this short cost about what launching them does",))
    return None


def kernels_decide(s: StepSummary) -> Finding:
    # Copies count with the memory side: they move bytes and compute nothing.
    memory = s.parts["memory"] + s.parts["copies"]
    return Finding("compute-bound" if s.parts["compute"] >= memory else "memory-bound")


VERDICT_RULES = (copies_dominate, gpu_idles, tiny_kernels, kernels_decide)


def lone_host_stall(s: StepSummary, verdict: str) -> str | None:
    """Evidence naming the host op behind one long GPU wait of a launch-bound step."""
    gap_us, op = s.longest_launch_gap_us, s.stalled_in
    if verdict != "launch-bound" or op is None or gap_us < LONE_STALL_SHARE * s.profiled_wall_us:
        return None
    # One host op holding the GPU idle this long is not launch overhead, and a graph would hide
    # it only if the op's host work can be captured: name it.
    return (f"one GPU wait of {gap_us:.0f} us ({100 * gap_us / s.profiled_wall_us:.0f}% of a profiled step) passed almost all "
            f"inside host op {op.name}, which ran {op.dur:.0f} us")


def batch_test_verdict(s: StepSummary, verdict: str, test: dict) -> Finding:
    """The verdict in the light of a batch test, with what the test showed."""
    ratio = test["ratio"]
    flat = ratio < FLAT_BATCH_RATIO
    line = (f"batch test: {test['factor']}x the batch took {ratio:.2f}x the time"
            + (" (does not scale with the batch: a fixed cost per step)" if flat else ""))
    if flat and verdict in ("memory-bound", "compute-bound") and s.busy_pct < BUSY_FOR_BATCH_TEST:
        verdict = "launch-bound"
    return Finding(verdict, (line,))


def judge(s: StepSummary, test: dict | None = None) -> Finding:
    """The verdict on a step and the evidence the rules add for it."""
    found = next(f for f in (rule(s) for rule in VERDICT_RULES) if f is not None)
    evidence = list(found.evidence)
    stall = lone_host_stall(s, found.verdict)
    if stall is not None:
        evidence.append(stall)
    verdict = found.verdict
    if test is not None:
        tested = batch_test_verdict(s, verdict, test)
        verdict = tested.verdict
        evidence += tested.evidence
    return Finding(verdict, tuple(evidence))
