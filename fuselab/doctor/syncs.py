"""Find the host-blocking calls in a trace, say what caused each one and where in the source it is.

A sync is a host API call that returns only when the GPU has caught up: explicit synchronize
calls, blocking copies, and copies to pageable host memory (what `.item()` and `.cpu()` do). The
calls one CPU op makes count as one sync: `.item()` issues an asynchronous copy into pinned memory
(which does not block by itself) and then a stream synchronize that waits for it, so the copy
belongs to that sync's round trip.

Where the trace holds the sync sites the doctor recorded while profiling (sync_sites.py), each
sync's source is the exact line of the statement; otherwise it is the profiler's approximation,
the line its function starts on (`source_exact` says which).
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass

from fuselab.doctor.sync_sites import SYNC_SITE
from fuselab.doctor.trace import GpuEvent, PyFrame, RuntimeCall, Span, Trace

SYNC_APIS = {
    "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
    "cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize",
}
BLOCKING_COPY_APIS = {"cudaMemcpy", "cuMemcpyDtoH", "cuMemcpyDtoH_v2"}
ASYNC_COPY_APIS = {"cudaMemcpyAsync", "cuMemcpyDtoHAsync", "cuMemcpyDtoHAsync_v2", "cuMemcpyAsync"}

# The doctor synchronizes at each step boundary so that steps do not overlap; those syncs are
# the profiler's, not the workload's, and are left out.
STEP_BOUNDARY = "fuselab.doctor.step_boundary"

_FRAME = re.compile(r"^(?P<file>.+)\((?P<line>\d+)\): (?P<function>.+)$")
_LIBRARY_MARKERS = ("/site-packages/", "/dist-packages/", "/lib/python")
_TENSOR_PRINT = re.compile(r"torch/_tensor_str\.py\(|torch/_tensor\.py\(\d+\): __(repr|str|format)__")

# ATen ops that force a sync, by what the user wrote; checked in this order on the ops enclosing the call.
_IMPLICIT_CAUSES = (
    ("aten::is_nonzero", "`if tensor:` (truth value of a GPU tensor)"),
    ("aten::item", "`.item()`"),
    ("aten::_local_scalar_dense", "`.item()`"),
    ("aten::nonzero", "`torch.nonzero` (output size depends on the data)"),
    ("aten::masked_select", "`tensor[mask]` / `masked_select` (output size depends on the data)"),
    ("aten::unique", "`torch.unique` (output size depends on the data)"),
    ("aten::_unique2", "`torch.unique` (output size depends on the data)"),
    ("aten::repeat_interleave", "`repeat_interleave` with tensor repeats (output size depends on the data)"),
)
_COPY_OPS = {"aten::to", "aten::_to_copy", "aten::copy_", "aten::cpu"}
BLOCKING_COPY_TO_GPU = "blocking copy to the GPU (`.to('cuda')` / `.cuda()` without non_blocking=True)"
# A sync site is recorded as its op returns to Python, within this many us of the sync's end.
SITE_DELAY_US = 5000.0


@dataclass
class Sync:
    api: str  # the host call(s) that blocked, e.g. "cudaMemcpyAsync+cudaStreamSynchronize"
    ts: float
    blocked_us: float
    tid: int
    cause: str  # what the user wrote, e.g. "`.item()`"
    # "file.py:LINE (function)" of the innermost user frame. Exact when recorded as a sync site; else
    # the profiler's, when stacks were recorded: the running line for frames already open when
    # recording began, but the function's first line for frames entered while it recorded.
    source: str | None
    correlations: tuple[int, ...] = ()  # of the op's blocking calls and host copies, linking it to the copies it waited for
    source_exact: bool = False

    @property
    def end(self) -> float:
        return self.ts + self.blocked_us

    def to_dict(self) -> dict:
        return {"api": self.api, "ts": self.ts, "blocked_us": self.blocked_us, "cause": self.cause, "source": self.source,
                "source_exact": self.source_exact}


def _is_blocking(call: RuntimeCall, copy: GpuEvent | None) -> bool:
    if call.name in SYNC_APIS or call.name in BLOCKING_COPY_APIS:
        return True
    # An asynchronous copy into pageable host memory cannot return before the data has arrived.
    return call.name in ASYNC_COPY_APIS and copy is not None and copy.device_to_host and "Pinned" not in copy.name


def _frame_location(frame: PyFrame) -> tuple[str, int, str] | None:
    m = _FRAME.match(frame.name)
    return (m["file"], int(m["line"]), m["function"]) if m else None


def source_line(frames: list[PyFrame]) -> str | None:
    """The innermost frame of user code (not torch, not an installed package), else the innermost non-torch frame."""
    located = [loc for loc in map(_frame_location, frames) if loc and not loc[0].startswith("<")]
    user = [loc for loc in located if not any(m in loc[0] for m in _LIBRARY_MARKERS) and "/torch/" not in loc[0]]
    outside_torch = [loc for loc in located if "/torch/" not in loc[0]]
    chosen = (user or outside_torch or [None])[0]
    return None if chosen is None else f"{chosen[0]}:{chosen[1]} ({chosen[2]})"


def _cause(call_names: list[str], op_names: list[str], frames: list[PyFrame], copies_to_host: bool,
           copies_to_gpu: bool) -> str:
    if any(_TENSOR_PRINT.search(f.name) for f in frames):
        return "printing or formatting a GPU tensor"
    for op, cause in _IMPLICIT_CAUSES:
        if op in op_names:
            return cause
    if copies_to_host and _COPY_OPS.intersection(op_names):
        return "`.cpu()` / `.to('cpu')` / `.tolist()` (copy to host memory)"
    if copies_to_gpu and _COPY_OPS.intersection(op_names):
        return BLOCKING_COPY_TO_GPU
    if op_names:
        return f"`{op_names[0].removeprefix('aten::')}` (a copy to the host or an explicit sync inside it)"
    if "cudaDeviceSynchronize" in call_names or "cuCtxSynchronize" in call_names:
        return "`torch.cuda.synchronize()`"
    if "cudaEventSynchronize" in call_names or "cuEventSynchronize" in call_names:
        return "`event.synchronize()`"
    return f"explicit `{call_names[0]}`"


def _blocking_calls_by_op(trace: Trace) -> tuple[dict[tuple, list[RuntimeCall]], dict[tuple, list[RuntimeCall]], set[tuple]]:
    """The workload's blocking calls grouped per CPU op (a call outside any op on its own), the
    device-to-host copy calls of each op, and the ops that copied to the GPU."""
    copy_by_correlation = {g.correlation: g for g in trace.gpu if g.kind == "memcpy" and g.correlation is not None}
    boundaries = [a for a in trace.annotations if a.name == STEP_BOUNDARY]
    groups: dict[tuple, list[RuntimeCall]] = {}
    host_copies_by_op: dict[tuple, list[RuntimeCall]] = {}
    gpu_copy_ops: set[tuple] = set()
    for call in trace.runtime:
        copy = copy_by_correlation.get(call.correlation)
        if copy is not None and call.external_id:
            if copy.device_to_host:
                host_copies_by_op.setdefault((call.tid, call.external_id), []).append(call)
            elif "HtoD" in copy.name:
                gpu_copy_ops.add((call.tid, call.external_id))
        if not _is_blocking(call, copy):
            continue
        if any(b.tid == call.tid and b.ts <= call.ts <= b.end for b in boundaries):
            continue
        key = (call.tid, call.external_id) if call.external_id else (call.tid, "call", call.ts)
        groups.setdefault(key, []).append(call)
    return groups, host_copies_by_op, gpu_copy_ops


def _sync(trace: Trace, calls: list[RuntimeCall], host_copies: list[RuntimeCall], copies_to_gpu: bool) -> Sync:
    """One op's blocking calls as a sync, its host copies in its round trip."""
    first = calls[0]
    round_trip = sorted({id(c): c for c in host_copies + calls}.values(), key=lambda c: c.ts)
    ops = trace.ops_enclosing(first.tid, first.ts + first.dur / 2)
    frames = trace.frames_enclosing(first.tid, first.ts + first.dur / 2)
    return Sync(
        api="+".join(dict.fromkeys(c.name for c in round_trip)),
        ts=first.ts,
        blocked_us=sum(c.dur for c in calls),
        tid=first.tid,
        cause=_cause([c.name for c in calls], [o.name for o in reversed(ops)], frames, bool(host_copies), copies_to_gpu),
        source=source_line(frames),
        correlations=tuple(c.correlation for c in round_trip if c.correlation is not None),
    )


