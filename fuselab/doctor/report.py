"""Show a diagnosis in the terminal (rich) and write it as JSON."""

from __future__ import annotations

import json
import os
from collections import Counter

from rich.console import Console
from rich.table import Table

from fuselab.doctor.analyze import Analysis
from fuselab.doctor.verdict import Diagnosis
from fuselab.doctor.views_report import view_tables

VERDICT_STYLE = {"launch-bound": "bold yellow", "sync-bound": "bold red", "memory-bound": "bold cyan", "compute-bound": "bold green",
                 "copy-bound": "bold magenta"}
PART_NAMES = {"compute": "compute-bound kernels", "memory": "memory-bound kernels", "copies": "copies (host <-> device)",
              "communication": "communication (NCCL kernels)",
              "launch_gaps": "launch gaps (GPU waited for the host)", "sync_stalls": "sync stalls", "other_idle": "other idle"}


def _bar(share: float, width: int = 30) -> str:
    return "█" * round(share * width)


def step_time(d: Diagnosis) -> str:
    """The step time the verdict judged, with the profiled one beside it when the step was also timed unprofiled."""
    if d.unprofiled_us_per_step is None:
        return f"{d.wall_us_per_step:.0f} us per step"
    return f"{d.unprofiled_us_per_step:.0f} us per step ({d.wall_us_per_step:.0f} us profiled)"


def _breakdown_table(d: Diagnosis) -> Table:
    table = Table(title="where a step's time goes")
    communication = "communication" in d.breakdown
    for col in ("part", "us / step", "share") + (("calls / step",) if communication else ()) + ("",):
        table.add_column(col, justify="left" if col in ("part", "") else "right")
    for part, v in d.breakdown.items():
        calls = (f"{v['calls']:g}" if "calls" in v else "",) if communication else ()
        table.add_row(PART_NAMES[part], f"{v['us']:.1f}", f"{100 * v['share']:.1f}%", *calls, _bar(v["share"]))
    return table


def _steps_table(a: Analysis) -> Table:
    steps = Table(title="steps")
    for col in ("step", "wall us", "GPU busy", "kernels", "median kernel us", "launches/s", "launch delay us (median)", "syncs"):
        steps.add_column(col, justify="left" if col == "step" else "right")
    for s in a.steps:
        steps.add_row(s.name, f"{s.wall_us:.0f}", f"{s.gpu_busy_pct:.0f}%", str(s.kernels), f"{s.median_kernel_us:.1f}",
                      f"{s.launches_per_s:,.0f}", f"{s.launch_delay_us['median']:.1f}", str(s.syncs))
    return steps


def _syncs_table(a: Analysis) -> Table | None:
    sites = Counter((s.cause, s.source or "(no stack recorded)", s.source_exact) for step in a.syncs for s in step)
    if not sites:
        return None
    syncs = Table(title="host-blocking syncs")
    for col in ("cause", "source", "line", "count"):
        syncs.add_column(col, justify="right" if col == "count" else "left")
    for (cause, source, exact), n in sites.most_common():
        line = "exact" if exact else ("profiler's (function start)" if source != "(no stack recorded)" else "—")
        syncs.add_row(cause, source, line, str(n))
    return syncs


def _copies_table(a: Analysis) -> Table | None:
    if not a.copies:
        return None
    copies = Table(title="copies per step")
    for col in ("route", "count", "us", "MB", "GB/s", "blocking"):
        copies.add_column(col, justify="left" if col == "route" else "right")
    for g in a.copies:
        copies.add_row(g.label, f"{g.count:g}", f"{g.us:.1f}", f"{g.bytes / 1e6:,.1f}", f"{g.gbs:.1f}", f"{g.blocking:g}")
    return copies


def _fusion_table(a: Analysis) -> Table | None:
    if not a.fusion:
        return None
    fusion = Table(title="recurring kernel chains (each kernel in one)")
    for col in ("sequence", "count", "total us", "fix"):
        fusion.add_column(col, justify="right" if col in ("count", "total us") else "left")
    for c in a.fusion:
        fusion.add_row((f"{c.optimizer}.step: " if c.optimizer else "") + " → ".join(c.labels), str(c.count), f"{c.total_us:.0f}", c.fix)
    return fusion


def render(diagnosis: Diagnosis, console: Console | None = None) -> None:
    console = console or Console()
    d = diagnosis
    console.print(f"verdict: [{VERDICT_STYLE[d.verdict]}]{d.verdict}[/]  ({d.steps} steps, {step_time(d)}, "
                  f"GPU busy {d.gpu_busy_pct:.0f}%)")
    for line in d.evidence:
        console.print(f"  • {line}")
    console.print(_breakdown_table(d))
    if d.analysis is not None:
        for table in (_steps_table(d.analysis), _syncs_table(d.analysis), _copies_table(d.analysis), _fusion_table(d.analysis)):
            if table is not None:
                console.print(table)
    for table in view_tables(d.views):
        console.print(table)
    console.print("[bold]fixes, by estimated saving[/]")
    for rank, fix in enumerate(d.fixes, 1):
        saving = f"~{fix.saving_us:.0f} us/step" if fix.saving_us else "—"
        if fix.alone_us and fix.alone_us > fix.saving_us + 0.5:
            saving += f" after the fixes above, ~{fix.alone_us:.0f} alone"
        console.print(f"  {rank}. {fix.action}  [dim]({saving}; {fix.why})[/]")


def write_json(diagnosis: Diagnosis, path: str | os.PathLike) -> None:
    with open(path, "w") as f:
        json.dump(diagnosis.to_dict(), f, indent=2)
        f.write("\n")
