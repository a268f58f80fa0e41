"""The doctor's detail tables beside the verdict: top kernels, time by region, and streams."""

from __future__ import annotations

from dataclasses import dataclass

from fuselab.doctor.analyze import Analysis
from fuselab.doctor.kernels_table import KernelRow, kernel_table
from fuselab.doctor.regions import Regions, regions
from fuselab.doctor.streams import Streams, streams
from fuselab.doctor.trace import gc_paused


@dataclass
class Views:
    kernels: list[KernelRow]  # every kernel, most time per step first
    regions: Regions
    streams: Streams

    def to_dict(self) -> dict:
        return {"kernels": [k.to_dict() for k in self.kernels], "regions": self.regions.to_dict(),
                "streams": self.streams.to_dict()}


def views(analysis: Analysis, step_us: float) -> Views:
    """The tables of an analysis; `step_us` is the step time that shares of the step are of."""
    with gc_paused():  # many small objects, no cycles: see trace.gc_paused
        return Views(kernel_table(analysis, step_us), regions(analysis), streams(analysis, step_us))
