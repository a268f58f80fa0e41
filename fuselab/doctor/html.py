"""Write a diagnosis as one self-contained HTML file: verdict, evidence, fixes, a timeline, the breakdown
and the detail tables (top kernels, time by region, streams).

The timeline is inline SVG of the median step: host launch calls and syncs on top, then each GPU
stream's kernels coloured by roofline side, with the idle gaps between them shaded by cause.
It zooms with the mouse wheel, pans by dragging, and shows what is under the pointer (the kernel's
name and figures); a small inline script does it, so the page needs nothing from the network.
"""

from __future__ import annotations

import html
import os

from fuselab.doctor.kernels_table import TOP_KERNELS
from fuselab.doctor.regions import Region
from fuselab.doctor.report import PART_NAMES, step_time
from fuselab.doctor.syncs import SYNC_APIS
from fuselab.doctor.trace import is_communication
from fuselab.doctor.verdict import Diagnosis
from fuselab.doctor.views import Views
from fuselab.doctor.views_report import achieved_text, by_phase, grid_text, hidden_note, shown_regions

WIDTH, ROW, LABEL = 1100, 26, 150
COLORS = {
    "compute": "#2e9d4f", "memory": "#2f7bd1", "copy": "#8a8a8a", "launch": "#f2b233", "sync": "#d64541",
    "other": "#c9c9c9", "call": "#6d4bb3", "profiler": "#f0f0f0", "communication": "#b5651d",
}
PART_COLORS = {"compute": COLORS["compute"], "memory": COLORS["memory"], "copies": COLORS["copy"],
               "communication": COLORS["communication"], "launch_gaps": COLORS["launch"], "sync_stalls": COLORS["sync"],
               "other_idle": COLORS["other"]}


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

    right = WIDTH - 10

    def x(t: float) -> float:
        return LABEL + (right - LABEL) * (min(max(t, t0), step.end) - t0) / span

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
        if is_communication(g):
            color, what = COLORS["communication"], "communication (NCCL)"
        else:
            pct = f", {cost.pct_of_ceiling:.0f}% of ceiling" if cost.pct_of_ceiling is not None else ""
            color, what = COLORS["copy"] if g.kind != "kernel" else COLORS[cost.bound], f"{cost.bound}-bound{pct}"
        parts.append(_rect(x(g.ts), x(g.end), ROW * row_of[(g.device, g.stream)] + 4, ROW - 8, color,
                           f"{cost.op or g.name}: {g.dur:.1f} us, {what}\n{g.name}"))
    height = ROW * len(rows) + 24
    labels, events = parts[:len(rows)], parts[len(rows):]
    axis = (f'<text class="tl-axis-left" x="{LABEL}" y="{height - 6}" font-size="11">0 us</text>'
            f'<text class="tl-axis-right" x="{right}" y="{height - 6}" font-size="11" text-anchor="end">'
            f'{span:.0f} us</text>')
    # The events sit in a group that the page's script scales and shifts along x, clipped to the time area.
    return (f'<svg id="timeline" xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
            f'font-family="sans-serif" data-left="{LABEL}" data-right="{right}" data-span="{span:.3f}" style="cursor:grab">'
            f'<title>{html.escape(step.name)}</title><defs><clipPath id="tl-clip"><rect x="{LABEL}" y="0" '
            f'width="{right - LABEL}" height="{height}"/></clipPath></defs>{"".join(labels)}'
            f'<g clip-path="url(#tl-clip)"><g class="tl-events">{"".join(events)}</g></g>{axis}</svg>')


