"""Find the sequences of consecutive elementwise/reduction kernels that recur, and what would fuse them.

Each such kernel reads its input from memory and writes its output back, and costs a launch; a
chain of them that one kernel could do (an unfused RMSNorm runs pow -> mean -> add -> rsqrt ->
mul -> mul) pays both n times. Sequences are n-grams of kernel labels (the launching op's name, or
the kernel's short name) within runs of consecutive fusable kernels on one stream of one step;
matrix multiplies, attention and copies break a run, since no elementwise kernel absorbs them.
Kernels replayed from a CUDA graph break a run too: their launches are already gone, and a
graph's node list (GEMMs and fused kernels alike, named only by kernel) says too little to fuse by.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

from fuselab.doctor.roofline import ATTENTION_BHLE, ATTENTION_BLHE
from fuselab.doctor.trace import CpuOp, GpuEvent

MIN_LENGTH, MAX_LENGTH = 2, 10
TOP = 5
_UNFUSABLE_OPS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_scaled_mm", "convolution", "conv2d"} | ATTENTION_BHLE | ATTENTION_BLHE
# "nvjet": cuBLAS's GEMM kernels on Hopper, named without "gemm".
_UNFUSABLE_KERNELS = re.compile(r"gemm|xmma|cutlass|wgmma|nvjet|flash|fmha|conv", re.IGNORECASE)
_TEMPLATE = re.compile(r"<[^<>]*>")

SMALL_KERNEL_US = 10.0  # below this a kernel's cost is mostly its launch, which a CUDA graph removes
GRAPH_FIX = "capture the step in a CUDA graph: fuselab.graphs.graphed(step_fn) (one launch for the whole sequence)"
ONE_KERNEL_FIX = "one fused kernel (torch.compile or a Triton kernel; no fuselab kernel covers this sequence)"


@dataclass
class FusionCandidate:
    labels: tuple[str, ...]
    count: int  # occurrences over the analyzed steps
    total_us: float  # first kernel start to last kernel end, summed over occurrences
    kernels_us: float  # kernel time alone, summed over occurrences
    fix: str

    def to_dict(self) -> dict:
        return {"sequence": " -> ".join(self.labels), "count": self.count, "total_us": self.total_us,
                "kernels_us": self.kernels_us, "fix": self.fix}


def kernel_label(event: GpuEvent, op: CpuOp | None) -> str:
    """A short name for matching: the launching op ("pow"), else the kernel's own name without templates."""
    if op is not None:
        return op.name.removeprefix("aten::")
    if event.kind != "kernel":
        return event.name
    name = event.name.removeprefix("void ")
    while _TEMPLATE.search(name):
        name = _TEMPLATE.sub("", name)
    return name.split("(")[0].split("::")[-1] or event.name


def _fusable(event: GpuEvent, label: str) -> bool:
    return event.kind == "kernel" and label not in _UNFUSABLE_OPS and not _UNFUSABLE_KERNELS.search(event.name)


def fix_for(labels: tuple[str, ...], mean_kernel_us: float) -> str:
    """The fuselab kernel that replaces a sequence, judged from the ops in it; else graph capture for
    small kernels (their cost is launching) or one fused kernel for large ones (their cost is memory traffic)."""
    ops = set(labels)
    if {"pow", "mean", "rsqrt"} <= ops or "rms_norm" in ops or "_fused_rms_norm" in ops:
        return "fuselab.kernels.rms_norm (one kernel; a residual add before it fuses in too)"
    if "silu" in ops and "mul" in ops:
        return "fuselab.kernels.swiglu (silu(gate) * up in one kernel)"
    if {"native_layer_norm", "layer_norm"} & ops or {"mean", "sub", "rsqrt"} <= ops or "var_mean" in ops:
        return "fuselab.kernels.layer_norm"
    if {"_log_softmax", "log_softmax"} & ops and {"nll_loss_forward", "nll_loss", "nll_loss_nd"} & ops:
        return "fuselab.kernels.cross_entropy (no logits-sized intermediate)"
    if {"_softmax", "softmax"} & ops or {"amax", "exp", "sum", "div"} <= ops:
        return "fuselab.kernels.softmax"
    if {"neg", "cat", "mul", "add"} <= ops:
        return "fuselab.kernels.apply_rope (rotary embedding in one kernel)"
    return GRAPH_FIX if mean_kernel_us < SMALL_KERNEL_US else ONE_KERNEL_FIX


