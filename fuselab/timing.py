"""Timing that is right on an asynchronous device.

A CUDA launch returns as soon as the work is queued, so a host clock read around it measures the
launch, not the kernel. Three tools, from coarse to fine:

- `Timers` / `Timer`: named wall-clock timers in the style of Megatron-LM. `start()` and `stop()`
  synchronize the device, so the time is that of the work, at the price of draining the queue.
  Timers above the configured log level are free no-ops (no sync), so they can stay in code.
- `cuda_timer()`: CUDA events recorded around a region; no host sync inside the region.
- `bench(fn)`: a do_bench-style harness: warm-up, repetitions chosen from an estimate, median and
  quantiles, an optional L2 flush, and a CUDA-graph mode that removes launch overhead.
"""

from __future__ import annotations

import json
import math
import statistics
import time
import warnings
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterator

import torch

from fuselab.device import has_cuda, recover_from_failed_capture


def _synchronize(barrier: bool = False) -> None:
    if has_cuda():
        torch.cuda.synchronize()
    if barrier and torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


# --------------------------------------------------------------------------------------------
# Megatron-style timers
# --------------------------------------------------------------------------------------------


class Timer:
    """Accumulates synchronized wall time over start/stop pairs until `elapsed(reset=True)`."""

    def __init__(self, name: str, log_level: int = 0):
        self.name = name
        self.log_level = log_level
        self._total = 0.0
        self._count = 0
        self._started_at: float | None = None

    @property
    def active(self) -> bool:
        return self._started_at is not None

    @property
    def count(self) -> int:
        return self._count

    def start(self, barrier: bool = False) -> None:
        if self._started_at is not None:
            raise RuntimeError(f"timer {self.name!r} was started twice without stop()")
        _synchronize(barrier)
        self._started_at = time.perf_counter()

    def stop(self, barrier: bool = False) -> None:
        if self._started_at is None:
            raise RuntimeError(f"timer {self.name!r} was stopped without start()")
        _synchronize(barrier)
        self._total += time.perf_counter() - self._started_at
        self._count += 1
        self._started_at = None

    def reset(self) -> None:
        self._total, self._count, self._started_at = 0.0, 0, None

    def elapsed(self, reset: bool = True, barrier: bool = False) -> float:
        """Seconds accumulated so far; a running timer is stopped, read and restarted."""
        running = self.active
        if running:
            self.stop(barrier=barrier)
        total = self._total
        if reset:
            self.reset()
        if running:
            self.start(barrier=barrier)
        return total

    def summary(self) -> dict:
        mean = self._total / self._count if self._count else 0.0
        return {"count": self._count, "total_ms": self._total * 1e3, "mean_ms": mean * 1e3, "log_level": self.log_level}

    def __enter__(self) -> "Timer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class _NullTimer(Timer):
    """Handed out for timers above the log level: every method is free and never synchronizes."""

    def __init__(self) -> None:
        super().__init__("<disabled>", log_level=-1)

    def start(self, barrier: bool = False) -> None:
        pass

    def stop(self, barrier: bool = False) -> None:
        pass

    def elapsed(self, reset: bool = True, barrier: bool = False) -> float:
        return 0.0


NULL_TIMER = _NullTimer()