def breakdown_svg(diagnosis: Diagnosis) -> str:
    parts, cursor = [], LABEL
    usable = WIDTH - LABEL - 10
    for part, v in diagnosis.breakdown.items():
        if v["share"] <= 0:
            continue
        w = usable * v["share"]
        calls = f", {v['calls']:g} calls per step" if "calls" in v else ""
        parts.append(_rect(cursor, cursor + w, 4, 30, PART_COLORS[part],
                           f"{PART_NAMES[part]}: {v['us']:.1f} us ({100 * v['share']:.1f}%{calls})"))
        cursor += w
    step = min(200, usable // len(diagnosis.breakdown))  # seven parts with communication: narrower, to fit
    legend = "".join(
        f'<rect x="{LABEL + step * i}" y="44" width="12" height="12" fill="{PART_COLORS[p]}"/>'
        f'<text x="{LABEL + step * i + 16}" y="55" font-size="11">{html.escape(PART_NAMES[p].split(" (")[0])}</text>'
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
            f"{timeline_svg(d)}<p><small>wheel: zoom; drag: pan; double-click: the whole step; point at a box to see "
            "what it is. purple: launch calls; red: syncs and sync stalls; green/blue: compute-/memory-bound "
            "kernels; brown: NCCL communication; grey: copies; amber: GPU waiting for the host to launch; light grey: "
            "other idle; faint grey: the profiler's own overhead, left out of the step</small></p>"
            f"<p><small>{_raw_trace_note(d)}</small></p>")


def _raw_trace_note(d: Diagnosis) -> str:
    return (f"The whole trace, every step and host thread: open {html.escape(d.analysis.trace.path)} at "
            "ui.perfetto.dev (Open trace file; it loads in the browser and is not uploaded) or in chrome://tracing. "
            "In SCRIPT mode, keep the trace with --save-trace PATH; `fuselab doctor --perfetto PATH` writes it with "
            "the doctor's findings (steps, idle gaps by cause, syncs) added as tracks.")


def _short(text: str, width: int = 60) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _table(headers: list[str], rows: list[list[str]], note: str = "") -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>" + (f"<p><small>{html.escape(note)}</small></p>" if note else "")


def _regions_table(rows: list[Region], first: str) -> str:
    shown = shown_regions(rows)
    cells = [[f'<span style="padding-left:{1.2 * (len(r.path) - 1):.1f}em">{html.escape(r.path[-1])}</span>',
              f"{r.gpu_us_per_step:.1f}", f"{100 * r.share:.1f}%", f"{r.kernels_per_step:g}",
              "" if r.host_us_per_step is None else f"{r.host_us_per_step:.0f}"] for r in shown]
    return _table([first, "GPU us / step", "share", "kernels / step", "host us / step"], cells,
                  hidden_note(shown, rows))


def _views_section(v: Views | None) -> str:
    """The top kernels, time by region and, with several streams or NCCL, the streams."""
    if v is None:
        return ""
    out = []
    if v.kernels:
        cells = [[f'<span title="{html.escape(k.name)}">{html.escape(_short(k.label))}</span>',
                  html.escape(_short(k.op or "—")), f"{k.calls_per_step:g}", f"{k.us_per_step:.1f}",
                  f"{100 * k.share:.1f}%", html.escape(achieved_text(k)),
                  f'<b style="color:#b36b00">{html.escape(grid_text(k))}</b>' if k.underfilled
                  else html.escape(grid_text(k))]
                 for k in v.kernels[:TOP_KERNELS]]
        out.append(f"<h2>top kernels ({len(cells)} of {len(v.kernels)})</h2>"
                   + _table(["kernel", "op", "calls / step", "us / step", "share", "achieved (of ceiling)", "grid"],
                            cells))
    if shown_regions(by_phase(v.regions)):
        out.append("<h2>GPU time by phase and module</h2>" + _regions_table(by_phase(v.regions), "region"))
    if shown_regions(v.regions.ranges):
        out.append("<h2>GPU time by record_function range</h2>" + _regions_table(v.regions.ranges, "range"))
    s = v.streams
    if len(s.rows) > 1 or s.communication_us:
        cells = [[str(r.device), str(r.stream), f"{r.busy_us:.1f}", f"{100 * r.share:.0f}%", f"{r.kernels:g}",
                  f"{r.copies:g}", f"{r.communication_us:.1f}"] for r in s.rows]
        note = (f"copies {s.copy_us:.0f} us per step, {s.copy_compute_overlap_us:.0f} us of it under compute; NCCL "
                f"{s.communication_us:.0f} us per step, {s.communication_compute_overlap_us:.0f} us of it under "
                "compute")
        out.append("<h2>streams</h2>" + _table(["GPU", "stream", "busy us / step", "share", "kernels / step",
                                                "copies / step", "NCCL us / step"], cells, note))
    return "".join(out)


# Zoom (wheel, about the pointer), pan (drag) and reset (double-click) the timeline's events along x,
# keeping the step in view; show the title of the box under the pointer.
TIMELINE_SCRIPT = """
(function () {
  const svg = document.getElementById("timeline");
  if (!svg) return;
  const events = svg.querySelector("g.tl-events"), tip = document.getElementById("tl-tip");
  const left = +svg.dataset.left, right = +svg.dataset.right, span = +svg.dataset.span;
  const axisLeft = svg.querySelector(".tl-axis-left"), axisRight = svg.querySelector(".tl-axis-right");
  let k = 1, tx = 0, drag = null;
  const at = (clientX) => clientX - svg.getBoundingClientRect().left;
  const timeAt = (x) => span * ((x - tx) / k - left) / (right - left);
  const us = (t) => (t >= 1000 ? t.toFixed(0) : t.toFixed(1)) + " us";
  function apply() {
    tx = Math.min(left - k * left, Math.max(right - k * right, tx));
    events.setAttribute("transform", "translate(" + tx + " 0) scale(" + k + " 1)");
    axisLeft.textContent = us(timeAt(left));
    axisRight.textContent = us(timeAt(right));
  }
  svg.addEventListener("wheel", (e) => {
    e.preventDefault();
    const x = at(e.clientX), zoomed = Math.min(Math.max(k * Math.exp(-e.deltaY * 0.002), 1), 1e6);
    tx = x - (x - tx) * zoomed / k;
    k = zoomed;
    apply();
  }, {passive: false});
  svg.addEventListener("mousedown", (e) => { drag = {x: e.clientX, tx: tx}; svg.style.cursor = "grabbing"; });
  window.addEventListener("mouseup", () => { drag = null; svg.style.cursor = "grab"; });
  svg.addEventListener("dblclick", () => { k = 1; tx = 0; apply(); });
  svg.addEventListener("mousemove", (e) => {
    if (drag) { tx = drag.tx + e.clientX - drag.x; apply(); }
    const box = e.target.closest ? e.target.closest("g.tl-events rect") : null;
    const title = box ? box.querySelector("title") : null;
    tip.style.display = title ? "block" : "none";
    if (title) {
      tip.textContent = title.textContent;
      tip.style.left = (e.pageX + 14) + "px";
      tip.style.top = (e.pageY + 14) + "px";
    }
  });
  svg.addEventListener("mouseleave", () => { tip.style.display = "none"; });
})();
"""


def _page(diagnosis: Diagnosis) -> str:
    d = diagnosis
    evidence = "".join(f"<li>{html.escape(e)}</li>" for e in d.evidence)
    fixes = "".join(f"<li>{html.escape(f.action)} <small>(~{f.saving_us:.0f} us/step; {html.escape(f.why)})</small></li>" for f in d.fixes)
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>fuselab doctor: {html.escape(d.verdict)}</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1150px}} table{{border-collapse:collapse}}
td,th{{border:1px solid #ddd;padding:3px 8px;text-align:right}} td:first-child,th:first-child{{text-align:left}} td{{white-space:nowrap}}
#tl-tip{{position:absolute;display:none;pointer-events:none;background:#fffff0;border:1px solid #999;padding:4px 6px;
font-size:12px;white-space:pre;max-width:900px;overflow:hidden;box-shadow:2px 2px 4px #0003}}</style></head>
<body><h1>fuselab doctor: {html.escape(d.verdict)}</h1>
<p>{d.steps} steps, {step_time(d)}, GPU busy {d.gpu_busy_pct:.0f}%,
{d.kernels_per_step:g} kernels and {d.syncs_per_step:g} syncs per step.</p>
<h2>evidence</h2><ul>{evidence}</ul>
<h2>where a step's time goes</h2>{breakdown_svg(d)}
<h2>fixes, by estimated saving</h2><ol>{fixes}</ol>
{_steps_section(d)}
{_views_section(d.views)}
<div id="tl-tip"></div>
<script>{TIMELINE_SCRIPT}</script>
</body></html>
"""


def write_html(diagnosis: Diagnosis, path: str | os.PathLike) -> None:
    with open(path, "w") as f:
        f.write(_page(diagnosis))
