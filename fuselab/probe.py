"""`fuselab probe`: measure what this GPU costs beyond its arithmetic.

The classic experiment (1000 tiny kernels vs one kernel doing the same work), grown into the figures
every later tool needs: per-launch cost eager / synced / replayed from a CUDA graph, the kernel
size where launch cost stops mattering, the cost of explicit and implicit syncs, the copy-bandwidth
and bf16 matmul ceilings (the roofline), and copy/compute overlap across streams; on several GPUs,
what an NCCL all-reduce costs (fuselab.probe_collectives).

Each section is one function returning a dict of plain numbers; `run_probe` collects them and
`verdict` turns them into advice. Rendering (table, plot) lives in `fuselab.probe_report`.
"""

from __future__ import annotations

import io
import json
import math
import statistics
import sys
import time
import warnings
from datetime import datetime, timezone
from typing import Callable

import torch

from fuselab.device import device_info, has_cuda, probe_cache_path
from fuselab.timing import bench

TINY = 256  # side of the square fp32 tensor of the "tiny kernel" experiment
CHAIN = 1000  # kernels in the launch-overhead chain
SWEEP_SIDES = (256, 362, 512, 724, 1024, 1448, 2048, 2896, 4096, 5793, 8192)  # steps of sqrt(2) in side
LAUNCH_SHARE = 0.10  # "launch cost under 10% of the kernel's time"


def _sync() -> None:
    if has_cuda():
        torch.cuda.synchronize()


def _wall_us(fn: Callable[[], object], trials: int) -> float:
    """Median over trials of the synchronized host-clock time of fn(), in µs."""
    samples = []
    for _ in range(trials):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        samples.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(samples)


