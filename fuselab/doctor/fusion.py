"""Find the chains of kernels that recur, each reported once, with the fix that removes it (chains.py).

Each elementwise/reduction kernel reads its input from memory and writes its output back, and costs
a launch; a chain of them that one kernel could do (an unfused RMSNorm runs pow -> mean -> add ->
rsqrt -> mul -> mul) pays both n times. Sequences are n-grams of kernel labels (the launching op's
name, or the kernel's short name) within runs of consecutive fusable kernels on one stream of one
step; matrix multiplies, attention and copies break a run, since no elementwise kernel absorbs
them. Kernels replayed from a CUDA graph break a run too: their launches are already gone, and a
graph's node list (GEMMs and fused kernels alike, named only by kernel) says too little to fuse by.
So does the start or end of an optimizer's step: its update is fused by a fused optimizer, the
backward pass before it by other means, and a chain across the two is neither's.

Hand-written attention (matmul -> softmax -> matmul) is found first, around the matmuls. Then the
sequences are chosen one at a time, costliest first, each claiming the kernels of its occurrences:
a kernel belongs to at most one reported chain, so a periodic run (an optimizer's update repeated
for every parameter) is reported once, not once per rotation, and no two chains claim the same time.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

from fuselab.doctor.chains import ATTENTION_FIX, attention_matches, fix_for
from fuselab.doctor.roofline import ATTENTION_BHLE, ATTENTION_BLHE
from fuselab.doctor.trace import CpuOp, GpuEvent

MIN_LENGTH, MAX_LENGTH = 2, 10
TOP = 5
_UNFUSABLE_OPS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_scaled_mm", "convolution", "conv2d"} | ATTENTION_BHLE | ATTENTION_BLHE
# "nvjet": cuBLAS's GEMM kernels on Hopper, named without "gemm".
_UNFUSABLE_KERNELS = re.compile(r"gemm|xmma|cutlass|wgmma|nvjet|flash|fmha|conv", re.IGNORECASE)
_TEMPLATE = re.compile(r"<[^<>]*>")


@dataclass
class FusionCandidate:
    labels: tuple[str, ...]
    count: int  # occurrences over the analyzed steps
    total_us: float  # first kernel start to last kernel end, summed over blocks of back-to-back occurrences
    kernels_us: float  # kernel time alone, summed over occurrences (for attention: the kernels on the scores)
    fix: str
    rule: str = "fusion"  # which fix: "optimizer", "kernel:rms_norm", "attention", "graph", "fusion"
    optimizer: str | None = None  # the optimizer whose step launched it

    def saving_us(self, idle_scale: float) -> float:
        """Time the fix removes, over all occurrences: the idle between the chain's kernels (idle shrinks
        without the profiler by idle_scale) and, for a fused chain, all but one kernel's worth of memory
        passes; attention's fix removes the kernels on the scores outright."""
        idle = (self.total_us - self.kernels_us) * idle_scale
        kept = 0.0 if self.rule == "attention" else self.kernels_us / len(self.labels)
        return idle + self.kernels_us - kept

    def to_dict(self) -> dict:
        return {"sequence": " -> ".join(self.labels), "count": self.count, "total_us": self.total_us,
                "kernels_us": self.kernels_us, "fix": self.fix, "rule": self.rule, "optimizer": self.optimizer}


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


def _runs(members: list[list[int]], events: list[GpuEvent], fusable: list[bool],
          optimizer: list[str | None]) -> list[list[int]]:
    """Maximal runs of consecutive fusable kernels launched by one optimizer's step (or outside any), per step
    and stream, as lists of event indices."""
    runs = []
    for indices in members:
        by_stream: dict[tuple[int, int], list[int]] = {}
        for i in indices:
            by_stream.setdefault((events[i].device, events[i].stream), []).append(i)
        for stream_indices in by_stream.values():
            run: list[int] = []
            for i in stream_indices:
                if run and optimizer[i] != optimizer[run[-1]]:
                    if len(run) >= MIN_LENGTH:
                        runs.append(run)
                    run = []
                if fusable[i]:
                    run.append(i)
                    continue
                if len(run) >= MIN_LENGTH:
                    runs.append(run)
                run = []
            if len(run) >= MIN_LENGTH:
                runs.append(run)
    return runs


def _occurrences(ids: list[int], key: tuple) -> list[int]:
    """Start positions of the non-overlapping occurrences of key in ids, left to right."""
    n, out, pos = len(key), [], 0
    while pos + n <= len(ids):
        if tuple(ids[pos:pos + n]) == key:
            out.append(pos)
            pos += n
        else:
            pos += 1
    return out


def _run_counts(run: list[int], events: list[GpuEvent], ids: list[int]) -> dict[tuple, list[float]]:
    """Per sequence of label ids in one run: [occurrences, their first-start-to-last-end time, their kernel time]."""
    out: dict[tuple, list[float]] = {}
    run_ids = [ids[i] for i in run]
    starts = [events[i].ts for i in run]
    ends = [events[i].end for i in run]
    elapsed = [0.0]  # prefix sums of kernel durations
    for i in run:
        elapsed.append(elapsed[-1] + events[i].dur)
    for n in range(MIN_LENGTH, min(MAX_LENGTH, len(run)) + 1):
        next_free: dict[tuple, int] = {}  # occurrences of one sequence in a run do not overlap
        # zip over shifted copies builds every n-gram of the run in one pass (in C)
        for start, key in enumerate(zip(*(run_ids[j:] for j in range(n)))):
            if start < next_free.get(key, 0):
                continue
            next_free[key] = start + n
            span, kernels = ends[start + n - 1] - starts[start], elapsed[start + n] - elapsed[start]
            entry = out.get(key)
            if entry is None:
                out[key] = [1, span, kernels]
            else:
                entry[0] += 1
                entry[1] += span
                entry[2] += kernels
    return out


