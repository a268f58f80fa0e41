"""Copies between host and device as their own part of a step: time, bytes, GB/s, direction, pageable or pinned.

Kineto names a copy for its route, "Memcpy HtoD (Pageable -> Device)", and records its "bytes". A
copy from or to pageable host memory is staged through a pinned buffer by the driver, so it runs at
a fraction of the link's rate and the host waits for it; pinning the host tensor once and copying
with non_blocking=True lets it run at the link's rate while the host moves on.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from fuselab.doctor.trace import GpuEvent, RuntimeCall

PAGEABLE = "Pageable"
# What pinned host copies reach over PCIe 5.0 x16 (about 64 GB/s raw); the probe's streams section
# measures this machine's (h2d_pinned_gbs). Used only to estimate what pinning would save.
PINNED_COPY_GBS = 50.0
# Below this a copy's time is its latency, whatever memory it uses: what costs is the sync around it.
PAGEABLE_MIN_BYTES = 1 << 20
_ROUTE = re.compile(r"^Memcpy (?P<direction>\w+) \((?P<src>\w+) -> (?P<dst>\w+)\)")


@dataclass(frozen=True)
class CopyRoute:
    direction: str  # "HtoD", "DtoH", "DtoD", "HtoH", "PtoP"
    src: str  # "Pageable", "Pinned", "Device", ...
    dst: str

    @property
    def pageable(self) -> bool:
        return PAGEABLE in (self.src, self.dst)


def copy_route(name: str) -> CopyRoute | None:
    """The route of a memcpy from its Kineto name; None for anything else."""
    m = _ROUTE.match(name)
    return CopyRoute(m["direction"], m["src"], m["dst"]) if m else None


@dataclass
class CopyGroup:
    """The copies of one route, per analyzed step."""

    direction: str
    src: str
    dst: str
    count: float  # per step
    us: float  # GPU time per step
    bytes: float  # per step
    gbs: float  # bytes over GPU time
    blocking: float  # per step: copies the host waited for (the copy call, or a sync in the same op, held it)

    @property
    def route(self) -> CopyRoute:
        return CopyRoute(self.direction, self.src, self.dst)

    @property
    def label(self) -> str:
        return f"{self.direction} ({self.src} -> {self.dst})"

    def to_dict(self) -> dict:
        return asdict(self)


def _blocking(event: GpuEvent, call: RuntimeCall | None, syncing_ops: set[int]) -> bool:
    if call is None:
        return False
    # The call itself lasted until the copy was done, or the op that made it then waited on the stream.
    return call.end >= event.end or (call.external_id or 0) in syncing_ops


def copy_groups(events: list[GpuEvent], members: list[list[int]], call_of: dict[int, RuntimeCall],
                syncing_ops: set[int]) -> list[CopyGroup]:
    """The copies of the analyzed steps grouped by route, most time first; `syncing_ops` are the external
    ids of the ops that made a blocking call."""
    sums: dict[CopyRoute, list[float]] = {}
    for indices in members:
        for i in indices:
            g = events[i]
            route = copy_route(g.name) if g.kind == "memcpy" else None
            if route is None:
                continue
            acc = sums.setdefault(route, [0.0, 0.0, 0.0, 0.0])
            acc[0] += 1
            acc[1] += g.dur
            acc[2] += g.bytes or 0
            acc[3] += _blocking(g, call_of.get(g.correlation), syncing_ops)
    n = max(1, len(members))
    groups = [CopyGroup(r.direction, r.src, r.dst, c / n, us / n, b / n, b / (us * 1e3) if us > 0 else 0.0, blk / n)
              for r, (c, us, b, blk) in sums.items()]
    return sorted(groups, key=lambda g: -g.us)


def pinned_saving_us(group: CopyGroup) -> float:
    """GPU time per step a pageable route would save at the pinned rate; 0 for copies too small to gain."""
    if not group.route.pageable or group.bytes < PAGEABLE_MIN_BYTES * group.count:
        return 0.0
    return max(0.0, group.us - group.bytes / (PINNED_COPY_GBS * 1e3))


def pageable_fix_text(group: CopyGroup) -> str:
    if group.direction == "HtoD":
        return ("copy from pinned memory: pin the host tensor once, outside the loop (x = x.pin_memory()), and copy "
                "with x.to('cuda', non_blocking=True); better, keep the data on the GPU if it does not change")
    return ("copy into a pinned buffer (torch.empty(..., pin_memory=True)) with out.copy_(x, non_blocking=True) and "
            "read it after an event, once per step; better, keep the value on the GPU")


def copies_evidence(groups: list[CopyGroup], wall_us: float) -> str | None:
    """One line on the step's copies, largest route first."""
    if not groups:
        return None
    parts = []
    for g in groups[:3]:
        blocking = f", {g.blocking:g} blocking" if g.blocking else ""
        parts.append(f"{g.label} {g.count:g}x {g.bytes / 1e6:,.1f} MB in {g.us:.0f} us ({g.gbs:.1f} GB/s{blocking})")
    total = sum(g.us for g in groups)
    share = f" ({100 * total / wall_us:.0f}% of the step)" if wall_us else ""
    return f"copies per step{share}: " + "; ".join(parts)
