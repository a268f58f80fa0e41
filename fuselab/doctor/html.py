"""Write a diagnosis as one self-contained HTML file: verdict, evidence, fixes, a timeline and the breakdown.

The timeline is inline SVG of the median step: host launch calls and syncs on top, then each GPU
stream's kernels coloured by roofline side, with the idle gaps between them shaded by cause.
Hovering a rectangle shows what it is.
"""

from __future__ import annotations

import html
import os

from fuselab.doctor.report import PART_NAMES, step_time
from fuselab.doctor.syncs import SYNC_APIS
from fuselab.doctor.verdict import Diagnosis

WIDTH, ROW, LABEL = 1100, 26, 150
COLORS = {
    "compute": "#2e9d4f", "memory": "#2f7bd1", "copy": "#8a8a8a", "launch": "#f2b233", "sync": "#d64541",
    "other": "#c9c9c9", "call": "#6d4bb3", "profiler": "#f0f0f0",
}
PART_COLORS = {"compute": COLORS["compute"], "memory": COLORS["memory"], "copies": COLORS["copy"], "launch_gaps": COLORS["launch"],
               "sync_stalls": COLORS["sync"], "other_idle": COLORS["other"]}


def _rect(x0: float, x1: float, y: float, h: float, color: str, title: str) -> str:
    return (f'<rect x="{x0:.2f}" y="{y:.1f}" width="{max(x1 - x0, 0.6):.2f}" height="{h}" fill="{color}">'
            f"<title>{html.escape(title)}</title></rect>")


def _median_step(diagnosis: Diagnosis) -> int:
    """The index of the step whose wall time is the median (the upper one of an even count)."""
    steps = diagnosis.analysis.steps
    return sorted(range(len(steps)), key=lambda i: steps[i].wall_us)[len(steps) // 2]


def timeline_svg(diagnosis: Diagnosis) -> str:
    """SVG timeline of the step whose wall time is the median."""
    a = diagnosis.analysis
    k = _median_step(diagnosis)
    step, indices = a.steps[k], a.step_events[k]
    t0, span = step.start, max(step.end - step.start, 1e-9)

    def x(t: float) -> float:
        return LABEL + (WIDTH - LABEL - 10) * (min(max(t, t0), step.end) - t0) / span

    streams = sorted({(a.trace.gpu[i].device, a.trace.gpu[i].stream) for i in indices})
    rows = ["host: launches", "host: syncs"] + [f"GPU {d} stream {s}" for d, s in streams]
    parts = [f'<text x="4" y="{ROW * r + 17}" font-size="12">{html.escape(name)}</text>' for r, name in enumerate(rows)]
    correlations = {a.trace.gpu[i].correlation for i in indices}
    for call in a.trace.runtime:
        if call.correlation in correlations and call.name not in SYNC_APIS:
            parts.append(_rect(x(call.ts), x(call.end), 4, ROW - 8, COLORS["call"], f"{call.name} {call.dur:.1f} us"))
    for s in a.syncs[k]:
        parts.append(_rect(x(s.ts), x(s.end), ROW + 4, ROW - 8, COLORS["sync"],
                           f"{s.cause} at {s.source or '?'}: blocked {s.blocked_us:.1f} us"))
    row_of = {key: 2 + r for r, key in enumerate(streams)}
    for g0, g1, kind in a.gaps[k]:
        for r in row_of.values():
            parts.append(_rect(x(g0), x(g1), ROW * r + 2, ROW - 4, COLORS[kind], f"idle {g1 - g0:.1f} us: {kind}"))
    for i in indices:
        g, cost = a.trace.gpu[i], a.costs[i]
        color = COLORS["copy"] if g.kind != "kernel" else COLORS[cost.bound]
        pct = f", {cost.pct_of_ceiling:.0f}% of ceiling" if cost.pct_of_ceiling is not None else ""
        parts.append(_rect(x(g.ts), x(g.end), ROW * row_of[(g.device, g.stream)] + 4, ROW - 8, color,
                           f"{cost.op or g.name}: {g.dur:.1f} us, {cost.bound}-bound{pct}\n{g.name}"))
    height = ROW * len(rows) + 24
    axis = f'<text x="{LABEL}" y="{height - 6}" font-size="11">0 us</text>' \
           f'<text x="{WIDTH - 70}" y="{height - 6}" font-size="11">{span:.0f} us</text>'
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" font-family="sans-serif">'
            f'<title>{html.escape(step.name)}</title>{"".join(parts)}{axis}</svg>')


