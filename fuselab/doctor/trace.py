"""Read a Chrome/Kineto trace (as `torch.profiler` exports it) into typed events.

A Kineto trace is a JSON object whose "traceEvents" list holds complete events (ph "X") in
categories: "kernel", "gpu_memcpy", "gpu_memset" (GPU activity, pid = device, tid = stream),
"cuda_runtime"/"cuda_driver" (host API calls), "cpu_op" (ATen ops, with "Input Dims" and
"Input type" when shapes were recorded), "python_function" (Python frames, when stacks were
recorded), "user_annotation" (record_function ranges, including "ProfilerStep#N") and "overhead"
(the profiler's own stalls, such as CUPTI's "Activity Buffer Request", which can hold up the host
for milliseconds inside whatever op was running; not the workload's time). A host API
call and the GPU work it queued share args["correlation"]; a CPU op and the calls made inside it
share args["External id"]. Flow events (ph "s"/"f", cat "ac2g") repeat the call-to-kernel links.
A CUDA graph replay is one runtime call (cudaGraphLaunch) whose correlation id every kernel of the
replay carries; some versions also give those kernels args["graph node id"].

Times are microseconds, as in the file.
"""

from __future__ import annotations

import bisect
import gc
import gzip
import json
import os
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

GPU_CATEGORIES = {"kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memset"}
RUNTIME_CATEGORIES = {"cuda_runtime", "cuda_driver"}
CPU_OP_CATEGORIES = {"cpu_op", "operator"}  # "operator": older Kineto versions
PROFILER_OVERHEAD_CATEGORY = "overhead"
KINETO_CATEGORIES = (set(GPU_CATEGORIES) | RUNTIME_CATEGORIES | CPU_OP_CATEGORIES
                     | {"python_function", "user_annotation", PROFILER_OVERHEAD_CATEGORY})
STEP_PREFIX = "ProfilerStep#"
GRAPH_LAUNCH_CALLS = ("cudaGraphLaunch", "cuGraphLaunch")  # runtime and driver names, with or without a version suffix


@dataclass(slots=True)
class GpuEvent:
    """A kernel, memcpy or memset as it ran on the GPU."""

    name: str
    kind: str  # "kernel", "memcpy" or "memset"
    ts: float
    dur: float
    device: int
    stream: int
    correlation: int | None
    external_id: int | None
    graph_node: int | None = None  # set when the event was replayed from a CUDA graph (not every version records it)
    grid: tuple[int, ...] | None = None  # a kernel's launch grid and block, as recorded
    block: tuple[int, ...] | None = None
    bytes: int | None = None  # of a memcpy or memset, as the trace records it

    @property
    def end(self) -> float:
        return self.ts + self.dur

    @property
    def device_to_host(self) -> bool:
        return self.kind == "memcpy" and "DtoH" in self.name


def is_communication(event: GpuEvent) -> bool:
    """NCCL's kernels (ncclDevKernel_AllReduce..., ncclKernel_...): the GPU moving data between GPUs."""
    return event.kind == "kernel" and event.name.removeprefix("void ").lower().startswith("nccl")


@dataclass(slots=True)
class RuntimeCall:
    """A CUDA runtime or driver API call on a host thread (cudaLaunchKernel, cudaStreamSynchronize, ...)."""

    name: str
    ts: float
    dur: float
    tid: int
    correlation: int | None
    external_id: int | None

    @property
    def end(self) -> float:
        return self.ts + self.dur

    @property
    def launches_graph(self) -> bool:
        return self.name.startswith(GRAPH_LAUNCH_CALLS)


@dataclass(slots=True)
class CpuOp:
    """An ATen op (or record_function range) on a host thread, with its input shapes and dtypes."""

    name: str
    ts: float
    dur: float
    tid: int
    external_id: int | None
    input_dims: list
    input_types: list
    parent: int | None = None  # index into Trace.cpu_ops of the enclosing op on the same thread
    sequence: int | None = None  # autograd's "Sequence number": a backward op shares its forward op's

    @property
    def end(self) -> float:
        return self.ts + self.dur


@dataclass(slots=True)
class PyFrame:
    """A Python function call, named as the profiler names it: "path/file.py(LINE): function"."""

    name: str
    ts: float
    dur: float
    tid: int
    parent: int | None = None  # index into Trace.py_frames of the caller


@dataclass(slots=True)
class Span:
    """A named host time range: a profiler step or a record_function annotation."""

    name: str
    ts: float
    dur: float
    tid: int

    @property
    def end(self) -> float:
        return self.ts + self.dur


