"""Profile a callable or a script with torch.profiler and hand the trace to the analysis.

Steps are "ProfilerStep#N" ranges, the same names torch.profiler's own `prof.step()` writes, so a
trace recorded here and one recorded elsewhere read the same way. At the end of each step the
doctor waits for the GPU inside a "fuselab.doctor.step_boundary" range: steps then do not
overlap on the GPU, and the analysis leaves that wait out of the workload's syncs. Each step also
records torch's float32 matmul precision (whether TF32 was allowed) as a zero-length range, and
each sync's exact source line (sync_sites.py).

A script's steps after the profiled ones are timed without the profiler: each of the next
UNPROFILED_STEPS steps ends with the same wait for the GPU, and the median time between those
ends is the unprofiled step time; the rest of the script runs undisturbed.
"""

from __future__ import annotations

import os
import runpy
import statistics
import sys
import tempfile
import time
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from fuselab.device import Ceilings, ceilings as measured_ceilings, has_cuda
from fuselab.doctor.analyze import analyze_file
from fuselab.doctor.precision import FP32_PRECISION_MARK
from fuselab.doctor.sync_sites import SyncSiteRecorder
from fuselab.doctor.syncs import STEP_BOUNDARY
from fuselab.doctor.trace import STEP_PREFIX
from fuselab.doctor.verdict import Diagnosis, verdict_for
from fuselab.timing import bench

BATCH_FACTOR = 10
UNPROFILED_REP_MS = 50.0  # enough repetitions for a stable median of a step, without doubling the run
UNPROFILED_STEPS = 20  # a script's steps timed without the profiler, at most


def _wait_for_gpu() -> None:
    if has_cuda():
        torch.cuda.synchronize()


class _Session:
    """The profiler run that `step()` marks steps in; at most `max_steps` steps are recorded, then up to
    UNPROFILED_STEPS are timed without the profiler."""

    def __init__(self, prof: profile, max_steps: int | None):
        self.prof = prof
        self.max_steps = max_steps
        self.recorded = 0
        self.open_range: record_function | None = None
        self.sync_sites = SyncSiteRecorder()
        self.unprofiled_ends: list[float] | None = None  # perf_counter at each unprofiled step end, once profiling stopped

    def open_step(self) -> None:
        self.open_range = record_function(f"{STEP_PREFIX}{self.recorded}")
        self.open_range.__enter__()
        with record_function(FP32_PRECISION_MARK + torch.get_float32_matmul_precision()):
            pass

    def close_step(self) -> None:
        with record_function(STEP_BOUNDARY):
            _wait_for_gpu()
        self.open_range.__exit__(None, None, None)
        self.open_range = None
        self.recorded += 1

    def stop_profiling(self) -> None:
        """Stop recording; time the steps that follow from here."""
        self.sync_sites.stop()
        self.prof.stop()
        _wait_for_gpu()
        self.unprofiled_ends = [time.perf_counter()]

    def end_unprofiled_step(self) -> None:
        if self.unprofiled_ends is not None and len(self.unprofiled_ends) <= UNPROFILED_STEPS:
            _wait_for_gpu()
            self.unprofiled_ends.append(time.perf_counter())

    @property
    def unprofiled_step_us(self) -> list[float]:
        ends = self.unprofiled_ends or []
        return [1e6 * (b - a) for a, b in zip(ends, ends[1:])]

    @property
    def full(self) -> bool:
        return self.max_steps is not None and self.recorded >= self.max_steps


# The run a script's `step()` calls mark: set by `record_trace` / `profile_script` for their duration.
_SESSION: ContextVar[_Session | None] = ContextVar("fuselab_doctor_session", default=None)


def step() -> None:
    """Mark the end of one step of a workload being profiled by `fuselab doctor SCRIPT`; a no-op otherwise.

    Call it once per iteration (per decode step, per training step). Once enough steps are
    recorded, profiling stops and the rest of the script runs unprofiled.
    """
    session = _SESSION.get()
    if session is None:
        return
    if session.open_range is None:
        session.end_unprofiled_step()
        return
    session.close_step()
    if session.full:
        session.stop_profiling()
        return
    session.open_step()


def _profiler() -> profile:
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if has_cuda() else [])
    return profile(activities=activities, record_shapes=True, with_stack=True)


def _check_callable(fn: Callable[[], object]) -> None:
    if not callable(fn):
        raise TypeError(f"fn must be a callable taking no arguments, got {type(fn).__name__}")


def _check_counts(steps: int, warmup: int) -> None:
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 0:
        raise ValueError(f"warmup must be an int >= 0, got {warmup!r}")


def record_trace(fn: Callable[[], object], path: str | os.PathLike, steps: int = 5, warmup: int = 2,
                 on_step: Callable[[int, int], None] | None = None) -> Path:
    """Run fn `warmup` times unprofiled, then once more plus `steps` marked steps under the profiler, and
    write the trace to path.

    A path ending in .gz is written gzipped. Without CUDA only the host side is recorded.
    """
    _check_callable(fn)
    _check_counts(steps, warmup)
    for _ in range(warmup):
        fn()
    if has_cuda():
        torch.cuda.synchronize()
    prof = _profiler()
    session = _Session(prof, max_steps=None)
    with prof:
        # One call outside any step takes the slower first launches under a fresh profiler; the
        # analysis ignores work outside steps. The profiler's own stalls (its "overhead" events,
        # such as a buffer request that can still land in the first step) it leaves out as well.
        fn()
        if has_cuda():
            torch.cuda.synchronize()
        token = _SESSION.set(session)
        try:
            with session.sync_sites:
                for i in range(steps):
                    session.open_step()
                    fn()
                    session.close_step()
                    if on_step:
                        on_step(i + 1, steps)
        finally:
            _SESSION.reset(token)
    prof.export_chrome_trace(str(path))
    return Path(path)