class _Tally:
    """The counts of every sequence over a set of runs, kept up to date as runs are cut."""

    def __init__(self, runs: list[list[int]], events: list[GpuEvent], ids: list[int]) -> None:
        self.events, self.ids = events, ids
        self.runs = runs
        self.totals: dict[tuple, list[float]] = {}  # sequence -> [occurrences, span us, kernel us]
        for run in runs:
            self._add(run, +1)

    def _add(self, run: list[int], sign: int) -> None:
        totals = self.totals
        for key, (count, span, kernels) in _run_counts(run, self.events, self.ids).items():
            entry = totals.get(key)
            if entry is None:
                totals[key] = [sign * count, sign * span, sign * kernels]
                continue
            entry[0] += sign * count
            entry[1] += sign * span
            entry[2] += sign * kernels
            if entry[0] <= 0:
                del totals[key]  # no run holds it any more

    def best(self) -> tuple | None:
        """The recurring sequence that takes the most time (the longer one among equals)."""
        keys = [k for k, entry in self.totals.items() if entry[0] >= 2]
        return max(keys, key=lambda k: (self.totals[k][1], len(k)), default=None)

    def _cut(self, run: list[int], found: list[int], n: int) -> tuple[float, float, list[list[int]]]:
        """The block and kernel time of the occurrences at `found` in run, and the pieces of run around them."""
        block_us = kernels_us = 0.0
        block_start = None
        for pos, p in enumerate(found):
            kernels_us += sum(self.events[run[p + j]].dur for j in range(n))
            block_start = p if block_start is None else block_start
            if pos + 1 == len(found) or found[pos + 1] != p + n:  # a block of back-to-back occurrences ends
                block_us += self.events[run[p + n - 1]].end - self.events[run[block_start]].ts
                block_start = None
        pieces, cursor = [], 0
        for p in found + [len(run)]:
            if p - cursor >= MIN_LENGTH:
                pieces.append(run[cursor:p])
            cursor = p + n
        return block_us, kernels_us, pieces

    def claim(self, key: tuple) -> tuple[int, float, float, list[int]]:
        """Cut the occurrences of key out of the runs; its count, block time, kernel time and each
        occurrence's first kernel."""
        count, block_us, kernels_us = 0, 0.0, 0.0
        firsts: list[int] = []
        kept: list[list[int]] = []
        for run in self.runs:
            run_ids = [self.ids[i] for i in run]
            found = _occurrences(run_ids, key) if key[0] in run_ids else []
            if not found:
                kept.append(run)
                continue
            self._add(run, -1)
            run_block, run_kernels, pieces = self._cut(run, found, len(key))
            count, block_us, kernels_us = count + len(found), block_us + run_block, kernels_us + run_kernels
            firsts += [run[p] for p in found]
            for piece in pieces:
                self._add(piece, +1)
            kept += pieces
        self.runs = kept
        return count, block_us, kernels_us, firsts


def _attention_candidates(members, events, labels, replayed) -> tuple[list[FusionCandidate], set[int]]:
    """Hand-written attention, one candidate per distinct sequence, and the kernels on the scores it claims."""
    grouped: dict[tuple[str, ...], list] = {}
    claimed: set[int] = set()
    for m in attention_matches(members, events, labels, replayed):
        seq = tuple(labels[i] for i in [m.first, *m.between, m.second])
        grouped.setdefault(seq, []).append(m)
        claimed.update(m.between)
    out = []
    for seq, matches in grouped.items():
        # What the fix removes lies between the two matmuls, which flash attention still computes.
        total = sum(events[m.second].ts - events[m.first].end for m in matches)
        kernels = sum(events[i].dur for m in matches for i in m.between)
        out.append(FusionCandidate(seq, len(matches), total, kernels, ATTENTION_FIX, "attention"))
    return out, claimed


def _optimizer_for(firsts: list[int], optimizer: list[str | None]) -> str | None:
    """The optimizer whose step launched most of a chain's occurrences (each launched by one: runs do not
    cross a step's bounds), if one launched most of them."""
    found = Counter(optimizer[i] for i in firsts)
    name, count = max(found.items(), key=lambda kv: kv[1], default=(None, 0))
    return name if name is not None and count * 2 > sum(found.values()) else None


def fusion_candidates(members: list[list[int]], events: list[GpuEvent], labels: list[str],
                      replayed: list[bool], optimizer: list[str | None] | None = None) -> list[FusionCandidate]:
    """The most time-consuming recurring chains of individually launched kernels, at most TOP, no two
    sharing a kernel; `optimizer` (aligned with events) names the optimizer whose step launched each."""
    optimizer = optimizer or [None] * len(events)
    out, on_scores = _attention_candidates(members, events, labels, replayed)
    vocabulary: dict[str, int] = {}
    ids = [vocabulary.setdefault(label, len(vocabulary)) for label in labels]
    fusable = [_fusable(e, label) and not from_graph and i not in on_scores
               for i, (e, label, from_graph) in enumerate(zip(events, labels, replayed))]
    tally = _Tally(_runs(members, events, fusable, optimizer), events, ids)
    names = list(vocabulary)
    while len(out) < TOP:
        key = tally.best()
        if key is None:
            break
        count, block_us, kernels_us, firsts = tally.claim(key)
        label_names = tuple(names[i] for i in key)
        owner = _optimizer_for(firsts, optimizer)
        chain = fix_for(label_names, kernels_us / (count * len(key)), owner)
        out.append(FusionCandidate(label_names, count, block_us, kernels_us, chain.action, chain.rule, owner))
    return out
