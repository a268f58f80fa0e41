"""Time by region, in the user's own names: record_function ranges, and forward / backward / optimizer
down the nn.Module tree, layer by layer.

Each GPU event of the analyzed steps is charged to the host ranges open where it was launched:
at its launch call (linked by correlation id; a graph replay's kernels all by their one graph
launch), else at its launching op. Work that a backward op launches is charged to the module
whose forward op recorded the same autograd sequence number, so backward time splits by layer
too. The phase is "optimizer" inside the `Optimizer.step#...` / `Optimizer.zero_grad#...` ranges
that torch.optim records, "backward" inside an autograd engine op, "forward" otherwise. Modules
are the "nn.Module: Linear_0" frames the profiler records along with Python stacks.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Callable, Iterable

from fuselab.doctor.analyze import Analysis
from fuselab.doctor.syncs import STEP_BOUNDARY
from fuselab.doctor.trace import STEP_PREFIX, CpuOp

MODULE_PREFIX = "nn.Module: "
BACKWARD_PREFIX = "autograd::engine::evaluate_function: "
OPTIMIZER_PREFIX = "Optimizer."
PHASES = ("forward", "backward", "optimizer")
UNATTRIBUTED = "(launch not recorded)"


@dataclass
class Region:
    path: tuple[str, ...]  # outermost first: ("forward", "GPT_0", "Block_0", "Linear_0"), ("train_step", "loss")
    gpu_us_per_step: float  # GPU time of the work launched inside it, its sub-regions' included
    kernels_per_step: float
    share: float  # of the analyzed steps' GPU time
    host_us_per_step: float | None = None  # how long the range itself was open on the host

    def to_dict(self) -> dict:
        return {"path": list(self.path), "gpu_us_per_step": self.gpu_us_per_step,
                "kernels_per_step": self.kernels_per_step, "share": self.share,
                "host_us_per_step": self.host_us_per_step}


@dataclass
class Regions:
    phases: list[Region]  # forward, backward, optimizer (those that ran), and work whose launch is unknown
    modules: list[Region]  # (phase, module, submodule, ...), parents before children, in the order they ran
    ranges: list[Region]  # record_function ranges by nesting, in the same order

    def to_dict(self) -> dict:
        return {part: [r.to_dict() for r in getattr(self, part)] for part in ("phases", "modules", "ranges")}


class _Nest:
    """Host spans (anything with name, ts, dur and tid) nested per thread, each with its path of names."""

    def __init__(self, spans: list, name_of=lambda s: s.name):
        self.spans = spans
        self.parent: list[int | None] = [None] * len(spans)
        self.paths: list[tuple[str, ...]] = [()] * len(spans)
        self.starts: dict[int, tuple[list[float], list[int]]] = {}
        by_tid: dict[int, list[int]] = {}
        for i, s in enumerate(spans):
            by_tid.setdefault(s.tid, []).append(i)
        for tid, indices in by_tid.items():
            indices.sort(key=lambda i: (spans[i].ts, -spans[i].dur))  # a parent before the child that starts with it
            stack: list[int] = []
            for i in indices:
                while stack and spans[stack[-1]].ts + spans[stack[-1]].dur < spans[i].ts:
                    stack.pop()
                self.parent[i] = stack[-1] if stack else None
                self.paths[i] = (self.paths[stack[-1]] if stack else ()) + (name_of(spans[i]),)
                stack.append(i)
            self.starts[tid] = ([spans[i].ts for i in indices], indices)

    def innermost(self, tid: int, t: float) -> int | None:
        """The index of the innermost span of thread `tid` open at time t."""
        times, order = self.starts.get(tid, ((), ()))
        pos = bisect.bisect_right(times, t) - 1
        index = order[pos] if pos >= 0 else None
        while index is not None and not self.spans[index].ts <= t <= self.spans[index].ts + self.spans[index].dur:
            index = self.parent[index]
        return index

    def path_at(self, tid: int, t: float) -> tuple[str, ...]:
        index = self.innermost(tid, t)
        return () if index is None else self.paths[index]


class _Attribution:
    """Where in the user's names a host moment (thread, time) is: phase, module path, range path."""

    def __init__(self, a: Analysis):
        trace = a.trace
        self.ranges = _Nest([s for s in trace.annotations
                             if not s.name.startswith(STEP_PREFIX) and s.name != STEP_BOUNDARY])
        self.modules = _Nest([f for f in trace.py_frames if f.name.startswith(MODULE_PREFIX)],
                             name_of=lambda f: f.name.removeprefix(MODULE_PREFIX))
        self.backward = _Nest([op for op in trace.cpu_ops if op.name.startswith(BACKWARD_PREFIX)])
        forward_ops: dict[int, list[CpuOp]] = {}
        for op in trace.cpu_ops:  # in start order within each thread; sorted by time below
            if op.sequence is not None and not op.name.startswith(BACKWARD_PREFIX):
                forward_ops.setdefault(op.sequence, []).append(op)
        self.forward_ops = {seq: sorted(ops, key=lambda op: op.ts) for seq, ops in forward_ops.items()}

    def _forward_op(self, backward: CpuOp) -> CpuOp | None:
        """The latest forward op before `backward` with its sequence number: the op whose gradient it computes."""
        ops = self.forward_ops.get(backward.sequence) if backward.sequence is not None else None
        if not ops:
            return None
        pos = bisect.bisect_right([op.ts for op in ops], backward.ts) - 1
        return ops[pos] if pos >= 0 else None

    def at(self, tid: int, t: float) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
        ranges = self.ranges.path_at(tid, t)
        if any(name.startswith(OPTIMIZER_PREFIX) for name in ranges):
            return "optimizer", self.modules.path_at(tid, t), ranges
        index = self.backward.innermost(tid, t)
        if index is None:
            return "forward", self.modules.path_at(tid, t), ranges
        forward = self._forward_op(self.backward.spans[index])
        return "backward", self.modules.path_at(forward.tid, forward.ts) if forward else (), ranges


