"""`fuselab doctor --compare BEFORE AFTER`: two runs side by side, to confirm that a fix did what it should.

Each side is a trace (analyzed here) or a doctor JSON output (`fuselab doctor --json`). The
comparison gives the step's parts before and after (NCCL communication among them, with its kernels
per step, when either run has any), the verdict change, and what went away or
came new: kernels and the ops that launched them, and host syncs. Sync sites are matched by cause,
file and function, not by line, since removing one line moves the lines below it.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

from fuselab.device import Ceilings

DOCTOR_JSON_MAX_BYTES = 64 * 2**20  # a doctor's output is small; anything larger is read as a trace
LISTED = 10  # kernels, ops and sync sites shown per kind of change
PART_NAMES = {"compute": "compute-bound kernels", "memory": "memory-bound kernels",
              "communication": "communication (NCCL kernels)"}
_LINE = re.compile(r":\d+(?=\s|$)")


@dataclass
class Metric:
    name: str
    before: float | None
    after: float | None
    unit: str  # "us", "%" or "" for a count per step

    @property
    def change(self) -> float | None:
        return None if self.before is None or self.after is None else self.after - self.before

    def to_dict(self) -> dict:
        return asdict(self) | {"change": self.change}


@dataclass
class Difference:
    """Kernels, ops or sync sites whose count per step changed: name -> (before, after)."""

    gone: dict[str, tuple[float, float]] = field(default_factory=dict)  # present before, absent after
    fewer: dict[str, tuple[float, float]] = field(default_factory=dict)
    more: dict[str, tuple[float, float]] = field(default_factory=dict)
    new: dict[str, tuple[float, float]] = field(default_factory=dict)  # absent before

    def to_dict(self) -> dict:
        return {kind: [{"name": k, "before": b, "after": a} for k, (b, a) in getattr(self, kind).items()]
                for kind in ("gone", "fewer", "more", "new")}


@dataclass
class Comparison:
    before: str
    after: str
    verdict_before: str
    verdict_after: str
    metrics: list[Metric]
    kernels: Difference  # calls per step, by kernel name
    ops: Difference  # kernels per step, by launching op
    syncs: Difference  # syncs per step, by site

    @property
    def step(self) -> Metric:
        return self.metrics[0]

    def to_dict(self) -> dict:
        return {"before": self.before, "after": self.after,
                "verdict": {"before": self.verdict_before, "after": self.verdict_after},
                "metrics": [m.to_dict() for m in self.metrics],
                "kernels": self.kernels.to_dict(), "ops": self.ops.to_dict(), "syncs": self.syncs.to_dict()}


def load_report(path: str | os.PathLike, ceilings: Ceilings | None = None, skip_steps: int = 0) -> dict:
    """The doctor's JSON for `path`: read as it is when it is a doctor output, else analyzed as a trace."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"no such file: {p} (expected a trace or a `fuselab doctor --json` output)")
    if p.stat().st_size <= DOCTOR_JSON_MAX_BYTES:
        try:
            data = json.loads(p.read_bytes())
        except (UnicodeDecodeError, json.JSONDecodeError):
            data = None  # gzipped, or not JSON: the trace reader says what is wrong
        if isinstance(data, dict) and "verdict" in data and "traceEvents" not in data:
            return data
    from fuselab.doctor import analyze_trace

    return analyze_trace(p, ceilings=ceilings, skip_steps=skip_steps).to_dict()


def _step_us(report: dict) -> float:
    return report.get("unprofiled_us_per_step") or report["wall_us_per_step"]


def _metrics(before: dict, after: dict) -> list[Metric]:
    def both(key: str, source=lambda r, k: r.get(k)) -> tuple[float | None, float | None]:
        return source(before, key), source(after, key)

    metrics = [Metric("step time", _step_us(before), _step_us(after), "us"),
               Metric("GPU busy", *both("gpu_busy_pct"), "%")]
    parts = list(before.get("breakdown", {}))
    parts += [p for p in after.get("breakdown", {}) if p not in parts]  # a part only the newer doctor reports
    for part in parts:
        values = both(part, lambda r, k: r.get("breakdown", {}).get(k, {}).get("us"))
        metrics.append(Metric(PART_NAMES.get(part, part.replace("_", " ")), *values, "us"))
    for key, name in (("kernels_per_step", "kernels"), ("graph_launches_per_step", "graph launches"),
                      ("syncs_per_step", "syncs")):
        metrics.append(Metric(name, *both(key), ""))
    calls = both("communication", lambda r, k: r.get("breakdown", {}).get(k, {}).get("calls"))
    if any(calls):
        metrics.append(Metric("NCCL kernels", *calls, ""))
    for key, name in (("copy_us", "copy time"), ("copy_compute_overlap_us", "copy under compute"),
                      ("communication_compute_overlap_us", "communication under compute")):
        values = both(key, lambda r, k: r.get("streams", {}).get(k))
        if any(values):
            metrics.append(Metric(name, *values, "us"))
    return metrics


