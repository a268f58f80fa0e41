"""What every labelled workload shares: its arguments, its device and sizes, and its step loop, both ways.

    for i in steps(args):   # one iteration per step
        ...

marks each step for `fuselab doctor SCRIPT` with fuselab.doctor.step(), and, given --profiler-trace
PATH, records the run the way users record theirs: torch.profiler with a schedule (wait 1, warm up
1, record 3 steps), prof.step() at each step end and no sync there, the trace exported to PATH.

Each workload starts from torch's defaults (float32 matmuls in full float32) and sets what it
tests itself, so workloads run one after another in one process do not leak settings.
Its EXPECT dict (read by scripts/record-doctor-workloads, never imported) says what the doctor
must find; lines marked `# doctor-label: sync` are where its syncs must be placed.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from fuselab.doctor import step as doctor_step

PROFILER_SCHEDULE = {"wait": 1, "warmup": 1, "active": 3, "repeat": 1}


def parse(description: str, default_steps: int = 14) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=default_steps, help=f"steps to run (default {default_steps})")
    parser.add_argument("--profiler-trace", metavar="PATH",
                        help="record with a plain torch.profiler schedule (wait 1, warmup 1, active 3) and write the trace to PATH")
    args = parser.parse_args()
    torch.set_float32_matmul_precision("highest")
    return args


def on_gpu() -> bool:
    return torch.cuda.is_available()


def device() -> torch.device:
    return torch.device("cuda" if on_gpu() else "cpu")


def pick(gpu, cpu):
    """A size for the GPU run, and a small one for a run on the CPU (a smoke test)."""
    return gpu if on_gpu() else cpu


def require_gpu(what: str) -> None:
    if not on_gpu():
        print(f"this workload needs a CUDA GPU ({what})", file=sys.stderr)
        raise SystemExit(0)


def steps(args: argparse.Namespace) -> Iterator[int]:
    """The step loop: yields each step's index, then marks the step's end."""
    prof = None
    if args.profiler_trace:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu() else [])
        path = args.profiler_trace
        prof = profile(activities=activities, schedule=schedule(**PROFILER_SCHEDULE), record_shapes=True, with_stack=True,
                       on_trace_ready=lambda p: p.export_chrome_trace(path))
        prof.start()
    try:
        for i in range(args.steps):
            yield i
            doctor_step()
            if prof is not None:
                prof.step()
    finally:
        if prof is not None:
            prof.stop()
    if on_gpu():
        torch.cuda.synchronize()