def _capture(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # warm-up on a side stream before capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


# --------------------------------------------------------------------------------------------
# 1 + 3. launch overhead and graph replay of the 1000-kernel chain
# --------------------------------------------------------------------------------------------


def measure_launch(trials: int, n: int = CHAIN, side: int = TINY) -> dict:
    dev = "cuda" if has_cuda() else "cpu"
    x = torch.randn(side, side, device=dev)
    big = torch.randn(n * side * side, device=dev)  # one kernel doing the chain's total work

    def chain():
        for _ in range(n):
            x.add_(1.0)

    def chain_synced():
        for _ in range(n):
            x.add_(1.0)
            _sync()

    chain()  # warm-up
    eager = _wall_us(chain, trials) / n
    issue = []  # host time to queue the launches, read before the device is drained
    for _ in range(trials):
        _sync()
        t0 = time.perf_counter()
        chain()
        issue.append((time.perf_counter() - t0) * 1e6 / n)
        _sync()
    out = {
        "kernels": n,
        "tensor": f"{side}x{side} fp32 add_",
        "eager_us_per_kernel": eager,
        "cpu_issue_us_per_launch": statistics.median(issue),
        "launches_per_s": 1e6 / statistics.median(issue),
        "one_kernel_equal_work_us": _wall_us(lambda: big.add_(1.0), trials),
    }
    if has_cuda():
        out["synced_us_per_kernel"] = _wall_us(chain_synced, max(1, trials // 2)) / n
        graph = _capture(chain)
        graph.replay()
        out["graph_us_per_kernel"] = _wall_us(graph.replay, trials) / n
        out["eager_over_graph"] = eager / out["graph_us_per_kernel"]
        # What launching adds per kernel: eager time less the time the same kernels take back to back.
        out["launch_overhead_us"] = max(eager - out["graph_us_per_kernel"], 0.0)
    return out


# --------------------------------------------------------------------------------------------
# 2. size sweep: where kernel time overtakes launch cost
# --------------------------------------------------------------------------------------------


def crossover_side(sides: list[int], kernel_us: list[float], launch_us: float) -> float | None:
    """Square side at which a kernel's own time reaches `launch_us`, interpolated log-log; None if never."""
    points = list(zip(sides, kernel_us))
    if points and points[0][1] >= launch_us:
        return float(points[0][0])
    for (s0, t0), (s1, t1) in zip(points, points[1:]):
        if t0 < launch_us <= t1:
            f = (math.log(launch_us) - math.log(t0)) / (math.log(t1) - math.log(t0))
            return math.exp(math.log(s0) + f * (math.log(s1) - math.log(s0)))
    return None


def measure_size_sweep(trials: int, sides: tuple[int, ...], budget_us: float) -> dict:
    dev = "cuda" if has_cuda() else "cpu"
    rows = []
    for side in sides:
        x = torch.randn(side, side, device=dev)
        x.add_(1.0)
        single = _wall_us(lambda: x.add_(1.0), 3)
        n = int(min(CHAIN, max(10, budget_us / max(single, 1e-3))))

        def chain():
            for _ in range(n):
                x.add_(1.0)

        row = {"side": side, "bytes": 2 * x.numel() * 4, "launches": n, "eager_us_per_kernel": _wall_us(chain, trials) / n}
        if has_cuda():
            graph = _capture(chain)
            graph.replay()
            row["graph_us_per_kernel"] = _wall_us(graph.replay, trials) / n
            row["launch_share_pct"] = 100 * max(0.0, 1 - row["graph_us_per_kernel"] / row["eager_us_per_kernel"])
            del graph
        rows.append(row)
        del x
    out = {"tensor": "side x side fp32 add_", "rows": rows}
    if has_cuda():
        # The launch cost of a tiny kernel is the eager per-kernel time at the smallest size, where the
        # kernel itself is negligible; the crossover is where a kernel's own (graph) time reaches it.
        launch = rows[0]["eager_us_per_kernel"]
        side = crossover_side([r["side"] for r in rows], [r["graph_us_per_kernel"] for r in rows], launch)
        out["launch_cost_us"] = launch
        out["crossover_side"] = side
        out["crossover_bytes"] = None if side is None else 8 * side * side
    return out


# --------------------------------------------------------------------------------------------
# 4. sync cost, explicit and implicit
# --------------------------------------------------------------------------------------------


def measure_syncs(reps: int) -> dict:
    one = torch.randn(1, device="cuda")
    small = torch.randn(1000, device="cuda")
    mat = torch.randn(4, 4, device="cuda")
    sink = io.StringIO()
    cases: dict[str, Callable[[], object]] = {
        "torch.cuda.synchronize()": torch.cuda.synchronize,
        "tensor.item()": one.item,
        "tensor.cpu() (1000 floats)": small.cpu,
        "print(tensor) (4x4)": lambda: print(mat, file=sink),
        "if tensor: (bool)": lambda: bool(one > 0),
        "torch.nonzero (data-dependent shape)": lambda: torch.nonzero(small > 0),
    }
    out = {}
    for name, fn in cases.items():
        fn()
        torch.cuda.synchronize()
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e6)
        out[name] = statistics.median(samples)
    return {"idle_device_us": out, "note": "host time of one call on an idle device; on a busy one it also waits for all queued work"}


# --------------------------------------------------------------------------------------------
# 5. ceilings: copy bandwidth and bf16 matmul rate
# --------------------------------------------------------------------------------------------


def measure_ceilings(copy_bytes: int, gemm_n: int, rep_ms: float) -> dict:
    dev = "cuda" if has_cuda() else "cpu"
    dtype = torch.bfloat16 if has_cuda() else torch.float32
    elem = torch.finfo(dtype).bits // 8
    src = torch.randn(copy_bytes // elem, device=dev, dtype=dtype)
    dst = torch.empty_like(src)
    with warnings.catch_warnings():  # on the CPU the probe already says it times with the host clock
        warnings.simplefilter("ignore")
        copy = bench(lambda: dst.copy_(src), rep_ms=rep_ms, flush_l2=False, min_reps=5)
        del src, dst
        a = torch.randn(gemm_n, gemm_n, device=dev, dtype=dtype)  # random data: zeros run faster than real inputs
        b = torch.randn(gemm_n, gemm_n, device=dev, dtype=dtype)
        mm = bench(lambda: a @ b, rep_ms=rep_ms, flush_l2=False, min_reps=5)
    bw = 2 * copy_bytes / (copy.median_us * 1e3)  # GB/s, bytes read + written
    tflops = 2 * gemm_n**3 / (mm.median_us * 1e6)
    out = {
        "copy_bytes": copy_bytes,
        "copy_us": copy.median_us,
        "copy_bandwidth_gbs": bw,
        "gemm": f"{gemm_n}x{gemm_n}x{gemm_n} {str(dtype).removeprefix('torch.')}",
        "gemm_us": mm.median_us,
        "ridge_flop_per_byte": tflops * 1e12 / (bw * 1e9),
    }
    if has_cuda():
        out["bf16_tflops"] = tflops
    else:
        out["fp32_tflops_cpu"] = tflops
    return out


# --------------------------------------------------------------------------------------------
# 6. streams: copy/compute overlap, pinned vs pageable, event ordering
# --------------------------------------------------------------------------------------------


def _overlap_pct(copy_us: float, compute_us: float, together_us: float) -> float:
    """Share of the shorter task hidden under the longer one when both run at once."""
    hidden = copy_us + compute_us - together_us
    return max(0.0, min(100.0, 100 * hidden / min(copy_us, compute_us)))


def measure_streams(copy_bytes: int, trials: int) -> dict:
    pinned = torch.randn(copy_bytes // 4).pin_memory()
    pageable = torch.randn(copy_bytes // 4)
    dst = torch.empty(copy_bytes // 4, device="cuda")
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    copy_stream, compute_stream = torch.cuda.Stream(), torch.cuda.Stream()

    pinned_us = _wall_us(lambda: dst.copy_(pinned, non_blocking=True), trials)
    pageable_us = _wall_us(lambda: dst.copy_(pageable, non_blocking=True), trials)
    one_mm = _wall_us(lambda: a @ a, trials)
    n_mm = max(1, round(pinned_us / one_mm))  # compute about as long as the copy: overlap is easiest to read

    def compute():
        for _ in range(n_mm):
            a @ a

    compute_us = _wall_us(compute, trials)

    def two_streams(src: torch.Tensor) -> Callable[[], None]:
        def run():
            with torch.cuda.stream(copy_stream):
                dst.copy_(src, non_blocking=True)
            with torch.cuda.stream(compute_stream):
                compute()

        return run

    def one_stream():
        dst.copy_(pinned, non_blocking=True)
        compute()

    serial_us = _wall_us(one_stream, trials)
    overlap_us = _wall_us(two_streams(pinned), trials)
    pageable_two_us = _wall_us(two_streams(pageable), trials)
    return {
        "copy_bytes": copy_bytes,
        "h2d_pinned_gbs": copy_bytes / (pinned_us * 1e3),
        "h2d_pageable_gbs": copy_bytes / (pageable_us * 1e3),
        "copy_us": pinned_us,
        "compute_us": compute_us,
        "one_stream_us": serial_us,
        "two_streams_us": overlap_us,
        "overlap_pct": _overlap_pct(pinned_us, compute_us, overlap_us),
        "pageable_two_streams_us": pageable_two_us,
        "pageable_overlap_pct": _overlap_pct(pageable_us, compute_us, pageable_two_us),
        "event_ordering_correct": _event_ordering_holds(a),
    }


def _event_ordering_holds(a: torch.Tensor) -> bool:
    """A consumer stream that waits on the producer's event must see the producer's write."""
    producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()
    buf = torch.zeros(1 << 20, device="cuda")
    ready = torch.cuda.Event()
    producer.wait_stream(torch.cuda.current_stream())  # buf's zero-fill first
    with torch.cuda.stream(producer):
        for _ in range(20):
            a @ a  # delay the write, so a missing wait would read stale zeros
        buf.fill_(1.0)
        ready.record()
    with torch.cuda.stream(consumer):
        consumer.wait_event(ready)
        total = buf.sum()
    torch.cuda.synchronize()
    return total.item() == buf.numel()


# --------------------------------------------------------------------------------------------
# 7. verdict, and the whole probe
# --------------------------------------------------------------------------------------------


def verdict(result: dict) -> list[str]:
    """Advice a user can act on, derived from the measured figures only."""
    lines = []
    launch = result.get("launch", {})
    sweep = result.get("size_sweep", {})
    if "launch_overhead_us" in launch:
        cost = launch["launch_overhead_us"]
        min_kernel = cost * (1 - LAUNCH_SHARE) / LAUNCH_SHARE
        lines.append(
            f"Each eager launch costs ~{cost:.1f} us: a kernel must run >= {min_kernel:.0f} us for launch cost to stay "
            f"under {LAUNCH_SHARE:.0%} of its time."
        )
        lines.append(
            f"A CUDA graph replays the same kernels at {launch['graph_us_per_kernel']:.2f} us each "
            f"({launch['eager_over_graph']:.1f}x fewer us than eager): capture chains of small kernels."
        )
    if sweep.get("crossover_side"):
        s = sweep["crossover_side"]
        lines.append(
            f"Kernel time overtakes launch cost at ~{s:.0f}x{s:.0f} fp32 (~{sweep['crossover_bytes'] / 2**20:.0f} MiB moved): "
            "smaller elementwise kernels are launch-bound; fuse them."
        )
    syncs = result.get("sync", {}).get("idle_device_us")
    if syncs:
        worst = max(syncs, key=syncs.get)
        lines.append(
            f"Host syncs cost {syncs['torch.cuda.synchronize()']:.0f} us (synchronize) to {syncs[worst]:.0f} us ({worst}) on an "
            f"idle device, and each drains the queue so the GPU idles until the host launches again: keep .item(), .cpu(), "
            "print and `if tensor:` out of hot loops."
        )
    ceil = result.get("ceilings", {})
    if "bf16_tflops" in ceil:
        lines.append(
            f"Roofline: {ceil['copy_bandwidth_gbs'] / 1e3:.2f} TB/s copy, {ceil['bf16_tflops']:.0f} TFLOP/s bf16; kernels under "
            f"{ceil['ridge_flop_per_byte']:.0f} FLOP/byte are memory-bound."
        )
    streams = result.get("streams", {})
    if "overlap_pct" in streams:
        lines.append(
            f"Pinned H2D copies overlap compute on a second stream ({streams['overlap_pct']:.0f}% hidden); pageable ones "
            f"do not ({streams['pageable_overlap_pct']:.0f}%): pin host buffers you copy from."
        )
    collectives = result.get("collectives", {})
    if "all_reduce" in collectives:
        from fuselab.probe_collectives import verdict_line

        lines.append(verdict_line(collectives))
    if not has_cuda():
        lines.append("No CUDA GPU here: launch, graph, sync and stream figures need one; CPU figures are dispatch and compute only.")
    return lines


GPU_ONLY = {
    "graph": "CUDA-graph replay needs a CUDA GPU",
    "sync": "host-device sync cost needs a CUDA GPU",
    "streams": "stream overlap needs a CUDA GPU",
}


def run_probe(quick: bool = False, on_section: Callable[[str, int, int], None] | None = None) -> dict:
    """Run every section this machine supports; `on_section(name, index, total)` is called as each one starts."""
    gpu = has_cuda()
    trials = 3 if quick else 7
    sections: list[tuple[str, Callable[[], dict]]] = [
        ("launch", lambda: measure_launch(trials)),
        ("size_sweep", lambda: measure_size_sweep(trials, SWEEP_SIDES[:7:2] if quick or not gpu else SWEEP_SIDES,
                                                  budget_us=20_000 if quick else 100_000)),
        ("ceilings", lambda: measure_ceilings((256 if quick or not gpu else 2048) * 2**20,
                                              (2048 if not gpu else 4096 if quick else 8192), rep_ms=50 if quick else 300)),
    ]
    gpus = torch.cuda.device_count() if gpu else 0
    if gpu:
        sections.insert(2, ("sync", lambda: measure_syncs(reps=50 if quick else 300)))
        sections.append(("streams", lambda: measure_streams((64 if quick else 256) * 2**20, trials)))
    if gpus >= 2:
        from fuselab.probe_collectives import measure_collectives

        sections.append(("collectives", lambda: measure_collectives(quick)))
    info = device_info()
    result: dict = {
        "meta": {
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": "fuselab probe " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["probe"] else "fuselab.probe.run_probe()",
            "quick": quick,
            **info.to_dict(),
        },
        "skipped": [] if gpu else [{"section": k, "reason": v} for k, v in GPU_ONLY.items()],
    }
    for index, (name, measure) in enumerate(sections):
        if on_section:
            on_section(name, index, len(sections))
        result[name] = measure()
    if gpus < 2:
        result["collectives"] = {"skipped": f"the all-reduce figures need 2 or more GPUs; this machine has {gpus}"}
    if gpu:
        launch = result["launch"]
        result["graph"] = {k: launch[k] for k in ("graph_us_per_kernel", "eager_over_graph", "launch_overhead_us")}
    result["verdict"] = verdict(result)
    return result


def main(
    json_path: str | None = None,
    plot_path: str | None = None,
    markdown_path: str | None = None,
    quick: bool = False,
    cache: bool = True,
) -> int:
    from rich.console import Console
    from rich.progress import Progress

    from fuselab.probe_report import markdown, plot, render

    console = Console()
    gpu = has_cuda()
    if not gpu:
        console.print("[yellow]No CUDA GPU found.[/] Measuring what the CPU allows; skipped (need a GPU): "
                      + "; ".join(GPU_ONLY.values()) + ".")
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("probing", total=None)

        def on_section(name: str, index: int, total: int) -> None:
            progress.update(task, description=f"probing: {name}", completed=index, total=total)

        result = run_probe(quick=quick, on_section=on_section)
    render(result, console)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=2)
        console.print(f"wrote {json_path}")
    if plot_path:
        plot(result, plot_path)
        console.print(f"wrote {plot_path}")
    if markdown_path:
        with open(markdown_path, "w") as f:
            f.write(markdown(result))
        console.print(f"wrote {markdown_path}")
    if cache and gpu:
        path = probe_cache_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2))
        console.print(f"saved as this machine's ceilings: {path}")
    return 0