def _place_at_sites(syncs: list[Sync], sites: list[Span]) -> None:
    """Give each recorded sync site's line to the latest sync before it on its thread not yet placed."""
    by_tid: dict[int, list[Sync]] = {}
    for s in syncs:
        by_tid.setdefault(s.tid, []).append(s)
    starts = {tid: [s.ts for s in group] for tid, group in by_tid.items()}
    for site in sites:
        candidates = by_tid.get(site.tid, [])
        pos = bisect.bisect_right(starts.get(site.tid, []), site.ts) - 1
        while pos >= 0 and candidates[pos].source_exact:
            pos -= 1
        if pos >= 0 and site.ts - candidates[pos].end <= SITE_DELAY_US:
            candidates[pos].source = site.name.removeprefix(SYNC_SITE)
            candidates[pos].source_exact = True


def find_syncs(trace: Trace) -> list[Sync]:
    """Every host-blocking call in the trace, grouped per CPU op, in time order."""
    groups, host_copies_by_op, gpu_copy_ops = _blocking_calls_by_op(trace)
    syncs = [_sync(trace, calls, host_copies_by_op.get(key, []), key in gpu_copy_ops) for key, calls in groups.items()]
    syncs.sort(key=lambda s: s.ts)
    _place_at_sites(syncs, [a for a in trace.annotations if a.name.startswith(SYNC_SITE)])
    return syncs