def breakdown_svg(diagnosis: Diagnosis) -> str:
    parts, cursor = [], LABEL
    usable = WIDTH - LABEL - 10
    for part, v in diagnosis.breakdown.items():
        if v["share"] <= 0:
            continue
        w = usable * v["share"]
        parts.append(_rect(cursor, cursor + w, 4, 30, PART_COLORS[part], f"{PART_NAMES[part]}: {v['us']:.1f} us ({100 * v['share']:.1f}%)"))
        cursor += w
    legend = "".join(
        f'<rect x="{LABEL + 200 * i}" y="44" width="12" height="12" fill="{PART_COLORS[p]}"/>'
        f'<text x="{LABEL + 200 * i + 16}" y="55" font-size="11">{html.escape(PART_NAMES[p].split(" (")[0])}</text>'
        for i, p in enumerate(diagnosis.breakdown)
    )
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="64" font-family="sans-serif">'
            f'<text x="4" y="24" font-size="12">one step</text>{"".join(parts)}{legend}</svg>')


def _steps_section(d: Diagnosis) -> str:
    """The steps table and the timeline of the median step; empty without the analysis."""
    if d.analysis is None:
        return ""
    rows = "".join(
        f"<tr><td>{html.escape(s.name)}</td><td>{s.wall_us:.0f}</td><td>{s.gpu_busy_pct:.0f}%</td><td>{s.kernels}</td>"
        f"<td>{s.median_kernel_us:.1f}</td><td>{s.syncs}</td></tr>" for s in d.analysis.steps)
    return ("<h2>steps</h2><table><tr><th>step</th><th>wall us</th><th>GPU busy</th><th>kernels</th>"
            f"<th>median kernel us</th><th>syncs</th></tr>{rows}</table>"
            f"<h2>timeline of the median step ({d.analysis.steps[_median_step(d)].wall_us:.0f} us)</h2>"
            f"{timeline_svg(d)}<p><small>purple: launch calls; red: syncs and sync stalls; green/blue: compute-/memory-bound "
            "kernels; grey: copies; amber: GPU waiting for the host to launch; light grey: other idle; "
            "faint grey: the profiler's own overhead, left out of the step</small></p>")


def _page(diagnosis: Diagnosis) -> str:
    d = diagnosis
    evidence = "".join(f"<li>{html.escape(e)}</li>" for e in d.evidence)
    fixes = "".join(f"<li>{html.escape(f.action)} <small>(~{f.saving_us:.0f} us/step; {html.escape(f.why)})</small></li>" for f in d.fixes)
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>fuselab doctor: {html.escape(d.verdict)}</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1150px}} table{{border-collapse:collapse}}
td,th{{border:1px solid #ddd;padding:3px 8px;text-align:right}} td:first-child{{text-align:left}}</style></head>
<body><h1>fuselab doctor: {html.escape(d.verdict)}</h1>
<p>{d.steps} steps, {step_time(d)}, GPU busy {d.gpu_busy_pct:.0f}%,
{d.kernels_per_step:g} kernels and {d.syncs_per_step:g} syncs per step.</p>
<h2>evidence</h2><ul>{evidence}</ul>
<h2>where a step's time goes</h2>{breakdown_svg(d)}
<h2>fixes, by estimated saving</h2><ol>{fixes}</ol>
{_steps_section(d)}
</body></html>
"""


def write_html(diagnosis: Diagnosis, path: str | os.PathLike) -> None:
    with open(path, "w") as f:
        f.write(_page(diagnosis))