@dataclass
class Trace:
    path: str
    gpu: list[GpuEvent] = field(default_factory=list)
    runtime: list[RuntimeCall] = field(default_factory=list)
    cpu_ops: list[CpuOp] = field(default_factory=list)
    py_frames: list[PyFrame] = field(default_factory=list)
    annotations: list[Span] = field(default_factory=list)
    profiler_overhead: list[Span] = field(default_factory=list)
    flows: dict[int, tuple[float, float]] = field(default_factory=dict)  # correlation -> (call ts, GPU ts)
    op_by_external_id: dict[int, int] = field(default_factory=dict)
    device_properties: list[dict] = field(default_factory=list)  # the file's "deviceProperties" (numSms, ...)
    _frame_starts: dict[int, tuple[list[float], list[int]]] = field(default_factory=dict, repr=False)
    _op_starts: dict[int, tuple[list[float], list[int]]] = field(default_factory=dict, repr=False)

    @property
    def steps(self) -> list[Span]:
        return [a for a in self.annotations if a.name.startswith(STEP_PREFIX)]

    @property
    def op_threads(self) -> list[int]:
        """The host threads that ran CPU ops."""
        return list(self._op_starts)

    def op_for(self, external_id: int | None) -> CpuOp | None:
        index = self.op_by_external_id.get(external_id) if external_id else None
        return None if index is None else self.cpu_ops[index]

    def ops_enclosing(self, tid: int, t: float) -> list[CpuOp]:
        """CPU ops on thread `tid` running at time t, innermost first."""
        return [self.cpu_ops[i] for i in _enclosing(self._op_starts.get(tid), self.cpu_ops, t)]

    def frames_enclosing(self, tid: int, t: float) -> list[PyFrame]:
        """Python frames on thread `tid` active at time t, innermost first."""
        return [self.py_frames[i] for i in _enclosing(self._frame_starts.get(tid), self.py_frames, t)]


def _enclosing(starts: tuple[list[float], list[int]] | None, events: list, t: float) -> list[int]:
    # Events of one thread nest, so the last one to start before t either contains t or one of
    # its ancestors does: walk up the parent links from there.
    if not starts:
        return []
    times, order = starts
    pos = bisect.bisect_right(times, t) - 1
    index = order[pos] if pos >= 0 else None
    out = []
    while index is not None:
        event = events[index]
        if event.ts <= t <= event.ts + event.dur:
            out.append(index)
        index = event.parent
    return out


def _link_parents(events: list) -> dict[int, tuple[list[float], list[int]]]:
    """Set each event's parent to the innermost event of its thread that encloses it (a stack sweep);
    return, per thread, the events' start times and indices in start order."""
    by_tid: dict[int, list[int]] = {}
    starts: dict[int, tuple[list[float], list[int]]] = {}
    for i, e in enumerate(events):
        by_tid.setdefault(e.tid, []).append(i)
    for tid, indices in by_tid.items():
        # Longer first among equal starts, so a parent precedes the child that starts with it.
        indices.sort(key=lambda i: (events[i].ts, -events[i].dur))
        stack: list[int] = []
        for i in indices:
            e = events[i]
            while stack and events[stack[-1]].ts + events[stack[-1]].dur < e.ts:
                stack.pop()
            e.parent = stack[-1] if stack else None
            stack.append(i)
        starts[tid] = ([events[i].ts for i in indices], indices)
    return starts


def _read_text(path: Path) -> str:
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (EOFError, OSError, zlib.error) as err:
            raise ValueError(f"{path}: the gzip stream is corrupt or truncated ({err})") from err
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not a text file (expected JSON or gzipped JSON)") from err


def _as_int(value) -> int | None:
    if value is None or value == "":
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _dims(value) -> tuple[int, ...] | None:
    if not isinstance(value, list) or not all(isinstance(v, int) for v in value):
        return None
    return tuple(value)


@contextmanager
def gc_paused() -> Iterator[None]:
    """Run the block with the cyclic garbage collector off (as it was before, after).

    Reading a trace allocates millions of small objects and no cycles; the collector, triggered by
    the allocations alone, would traverse them over and over and take more time than the parsing.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def load_trace(path: str | os.PathLike) -> Trace:
    """Parse a Kineto trace file (.json or .json.gz) into a `Trace`.

    Raises ValueError naming what is wrong when the file is not JSON, is cut short, or is JSON
    but not a trace written by torch.profiler.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"path: no trace file at {p}")
    text = _read_text(p)
    with gc_paused():
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            where = "it ends early (truncated?)" if err.pos >= len(text.rstrip()) - 1 else f"line {err.lineno}, column {err.colno}"
            raise ValueError(f"{p}: not valid JSON: {err.msg}; {where}") from err
        events = data.get("traceEvents") if isinstance(data, dict) else data
        if not isinstance(events, list):
            raise ValueError(f"{p}: not a Chrome/Kineto trace: expected an object with a 'traceEvents' list")
        trace = parse_events(events, str(p))
    if isinstance(data, dict) and isinstance(data.get("deviceProperties"), list):
        trace.device_properties = [d for d in data["deviceProperties"] if isinstance(d, dict)]
    return trace