class Timers:
    """A registry of named timers with log levels: `timers("forward", log_level=1).start()`.

    `Timers(log_level=N)` keeps timers whose level is <= N; asking for one above N returns a no-op
    timer, so fine-grained timers cost nothing (and add no syncs) unless the level is raised.
    """

    def __init__(self, log_level: int = 2, default_level: int = 0):
        if not isinstance(log_level, int) or log_level < 0:
            raise ValueError(f"log_level must be a non-negative int, got {log_level!r}")
        self.log_level = log_level
        self.default_level = default_level
        self._timers: dict[str, Timer] = {}

    def __call__(self, name: str, log_level: int | None = None) -> Timer:
        level = self.default_level if log_level is None else log_level
        if level > self.log_level:
            return NULL_TIMER
        timer = self._timers.get(name)
        if timer is None:
            timer = self._timers[name] = Timer(name, level)
        elif log_level is not None and timer.log_level != level:
            raise ValueError(f"timer {name!r} exists with log_level={timer.log_level}, asked for log_level={level}")
        return timer

    @property
    def names(self) -> list[str]:
        return list(self._timers)

    def to_dict(self, names: list[str] | None = None, reset: bool = False) -> dict[str, dict]:
        out = {}
        for name in names or self.names:
            timer = self._timers[name]
            if timer.active:
                raise RuntimeError(f"timer {name!r} is still running; stop it before reporting")
            out[name] = timer.summary()
            if reset:
                timer.reset()
        return out

    def to_json(self, path: str | None = None, reset: bool = False) -> str:
        text = json.dumps(self.to_dict(reset=reset), indent=2)
        if path is not None:
            with open(path, "w") as f:
                f.write(text + "\n")
        return text

    def table(self, names: list[str] | None = None, reset: bool = False):
        """A rich Table of count, total and mean per timer."""
        from rich.table import Table

        table = Table(title="timers (synchronized wall time)")
        for col in ("timer", "level", "count", "total ms", "mean ms"):
            table.add_column(col, justify="left" if col == "timer" else "right")
        for name, s in self.to_dict(names, reset=reset).items():
            table.add_row(name, str(s["log_level"]), str(s["count"]), f"{s['total_ms']:.3f}", f"{s['mean_ms']:.3f}")
        return table

    def log(self, names: list[str] | None = None, reset: bool = True) -> str:
        """One line, Megatron's style: `time (ms) | forward: 12.34 | backward: 23.45`."""
        parts = [f"{n}: {s['total_ms']:.2f}" for n, s in self.to_dict(names, reset=reset).items()]
        return "time (ms) | " + " | ".join(parts)


# --------------------------------------------------------------------------------------------
# CUDA-event timing of a region
# --------------------------------------------------------------------------------------------


class RegionTime:
    """The result of `cuda_timer()`; reading `.ms` waits for the end event (once), not the device."""

    def __init__(self, use_events: bool):
        self.source = "cuda-events" if use_events else "wall-clock"
        self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if use_events else None
        self._wall: list[float] = [0.0, 0.0]

    def _begin(self) -> None:
        if self._events:
            self._events[0].record()
        else:
            self._wall[0] = time.perf_counter()

    def _end(self) -> None:
        if self._events:
            self._events[1].record()
        else:
            self._wall[1] = time.perf_counter()

    @property
    def ms(self) -> float:
        if self._events:
            self._events[1].synchronize()
            return self._events[0].elapsed_time(self._events[1])
        return (self._wall[1] - self._wall[0]) * 1e3


@contextmanager
def cuda_timer() -> Iterator[RegionTime]:
    """Time a region on the GPU with CUDA events: `with cuda_timer() as t: ...; print(t.ms)`.

    Events are recorded on the current stream; nothing inside the region waits for the device.
    Without CUDA it times the region with the host clock (`t.source == "wall-clock"`).
    """
    t = RegionTime(use_events=has_cuda())
    t._begin()
    yield t
    t._end()


# --------------------------------------------------------------------------------------------
# bench(): a do_bench-style harness
# --------------------------------------------------------------------------------------------


@dataclass
class BenchResult:
    median_us: float
    mean_us: float
    min_us: float
    max_us: float
    quantiles_us: dict[float, float]
    reps: int
    mode: str  # "cuda-events", "cuda-events, host ahead", "cuda-graph" or "wall-clock"
    flush_l2: bool
    samples_us: list[float] = field(default_factory=list, repr=False)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("samples_us")
        d["quantiles_us"] = {str(q): v for q, v in self.quantiles_us.items()}
        return d

    def __str__(self) -> str:
        return f"{self.median_us:.2f} us (median of {self.reps}, {self.mode})"


_l2_flush_buffers: dict[int, torch.Tensor] = {}


def _flush_l2() -> None:
    """Overwrite a buffer larger than the L2 cache so the next kernel reads from HBM."""
    dev = torch.cuda.current_device()
    buf = _l2_flush_buffers.get(dev)
    if buf is None:
        l2 = getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 0) or 64 * 2**20
        buf = _l2_flush_buffers[dev] = torch.empty(max(4 * l2, 256 * 2**20), dtype=torch.int8, device="cuda")
    buf.zero_()