def _resolve_ceilings(ceilings: Ceilings | str | os.PathLike | None) -> Ceilings:
    if ceilings is None or isinstance(ceilings, (str, os.PathLike)):
        return measured_ceilings(ceilings)
    if isinstance(ceilings, Ceilings):
        return ceilings
    raise TypeError(f"ceilings must be a Ceilings, a probe JSON path or None, got {type(ceilings).__name__}")


def batch_test(batch_scale: Callable[[int], Callable[[], object]], factor: int = BATCH_FACTOR) -> dict:
    """Time the workload at its batch and at `factor` times it: a launch-bound step barely slows down."""
    base = bench(batch_scale(1), warmup_ms=10, rep_ms=50, flush_l2=False).median_us
    scaled = bench(batch_scale(factor), warmup_ms=10, rep_ms=50, flush_l2=False).median_us
    return {"factor": factor, "time_us_1x": base, f"time_us_{factor}x": scaled, "ratio": scaled / base if base else float("inf")}


def diagnose(
    fn: Callable[[], object],
    steps: int = 5,
    warmup: int = 2,
    batch_scale: Callable[[int], Callable[[], object]] | None = None,
    ceilings: Ceilings | str | os.PathLike | None = None,
    progress: bool = True,
) -> Diagnosis:
    """Profile `fn()` (one step of a GPU workload) and say what bounds it: launch, sync, memory or compute.

    The step is also timed without the profiler, which slows host code several times over, and is
    judged at that speed. `batch_scale(k)`, when given, returns a callable that runs the workload at
    k times its batch; the step is then also timed at 1x and 10x (nearly unchanged time means a
    fixed cost per step).
    `ceilings` is a `Ceilings`, a `fuselab probe` JSON path, or None for this machine's cached probe
    (else the stated table).
    """
    _check_callable(fn)
    _check_counts(steps, warmup)
    if batch_scale is not None and not callable(batch_scale):
        raise TypeError(f"batch_scale must be a callable k -> callable, got {type(batch_scale).__name__}")
    roofline = _resolve_ceilings(ceilings)
    if not has_cuda():
        raise RuntimeError("diagnose profiles GPU work and needs CUDA, which this machine lacks; "
                           "fuselab.doctor.analyze_trace reads a trace recorded elsewhere")
    from rich.progress import Progress

    with Progress(transient=True, disable=not progress) as bar, tempfile.TemporaryDirectory() as tmp:
        task = bar.add_task("profiling", total=steps)
        path = record_trace(fn, Path(tmp) / "trace.json", steps=steps, warmup=warmup,
                            on_step=lambda i, n: bar.update(task, completed=i, description=f"profiling step {i}/{n}"))
        analysis = analyze_file(path, ceilings=roofline, on_stage=lambda s: bar.update(task, description=f"analyzing: {s}"))
        bar.update(task, description="timing without the profiler")
        # No L2 flush: the profiled steps ran on a warm cache too, so the kernel time compares.
        unprofiled = bench(fn, warmup_ms=10, rep_ms=UNPROFILED_REP_MS, flush_l2=False).median_us
        test = None
        if batch_scale is not None:
            bar.update(task, description=f"timing at 1x and {BATCH_FACTOR}x the batch")
            test = batch_test(batch_scale)
    return verdict_for(analysis, test, unprofiled_us=unprofiled)


@dataclass
class ScriptRun:
    trace: Path
    recorded: int  # steps marked under the profiler (1 for a script that marks none)
    unprofiled_step_us: list[float]  # the steps timed after profiling stopped

    @property
    def unprofiled_us(self) -> float | None:
        """The median unprofiled step, or None when the script ran no step past the profiled ones."""
        return statistics.median(self.unprofiled_step_us) if self.unprofiled_step_us else None


def record_script(script: str | os.PathLike, argv: list[str], trace_path: str | os.PathLike,
                  steps: int = 5, warmup: int = 1) -> ScriptRun:
    """Run a Python script as __main__ under the profiler, then time its remaining steps without it.

    The script marks steps with `fuselab.doctor.step()`; the first `warmup` steps are recorded but
    meant to be skipped by the analysis. A script that marks none is recorded whole as one step.
    """
    path = Path(script)
    if not path.is_file():
        raise ValueError(f"script: no such file {path}")
    _check_counts(steps, warmup)
    prof = _profiler()
    session = _Session(prof, max_steps=warmup + steps)
    token = _SESSION.set(session)
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [str(path), *argv]
    sys.path.insert(0, str(path.parent.resolve()))
    prof.start()
    session.sync_sites.start()
    session.open_step()
    try:
        runpy.run_path(str(path), run_name="__main__")
    except SystemExit as stop:
        if stop.code not in (0, None):
            raise
    finally:
        _SESSION.reset(token)
        if session.open_range is not None:  # else step() already stopped the profiler
            session.close_step()
            session.sync_sites.stop()
            prof.stop()
        sys.argv, sys.path[:] = saved_argv, saved_path
    prof.export_chrome_trace(str(trace_path))
    return ScriptRun(Path(trace_path), session.recorded, session.unprofiled_step_us)


def profile_script(script: str | os.PathLike, argv: list[str], trace_path: str | os.PathLike,
                   steps: int = 5, warmup: int = 1) -> tuple[Path, int]:
    """`record_script`, returning only the trace path and the steps it marked."""
    run = record_script(script, argv, trace_path, steps=steps, warmup=warmup)
    return run.trace, run.recorded