def parse_events(events: list, source: str = "<events>") -> Trace:
    """Type the events of a trace; see `load_trace`."""
    trace = Trace(path=source)
    categories_seen = False
    flow_starts: dict[int, float] = {}
    for i, e in enumerate(events):
        if not isinstance(e, dict):
            raise ValueError(f"{source}: traceEvents[{i}] is a {type(e).__name__}, not an event object")
        cat = e.get("cat")
        ph = e.get("ph")
        if ph in ("s", "f") and cat == "ac2g":
            flow_id = _as_int(e.get("id"))
            if flow_id is not None and isinstance(e.get("ts"), (int, float)):
                if ph == "s":
                    flow_starts[flow_id] = float(e["ts"])
                elif flow_id in flow_starts:
                    trace.flows[flow_id] = (flow_starts[flow_id], float(e["ts"]))
            continue
        if ph != "X" or cat not in KINETO_CATEGORIES:
            continue
        categories_seen = True
        try:
            ts, dur, name = float(e["ts"]), float(e.get("dur", 0.0)), str(e["name"])
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{source}: traceEvents[{i}] ({cat}) lacks a numeric 'ts'/'dur' or a 'name'") from err
        args = e.get("args") or {}
        tid = _as_int(e.get("tid")) or 0
        if cat in GPU_CATEGORIES:
            trace.gpu.append(GpuEvent(
                name, GPU_CATEGORIES[cat], ts, dur, _as_int(args.get("device", e.get("pid"))) or 0,
                _as_int(args.get("stream", e.get("tid"))) or 0, _as_int(args.get("correlation")),
                _as_int(args.get("External id")), _as_int(args.get("graph node id")),
                _dims(args.get("grid")), _dims(args.get("block")), _as_int(args.get("bytes")),
            ))
        elif cat in RUNTIME_CATEGORIES:
            trace.runtime.append(RuntimeCall(name, ts, dur, tid, _as_int(args.get("correlation")), _as_int(args.get("External id"))))
        elif cat in CPU_OP_CATEGORIES and not name.startswith(STEP_PREFIX):
            trace.cpu_ops.append(CpuOp(
                name, ts, dur, tid, _as_int(args.get("External id")),
                args.get("Input Dims") or [], args.get("Input type") or [],
                sequence=_as_int(args.get("Sequence number")),
            ))
        elif cat == "python_function":
            trace.py_frames.append(PyFrame(name, ts, dur, tid))
        elif cat == PROFILER_OVERHEAD_CATEGORY:
            trace.profiler_overhead.append(Span(name, ts, dur, tid))
        else:  # user_annotation, or a profiler step that older versions wrote as a cpu_op
            trace.annotations.append(Span(name, ts, dur, tid))
    if not categories_seen:
        raise ValueError(
            f"{source}: a Chrome trace, but not one written by torch.profiler: no events in the categories "
            f"Kineto writes ({', '.join(sorted(KINETO_CATEGORIES))})"
        )
    _finish(trace)
    return trace


def _finish(trace: Trace) -> None:
    # A kernel whose args lost the correlation id can still be linked through its flow event.
    if trace.flows:
        gpu_start_to_flow = {round(gpu_ts, 3): cid for cid, (_, gpu_ts) in trace.flows.items()}
        for g in trace.gpu:
            if g.correlation is None:
                g.correlation = gpu_start_to_flow.get(round(g.ts, 3))
    trace.gpu.sort(key=lambda g: g.ts)
    trace.runtime.sort(key=lambda r: r.ts)
    trace.annotations.sort(key=lambda a: a.ts)
    trace.profiler_overhead.sort(key=lambda a: a.ts)
    trace._op_starts = _link_parents(trace.cpu_ops)
    trace._frame_starts = _link_parents(trace.py_frames)
    trace.op_by_external_id = {op.external_id: i for i, op in enumerate(trace.cpu_ops) if op.external_id}