def _quantile(sorted_samples: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    pos = q * (len(sorted_samples) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_samples[lo] + (sorted_samples[hi] - sorted_samples[lo]) * (pos - lo)


def _result(samples_us: list[float], quantiles, mode: str, flush_l2: bool) -> BenchResult:
    s = sorted(samples_us)
    return BenchResult(
        median_us=statistics.median(s), mean_us=statistics.fmean(s), min_us=s[0], max_us=s[-1],
        quantiles_us={q: _quantile(s, q) for q in quantiles}, reps=len(s), mode=mode,
        flush_l2=flush_l2, samples_us=samples_us,
    )


def _reps_for(estimate_ms: float, budget_ms: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, budget_ms / max(estimate_ms, 1e-6))))


_sleep_cycles_per_us: dict[int, float] = {}


def _sleep_rate() -> float:
    """Cycles per µs of torch.cuda._sleep's spin loop on the current device, measured once."""
    dev = torch.cuda.current_device()
    if dev not in _sleep_cycles_per_us:
        cycles = 2_000_000
        torch.cuda._sleep(cycles)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        _sleep_cycles_per_us[dev] = cycles / (start.elapsed_time(end) * 1e3)
    return _sleep_cycles_per_us[dev]


def _host_issue_us(fn, calls: int = 5) -> float:
    """Wall time the host takes to issue one call of fn, the GPU idle and nothing synced inside."""
    samples = []
    for _ in range(calls):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(samples)


def _bench_events(fn, warmup_ms, rep_ms, min_reps, max_reps, flush_l2, host_ahead=False) -> list[float]:
    # host_ahead: a spin kernel, twice as long as the host takes to issue fn, runs before each timed
    # call, so all of fn's launches are queued when the GPU reaches the start event.
    sleep_us = 2 * _host_issue_us(fn) + 20 if host_ahead else 0.0
    sleep_cycles = int(sleep_us * _sleep_rate()) if host_ahead else 0

    def timed(n: int) -> list[float]:
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        for s, e in zip(starts, ends):
            if flush_l2:
                _flush_l2()  # outside the events: its time is not counted
            if sleep_cycles:
                torch.cuda._sleep(sleep_cycles)
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        return [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]

    estimate_ms = statistics.median(timed(5)) / 1e3
    for _ in range(_reps_for(estimate_ms, warmup_ms, 1, max_reps)):
        fn()
    # The spin kernels take GPU time too: they count against the time budget.
    return timed(_reps_for(estimate_ms + sleep_us / 1e3, rep_ms, min_reps, max_reps))


def _bench_graph(fn, warmup_ms, rep_ms, min_reps, max_reps) -> list[float]:
    # Warm up on a side stream, as capture requires (lazy init, autotuning, allocator warm-up).
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()

    def capture(n_inner: int) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        caller = torch.cuda.current_stream()
        try:
            with torch.cuda.graph(graph):
                for _ in range(n_inner):
                    fn()
        except Exception as err:
            recover_from_failed_capture(caller)
            raise RuntimeError(
                f"bench(cuda_graph=True): fn could not be captured in a CUDA graph ({err}). "
                "Graph capture forbids host syncs (.item(), .cpu(), printing a tensor) and CPU tensors; "
                "remove them from fn or time it with cuda_graph=False."
            ) from err
        return graph

    def replay_times(graph: torch.cuda.CUDAGraph, n: int, n_inner: int) -> list[float]:
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        for s, e in zip(starts, ends):
            s.record()
            graph.replay()
            e.record()
        torch.cuda.synchronize()
        return [s.elapsed_time(e) * 1e3 / n_inner for s, e in zip(starts, ends)]

    probe = capture(1)
    estimate_ms = statistics.median(replay_times(probe, 5, 1)) / 1e3
    del probe
    # Unroll enough calls into one graph that the single replay launch is noise (~1 ms per replay).
    n_inner = _reps_for(estimate_ms, 1.0, 1, 1000)
    graph = capture(n_inner)
    replay_ms = estimate_ms * n_inner
    for _ in range(_reps_for(replay_ms, warmup_ms, 1, max_reps)):
        graph.replay()
    return replay_times(graph, _reps_for(replay_ms, rep_ms, min_reps, max_reps), n_inner)


