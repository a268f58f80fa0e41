"""Write the analyzed trace with the doctor's findings added, to open in Perfetto (ui.perfetto.dev) or
chrome://tracing.

Every event of the trace is kept as it was; one more process, "fuselab doctor", holds three tracks
on the trace's own clock: the analyzed steps with their figures, the GPU's idle gaps by cause, and
the host syncs with their cause and source line.
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

from fuselab.doctor.analyze import Analysis

CATEGORY = "fuselab_doctor"
TRACKS = {"steps": (1, "steps, as analyzed"), "gaps": (2, "GPU idle, by cause"), "syncs": (3, "host syncs")}
GAP_NAMES = {"launch": "launch gap (GPU waited for the host)", "sync": "sync stall", "other": "other idle",
             "profiler": "profiler overhead (left out of the step)"}
STEP_FIGURES = ("wall_us", "gpu_busy_us", "gpu_busy_pct", "kernels", "launch_gap_us", "sync_stall_us", "other_idle_us",
                "syncs")


def _read(path: Path) -> dict:
    raw = path.read_bytes()
    data = json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)
    return data if isinstance(data, dict) else {"traceEvents": data}


def doctor_events(a: Analysis, pid: int) -> list[dict]:
    """The doctor's tracks as Chrome trace events in process `pid`."""
    events = [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": "fuselab doctor"}}]
    events += [{"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}}
               for tid, name in TRACKS.values()]

    def span(track: str, name: str, ts: float, dur: float, args: dict) -> dict:
        return {"ph": "X", "cat": CATEGORY, "name": name, "pid": pid, "tid": TRACKS[track][0], "ts": ts, "dur": dur,
                "args": args}

    for stats, gaps, syncs in zip(a.steps, a.gaps, a.syncs):
        figures = stats.to_dict()
        events.append(span("steps", f"{stats.name}: GPU busy {stats.gpu_busy_pct:.0f}%", stats.start,
                           stats.end - stats.start, {key: figures[key] for key in STEP_FIGURES}))
        events += [span("gaps", GAP_NAMES.get(kind, kind), g0, g1 - g0, {"us": g1 - g0}) for g0, g1, kind in gaps]
        events += [span("syncs", f"sync: {s.cause}", s.ts, s.blocked_us, s.to_dict()) for s in syncs]
    return events


def write_perfetto(a: Analysis, path: str | os.PathLike) -> Path:
    """Write the trace `a` was read from, plus the doctor's tracks, to `path` (gzipped when it ends in .gz)."""
    data = _read(Path(a.trace.path))
    events = data.setdefault("traceEvents", [])
    pids = [e["pid"] for e in events if isinstance(e, dict) and isinstance(e.get("pid"), int)]
    events += doctor_events(a, max(pids, default=0) + 1)
    text = json.dumps(data).encode()
    out = Path(path)
    out.write_bytes(gzip.compress(text) if out.name.endswith(".gz") else text)
    return out