def _runs(members: list[list[int]], events: list[GpuEvent], fusable: list[bool]) -> list[list[int]]:
    """Maximal runs of consecutive fusable kernels, per step and stream, as lists of event indices."""
    runs = []
    for indices in members:
        by_stream: dict[tuple[int, int], list[int]] = {}
        for i in indices:
            by_stream.setdefault((events[i].device, events[i].stream), []).append(i)
        for stream_indices in by_stream.values():
            run: list[int] = []
            for i in stream_indices:
                if fusable[i]:
                    run.append(i)
                    continue
                if len(run) >= MIN_LENGTH:
                    runs.append(run)
                run = []
            if len(run) >= MIN_LENGTH:
                runs.append(run)
    return runs


def _count_sequences(runs: list[list[int]], events: list[GpuEvent], ids: list[int]) -> tuple[Counter, Counter, Counter]:
    """Per sequence of label ids: its occurrences, their first-start-to-last-end time, and their kernel time."""
    counts: Counter = Counter()
    span_us: Counter = Counter()
    kernel_us: Counter = Counter()
    for run in runs:
        run_ids = [ids[i] for i in run]
        starts = [events[i].ts for i in run]
        ends = [events[i].end for i in run]
        elapsed = [0.0]  # prefix sums of kernel durations
        for i in run:
            elapsed.append(elapsed[-1] + events[i].dur)
        next_free: dict[tuple, int] = {}  # occurrences of one sequence in a run do not overlap
        for n in range(MIN_LENGTH, min(MAX_LENGTH, len(run)) + 1):
            for start in range(len(run) - n + 1):
                key = tuple(run_ids[start:start + n])
                if start < next_free.get(key, 0):
                    continue
                next_free[key] = start + n
                counts[key] += 1
                span_us[key] += ends[start + n - 1] - starts[start]
                kernel_us[key] += elapsed[start + n] - elapsed[start]
    return counts, span_us, kernel_us


def _most_costly(counts: Counter, span_us: Counter) -> list[tuple]:
    """The recurring sequences that take the most time, at most TOP, none inside another."""
    chosen: list[tuple] = []
    # A sequence that recurs is worth the time it takes; a longer one that recurs as often covers its parts.
    for key in sorted((k for k, c in counts.items() if c >= 2), key=lambda k: (-span_us[k], -len(k))):
        if any(_contains(big, key) or _contains(key, big) for big in chosen):
            continue
        chosen.append(key)
        if len(chosen) == TOP:
            break
    return chosen


def fusion_candidates(members: list[list[int]], events: list[GpuEvent], labels: list[str],
                      replayed: list[bool]) -> list[FusionCandidate]:
    """The most time-consuming recurring sequences of individually launched kernels, longest first among
    overlapping ones, at most TOP."""
    vocabulary: dict[str, int] = {}
    ids = [vocabulary.setdefault(label, len(vocabulary)) for label in labels]
    fusable = [_fusable(e, label) and not from_graph for e, label, from_graph in zip(events, labels, replayed)]
    counts, span_us, kernel_us = _count_sequences(_runs(members, events, fusable), events, ids)
    names = list(vocabulary)
    out = []
    for key in _most_costly(counts, span_us):
        label_names = tuple(names[i] for i in key)
        mean_kernel = kernel_us[key] / (counts[key] * len(key))
        out.append(FusionCandidate(label_names, counts[key], span_us[key], kernel_us[key], fix_for(label_names, mean_kernel)))
    return out


def _contains(outer: tuple, inner: tuple) -> bool:
    n = len(inner)
    return any(outer[i:i + n] == inner for i in range(len(outer) - n + 1))
