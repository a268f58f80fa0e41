"""`fuselab doctor`: profile a workload and say why it is slow (launch-, sync-, memory- or compute-bound).

    from fuselab.doctor import diagnose, analyze_trace
    d = diagnose(lambda: model(x), steps=5)        # profile a callable on the GPU
    d = analyze_trace("trace.json.gz")             # or read a trace torch.profiler exported
    print(d.verdict, d.fixes[0].action); d.to_dict()

trace (read Kineto JSON) -> analyze (steps, gaps, syncs, roofline, sequences) -> summary -> rules (one per
finding) -> verdict + ranked fixes -> report (text, JSON, HTML).
"""

from __future__ import annotations

import os

from fuselab.device import Ceilings
from fuselab.doctor.analyze import analyze_file
from fuselab.doctor.profile import diagnose, step
from fuselab.doctor.verdict import Diagnosis, verdict_for


def analyze_trace(
    path: str | os.PathLike,
    probe: str | os.PathLike | None = None,
    ceilings: Ceilings | None = None,
    skip_steps: int = 0,
) -> Diagnosis:
    """Diagnose a trace file (.json or .json.gz) that torch.profiler exported.

    The roofline uses `ceilings` if given, else the probe result at `probe`, else this machine's
    cached `fuselab probe` result, else the stated table. `skip_steps` drops the first steps (warm-up).
    """
    return verdict_for(analyze_file(path, probe=probe, ceilings=ceilings, skip_steps=skip_steps))


__all__ = ["Diagnosis", "analyze_trace", "diagnose", "step"]