def _difference(before: Counter, after: Counter) -> Difference:
    d = Difference()
    for name in list(before) + [n for n in after if n not in before]:
        b, a = before.get(name, 0.0), after.get(name, 0.0)
        kind = "gone" if not a else "new" if not b else "fewer" if a < b else "more" if a > b else None
        if kind:
            getattr(d, kind)[name] = (b, a)
    return d


def _kernel_counts(report: dict, key: str) -> Counter:
    counts: Counter = Counter()
    for k in report.get("kernels", []):
        counts[k.get(key) or "(unknown op)"] += k["calls_per_step"]
    return counts


def sync_site(sync: dict) -> str:
    """A sync's cause and source with the line left out: "`.item()` at train.py (loop)"."""
    source = sync.get("source")
    return sync["cause"] + (f" at {_LINE.sub('', source)}" if source else "")


def _sync_counts(report: dict) -> Counter:
    steps = max(report.get("steps", 1), 1)
    return Counter({site: n / steps for site, n in Counter(sync_site(s) for s in report.get("syncs", [])).items()})


def compare_reports(before: dict, after: dict, before_name: str = "before", after_name: str = "after") -> Comparison:
    """Compare two doctor outputs (as `Diagnosis.to_dict()` gives them)."""
    return Comparison(
        before=before_name, after=after_name, verdict_before=before["verdict"], verdict_after=after["verdict"],
        metrics=_metrics(before, after),
        kernels=_difference(_kernel_counts(before, "name"), _kernel_counts(after, "name")),
        ops=_difference(_kernel_counts(before, "op"), _kernel_counts(after, "op")),
        syncs=_difference(_sync_counts(before), _sync_counts(after)),
    )


def compare(before: str | os.PathLike, after: str | os.PathLike, ceilings: Ceilings | None = None,
            skip_steps: int = 0) -> Comparison:
    """Compare two runs, each a trace file or a doctor JSON output."""
    return compare_reports(load_report(before, ceilings, skip_steps), load_report(after, ceilings, skip_steps),
                           str(before), str(after))


def _value(v: float | None, unit: str) -> str:
    if v is None:
        return "—"
    return f"{v:.0f}%" if unit == "%" else f"{v:,.1f}" if unit == "us" else f"{v:g}"


def _change(m: Metric) -> str:
    if m.change is None:
        return ""
    if m.unit == "%":
        return f"{m.change:+.0f} pts"
    if m.unit == "":
        return f"{m.change:+g}"
    text = f"{m.change:+,.1f}"
    if m.name == "step time" and m.before and m.after and m.before != m.after:
        ratio = m.before / m.after
        text += f" ({ratio:.2f}x faster)" if ratio > 1 else f" ({1 / ratio:.2f}x slower)"
    return text


def _short(name: str, width: int = 72) -> str:
    return name if len(name) <= width else name[: width - 1] + "…"


def render_comparison(c: Comparison, console: Console | None = None) -> None:
    console = console or Console()
    verdict = c.verdict_before if c.verdict_before == c.verdict_after else f"{c.verdict_before} → {c.verdict_after}"
    console.print(f"[bold]before[/] {c.before}\n[bold]after[/]  {c.after}\nverdict: [bold]{verdict}[/]")
    table = Table(title="per step, before and after")
    for col in ("", "before", "after", "change"):
        table.add_column(col, justify="left" if not col else "right")
    for m in c.metrics:
        unit = f" ({m.unit})" if m.unit == "us" else ""
        table.add_row(m.name + unit, _value(m.before, m.unit), _value(m.after, m.unit), _change(m))
    console.print(table)
    for title, diff, what in (("kernels", c.kernels, "calls"), ("ops", c.ops, "kernels"), ("syncs", c.syncs, "syncs")):
        for kind, label in (("gone", "gone"), ("fewer", "fewer"), ("new", "new")):
            items = list(getattr(diff, kind).items())
            if not items:
                continue
            console.print(f"[bold]{title} {label}[/] ({what} per step, before → after)")
            for name, (b, a) in items[:LISTED]:
                console.print(f"  {_short(name)}: {b:g} → {a:g}")
            if len(items) > LISTED:
                console.print(f"  … and {len(items) - LISTED} more (in the JSON output)")