def _bench_wall(fn, warmup_ms, rep_ms, min_reps, max_reps) -> list[float]:
    def timed(n: int) -> list[float]:
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e6)
        return out

    estimate_ms = statistics.median(timed(3)) / 1e3
    timed(_reps_for(estimate_ms, warmup_ms, 1, max_reps))
    return timed(_reps_for(estimate_ms, rep_ms, min_reps, max_reps))


def bench(
    fn: Callable[[], object],
    *,
    warmup_ms: float = 25.0,
    rep_ms: float = 100.0,
    quantiles: tuple[float, ...] = (0.2, 0.5, 0.8),
    flush_l2: bool = True,
    cuda_graph: bool = False,
    host_ahead: bool = False,
    min_reps: int = 10,
    max_reps: int = 10_000,
    device: str | torch.device | None = None,
) -> BenchResult:
    """Time `fn()` (no arguments) and return the median and quantiles in microseconds.

    The number of repetitions follows from an estimate of one call, so that warm-up takes about
    `warmup_ms` and measurement about `rep_ms`. Each repetition is timed with its own pair of CUDA
    events; with `flush_l2` the L2 cache is overwritten between repetitions (outside the timed
    region), so memory-bound kernels are timed from HBM. With `cuda_graph=True`, calls are captured
    into a CUDA graph and replayed, which removes launch overhead from the figure:
    eager time - graph time = what launching cost. With `host_ahead=True`, the GPU is kept busy
    while the host issues each call (a spin kernel before the start event), so the figure is the
    time of fn's kernels alone even where issuing them costs the host more than they take: what fn
    costs in a step whose host runs ahead of the GPU, L2 still flushed. Without CUDA (or with
    `device="cpu"`), it times with the host clock and says so (`result.mode == "wall-clock"`).
    """
    if not callable(fn):
        raise TypeError(f"fn must be a callable taking no arguments, got {type(fn).__name__}")
    if not (warmup_ms >= 0):
        raise ValueError(f"warmup_ms must be >= 0, got {warmup_ms}")
    if not (rep_ms > 0):
        raise ValueError(f"rep_ms must be > 0, got {rep_ms}")
    if not quantiles or any(not (0.0 <= q <= 1.0) for q in quantiles):
        raise ValueError(f"quantiles must be a non-empty sequence of values in [0, 1], got {quantiles}")
    if cuda_graph and host_ahead:
        raise ValueError("host_ahead=True has no use with cuda_graph=True: a graph replay already leaves the host out")
    if not (1 <= min_reps <= max_reps):
        raise ValueError(f"need 1 <= min_reps <= max_reps, got min_reps={min_reps}, max_reps={max_reps}")

    on_gpu = has_cuda() if device is None else torch.device(device).type == "cuda"
    if on_gpu and not has_cuda():
        raise ValueError(f"device={device!r} asks for CUDA, but no CUDA device is available")
    if not on_gpu:
        if cuda_graph:
            warnings.warn("bench: no CUDA device, so cuda_graph=True is ignored; timing with the host clock", stacklevel=2)
        else:
            warnings.warn("bench: no CUDA device; timing CPU execution with the host clock", stacklevel=2)
        return _result(_bench_wall(fn, warmup_ms, rep_ms, min_reps, max_reps), quantiles, "wall-clock", False)

    fn()  # first call: compilation, autotuning, lazy module loading
    torch.cuda.synchronize()
    if cuda_graph:
        # Flushing between calls cannot happen inside one replay, so graph mode times warm-cache calls.
        return _result(_bench_graph(fn, warmup_ms, rep_ms, min_reps, max_reps), quantiles, "cuda-graph", False)
    mode = "cuda-events, host ahead" if host_ahead else "cuda-events"
    return _result(_bench_events(fn, warmup_ms, rep_ms, min_reps, max_reps, flush_l2, host_ahead), quantiles, mode, flush_l2)
