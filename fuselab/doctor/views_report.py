"""The detail tables (top kernels, time by region, streams) as terminal tables."""

from __future__ import annotations

from rich.table import Table

from fuselab.doctor.kernels_table import TOP_KERNELS, KernelRow
from fuselab.doctor.regions import Region, Regions
from fuselab.doctor.views import Views

MIN_REGION_SHARE = 0.01  # regions with less of the GPU time than this are left to the JSON
MAX_REGION_ROWS = 40
NAME_WIDTH = 48


def _short(text: str | None, width: int = NAME_WIDTH) -> str:
    text = text or "—"
    return text if len(text) <= width else text[: width - 1] + "…"


def achieved_text(k: KernelRow) -> str:
    """"549.8 TFLOP/s (70% of 780)", or "" when the kernel's FLOPs or bytes are unknown."""
    if k.achieved is None:
        return ""
    of = f" ({k.pct_of_ceiling:.0f}% of {k.ceiling:,.0f})" if k.ceiling else ""
    return f"{k.achieved:,.1f} {k.unit}{of}"


def grid_text(k: KernelRow) -> str:
    """"8 blocks < 132 SMs" for an under-filled grid, "1,024 blocks" otherwise, "" when not recorded."""
    if k.blocks is None:
        return ""
    blocks = f"{k.blocks:,} block{'s' if k.blocks != 1 else ''}"
    return f"{blocks} < {k.sms} SMs" if k.underfilled else blocks


def kernels_table(v: Views, limit: int = TOP_KERNELS) -> Table | None:
    if not v.kernels:
        return None
    table = Table(title=f"top kernels ({min(limit, len(v.kernels))} of {len(v.kernels)})")
    for col in ("kernel", "op", "calls / step", "us / step", "share", "achieved (of ceiling)", "grid"):
        table.add_column(col, justify="left" if col in ("kernel", "op", "grid") else "right")
    for k in v.kernels[:limit]:
        grid = grid_text(k)
        table.add_row(_short(k.label), _short(k.op, 32), f"{k.calls_per_step:g}", f"{k.us_per_step:.1f}",
                      f"{100 * k.share:.1f}%", achieved_text(k), f"[yellow]{grid}[/]" if k.underfilled else grid)
    under = [k for k in v.kernels if k.underfilled]
    if under:
        table.caption = (f"{len(under)} kernels ran with fewer blocks than the GPU's {under[0].sms} SMs: "
                         f"{sum(k.us_per_step for k in under):.0f} us per step "
                         f"({100 * sum(k.share for k in under):.0f}% of the step) with SMs left idle")
    return table


def shown_regions(rows: list[Region]) -> list[Region]:
    """The regions worth a row: at least MIN_REGION_SHARE of the GPU time, at most MAX_REGION_ROWS of them."""
    return [r for r in rows if r.share >= MIN_REGION_SHARE][:MAX_REGION_ROWS]


def hidden_note(shown: list[Region], rows: list[Region]) -> str:
    if len(shown) == len(rows):
        return ""
    return (f"{len(rows) - len(shown)} more regions (under {100 * MIN_REGION_SHARE:g}% of the GPU time, "
            f"or past the first {MAX_REGION_ROWS} rows) in the JSON output")


def by_phase(r: Regions) -> list[Region]:
    """Each phase followed by its module tree."""
    return [row for phase in r.phases for row in [phase] + [m for m in r.modules if m.path[0] == phase.path[0]]]


def _region_table(title: str, rows: list[Region], first_column: str) -> Table | None:
    shown = shown_regions(rows)
    if not shown:
        return None
    table = Table(title=title, caption=hidden_note(shown, rows) or None)
    for col in (first_column, "GPU us / step", "share", "kernels / step", "host us / step"):
        table.add_column(col, justify="left" if col == first_column else "right")
    for r in shown:
        host = "" if r.host_us_per_step is None else f"{r.host_us_per_step:.0f}"
        table.add_row("  " * (len(r.path) - 1) + r.path[-1], f"{r.gpu_us_per_step:.1f}", f"{100 * r.share:.1f}%",
                      f"{r.kernels_per_step:g}", host)
    return table


def region_tables(v: Views) -> list[Table]:
    """Phases with the module tree under each, then the record_function ranges (when any were recorded)."""
    tables = [_region_table("GPU time by phase and module (charged where the work was launched)",
                            by_phase(v.regions), "region"),
              _region_table("GPU time by record_function range", v.regions.ranges, "range")]
    return [t for t in tables if t is not None]


def streams_table(v: Views) -> Table | None:
    """Busy time per stream and the cross-stream overlap; shown when more than one stream ran or NCCL did."""
    s = v.streams
    if len(s.rows) < 2 and not s.communication_us:
        return None
    table = Table(title="streams")
    for col in ("GPU", "stream", "busy us / step", "share", "kernels / step", "copies / step", "NCCL us / step"):
        table.add_column(col, justify="right")
    for row in s.rows:
        table.add_row(str(row.device), str(row.stream), f"{row.busy_us:.1f}", f"{100 * row.share:.0f}%",
                      f"{row.kernels:g}", f"{row.copies:g}", f"{row.communication_us:.1f}")
    notes = []
    if s.copy_us:
        notes.append(f"copies {s.copy_us:.0f} us per step, {s.copy_compute_overlap_us:.0f} us of it under compute")
    if s.communication_us:
        notes.append(f"communication (NCCL) {s.communication_us:.0f} us per step, "
                     f"{s.communication_compute_overlap_us:.0f} us of it under compute")
    table.caption = "; ".join(notes)
    return table


def view_tables(v: Views | None) -> list[Table]:
    if v is None:
        return []
    tables = [kernels_table(v), *region_tables(v), streams_table(v)]
    return [t for t in tables if t is not None]
