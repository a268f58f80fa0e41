"""The kernels that take a step's GPU time, costliest first: how often, how long, how fast and how wide.

Kernels are grouped by name over the analyzed steps. The achieved rate is TFLOP/s for kernels the
roofline places on the compute side and GB/s for the memory side, from the FLOPs and bytes of the
launching op's recorded shapes; it is blank where the op or its shapes are unknown (Kineto gives
kernels no byte counts of their own). The ceiling is the one the roofline held the kernel against.
A kernel launched with fewer blocks than the GPU has SMs leaves the other SMs idle while it runs:
a batch-1 GEMV split into 8 blocks runs on 8 of an H200's 132 SMs. NCCL kernels are communication.
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass

from fuselab.doctor.analyze import Analysis
from fuselab.doctor.trace import Trace, is_communication

TOP_KERNELS = 15
UNITS = {"compute": "TFLOP/s", "memory": "GB/s"}
_TEMPLATE = re.compile(r"<[^<>]*>")


def short_name(name: str) -> str:
    """A kernel's name without return type, namespaces, template and arguments: "CatArrayBatchedCopy"."""
    short = name.removeprefix("void ").replace("(anonymous namespace)::", "")
    while _TEMPLATE.search(short):
        short = _TEMPLATE.sub("", short)
    return short.split("(")[0].split("::")[-1].strip() or name


@dataclass
class KernelRow:
    name: str
    label: str  # the short name: no templates, no arguments
    op: str | None  # the CPU op that launched most of its time
    calls_per_step: float
    us_per_step: float
    share: float  # of the step
    bound: str  # "compute", "memory" or "communication"
    achieved: float | None  # in `unit`, over the calls whose FLOPs or bytes are known
    unit: str | None
    ceiling: float | None  # in `unit`
    pct_of_ceiling: float | None
    grid: tuple[int, ...] | None  # the grid and block it ran with most of its time
    block: tuple[int, ...] | None
    blocks: int | None
    sms: int | None
    underfilled: bool  # fewer blocks than SMs

    def to_dict(self) -> dict:
        return asdict(self)


def sm_count(trace: Trace, device: int) -> int | None:
    """The SMs of `device` as the trace recorded them, else those of this machine's GPU, if it has one."""
    for props in trace.device_properties:
        if props.get("id", 0) == device and isinstance(props.get("numSms"), int):
            return props["numSms"]
    from fuselab.device import device_info, has_cuda

    return device_info().sm_count if has_cuda() else None


def _rate(bound: str, amount: float, dur_us: float) -> float:
    """FLOPs over us as TFLOP/s, or bytes over us as GB/s."""
    return amount / (dur_us * (1e6 if bound == "compute" else 1e3))


def _row(a: Analysis, name: str, indices: list[int], n_steps: int, step_us: float,
         sms: dict[int, int | None]) -> KernelRow:
    events = [a.trace.gpu[i] for i in indices]
    total = sum(g.dur for g in events)
    time_by: dict[str, Counter] = {"op": Counter(), "bound": Counter(), "shape": Counter()}
    for i, g in zip(indices, events):
        cost = a.costs[i]
        time_by["op"][cost.op] += g.dur
        time_by["bound"][cost.bound] += g.dur
        time_by["shape"][(g.grid, g.block, g.device)] += g.dur
    communication = is_communication(events[0])
    bound = "communication" if communication else time_by["bound"].most_common(1)[0][0]
    achieved = ceiling = pct = None
    if not communication:
        # Over the calls whose FLOPs or bytes are known and that sit on the group's side of the ridge.
        known = [a.costs[i] for i in indices if a.costs[i].bound == bound and a.costs[i].pct_of_ceiling is not None]
        dur = sum(c.dur_us for c in known)
        if dur > 0:
            amount = sum(c.flops if bound == "compute" else c.bytes for c in known)
            achieved = _rate(bound, amount, dur)
            pct = sum(c.pct_of_ceiling * c.dur_us for c in known) / dur
            ceiling = achieved * 100 / pct if pct > 0 else None
    grid, block, device = time_by["shape"].most_common(1)[0][0]
    blocks = math.prod(grid) if grid else None
    if device not in sms:
        sms[device] = sm_count(a.trace, device)
    device_sms = sms[device]
    return KernelRow(
        name=name, label=short_name(name), op=time_by["op"].most_common(1)[0][0],
        calls_per_step=len(events) / n_steps, us_per_step=total / n_steps,
        share=total / n_steps / step_us if step_us > 0 else 0.0, bound=bound,
        achieved=achieved, unit=UNITS.get(bound) if achieved is not None else None, ceiling=ceiling, pct_of_ceiling=pct,
        grid=grid, block=block, blocks=blocks, sms=device_sms,
        underfilled=blocks is not None and device_sms is not None and blocks < device_sms,
    )


def kernel_table(a: Analysis, step_us: float) -> list[KernelRow]:
    """Every kernel of the analyzed steps, grouped by name, most GPU time per step first; `step_us`
    is the step time the shares are of."""
    members: dict[str, list[int]] = defaultdict(list)
    for indices in a.step_events:
        for i in indices:
            if a.trace.gpu[i].kind == "kernel":
                members[a.trace.gpu[i].name].append(i)
    n_steps = max(len(a.steps), 1)
    sms: dict[int, int | None] = {}
    rows = [_row(a, name, indices, n_steps, step_us, sms) for name, indices in members.items()]
    return sorted(rows, key=lambda r: -r.us_per_step)