def _prefixes(path: tuple[str, ...]) -> Iterable[tuple[str, ...]]:
    return (path[:n] for n in range(1, len(path) + 1))


def _in_steps(a: Analysis) -> Callable[[float], bool]:
    starts = [s.start for s in a.steps]

    def inside(t: float) -> bool:
        pos = bisect.bisect_right(starts, t) - 1
        return pos >= 0 and t <= a.steps[pos].end
    return inside


class _Tally:
    """GPU us, kernels and host us per region path, with the order each path was first seen."""

    def __init__(self) -> None:
        self.gpu: dict[tuple[str, ...], float] = {}
        self.kernels: dict[tuple[str, ...], int] = {}
        self.host: dict[tuple[str, ...], float] = {}
        self.rank: dict[tuple[str, ...], int] = {}

    def _see(self, path: tuple[str, ...]) -> None:
        self.rank.setdefault(path, len(self.rank))

    def add_gpu(self, path: tuple[str, ...], us: float, kernel: bool) -> None:
        for prefix in _prefixes(path):
            self._see(prefix)
            self.gpu[prefix] = self.gpu.get(prefix, 0.0) + us
            self.kernels[prefix] = self.kernels.get(prefix, 0) + kernel

    def add_host(self, path: tuple[str, ...], us: float) -> None:
        for prefix in _prefixes(path):
            self._see(prefix)
        self.host[path] = self.host.get(path, 0.0) + us

    def regions(self, n_steps: int, gpu_us: float, host_known: bool) -> list[Region]:
        """Parents before children, siblings in the order they first ran."""
        order = sorted(self.rank, key=lambda p: tuple(self.rank[q] for q in _prefixes(p)))
        return [Region(p, self.gpu.get(p, 0.0) / n_steps, self.kernels.get(p, 0) / n_steps,
                       self.gpu.get(p, 0.0) / gpu_us if gpu_us else 0.0,
                       self.host[p] / n_steps if p in self.host else (0.0 if host_known else None)) for p in order]


def regions(a: Analysis) -> Regions:
    """The analyzed steps' GPU time by phase, by module and by record_function range."""
    where = _Attribution(a)
    call_of = {r.correlation: r for r in a.trace.runtime if r.correlation is not None}
    phases, modules, ranges = _Tally(), _Tally(), _Tally()
    total = 0.0
    for indices in a.step_events:
        for i in indices:
            g = a.trace.gpu[i]
            total += g.dur
            call = call_of.get(g.correlation)
            host = call or a.trace.op_for(g.external_id)
            kernel = g.kind == "kernel"
            if host is None:
                phases.add_gpu((UNATTRIBUTED,), g.dur, kernel)
                continue
            phase, module_path, range_path = where.at(host.tid, host.ts)
            phases.add_gpu((phase,), g.dur, kernel)
            modules.add_gpu((phase,) + module_path, g.dur, kernel)
            if range_path:
                ranges.add_gpu(range_path, g.dur, kernel)
    inside = _in_steps(a)
    for index, span in enumerate(where.ranges.spans):
        if inside(span.ts):
            ranges.add_host(where.ranges.paths[index], span.dur)
    for index, frame in enumerate(where.modules.spans):
        if inside(frame.ts):
            phase, _, _ = where.at(frame.tid, frame.ts)
            modules.add_host((phase,) + where.modules.paths[index], frame.dur)
    n = max(len(a.steps), 1)
    module_rows = [r for r in modules.regions(n, total, host_known=False) if len(r.path) > 1]
    phase_rows = sorted(phases.regions(n, total, host_known=False),
                        key=lambda r: PHASES.index(r.path[0]) if r.path[0] in PHASES else len(PHASES))
    return Regions(phase_rows, module_rows, ranges.regions(n, total, host_known=True))
