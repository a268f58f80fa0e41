"""`fuselab bench graphs`: a launch-bound chain, eager vs `fuselab.graphed` vs torch.compile's
reduce-overhead mode, side by side in one run.

torch.compile changes two things at once: it generates its own kernels and replays them from CUDA
graphs. A fourth mode, `fuselab.graphed` over `torch.compile(model)` (default mode: the same
generated kernels, no graphs), separates the two: against reduce-overhead it compares only the
graph replay, with the same kernels on both sides.

The chain is an MLP of tiny Linear + SiLU layers: at small batches every kernel finishes in a few
microseconds, so an eager call costs what launching its kernels costs. Every mode is timed as the
whole Python call (graphed: the copy into the static buffers, the replay and the slicing;
compiled: its guards and input copies), with CUDA events and no L2 flush: a flush kernel between
calls would let the host queue the next call's launches while the GPU is busy, hiding the very
launch cost this measures.
"""

from __future__ import annotations

import argparse
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import torch

from fuselab.bench import batch_sizes, command_line, fmt, output_dir, positive_float, positive_int, write_json
from fuselab.device import device_info, has_cuda
from fuselab.graphs import graphed
from fuselab.timing import bench

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
MODES = ("eager", "graphed", "compiled", "graphed_compiled")
LABELS = {"eager": "eager", "graphed": "graphed", "compiled": "compiled", "graphed_compiled": "graphed(compile)"}
# Host calls that put work on the GPU, as the profiler names them: kernels (through the runtime, or the
# driver as Triton does), graph replays, copies and fills.
_LAUNCH_CALLS = ("cudaLaunch", "cuLaunch", "cudaGraphLaunch", "cudaMemcpy", "cudaMemset")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", type=positive_int, default=64, help="Linear+SiLU layers in the chain (default 64: ~128 kernels a call)")
    parser.add_argument("--width", type=positive_int, default=128, help="features per layer (default 128)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--batch-sizes", type=batch_sizes, default=[1, 2, 4, 8, 16, 32, 64], metavar="B1,B2,...",
                        help="batch sizes to time (default 1,2,4,8,16,32,64); graphed captures buckets up to the largest")
    parser.add_argument("--rep-ms", type=positive_float, default=200.0, help="measuring time per mode and batch size (default 200)")
    parser.add_argument("--rounds", type=positive_int, default=5,
                        help="rounds the modes take turns in, each timing every mode for rep-ms/rounds; the table gives "
                             "the median round and the spread (default 5)")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile (its compilation takes the longest)")
    parser.add_argument("--out", type=output_dir, default="benchmarks/results", metavar="DIR",
                        help="folder for graphs.json, graphs.md and graphs.png (default benchmarks/results)")


def launch_bound_mlp(layers: int, width: int, dtype: torch.dtype) -> torch.nn.Sequential:
    """`layers` x (Linear(width, width), SiLU) on the GPU, for inference."""
    blocks: list[torch.nn.Module] = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width, device="cuda", dtype=dtype), torch.nn.SiLU()]
    return torch.nn.Sequential(*blocks).eval()


def count_launches(fn: Callable[[], object]) -> dict[str, int]:
    """GPU kernels one call runs and host calls it makes to launch work, from one profiled call."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = prof.events()
    kernels = sum(1 for e in events if e.device_type == DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset")))
    launches = sum(1 for e in events if e.name.startswith(_LAUNCH_CALLS))
    return {"kernels": kernels, "launches": launches}


def interleaved_medians(calls: dict[str, Callable[[], object]], rounds: int, rep_ms: float) -> dict[str, list[float]]:
    """Per mode, the median time of each of `rounds` rounds; the modes take turns within a round, in an
    order rotated every round, so that a slow spell of the machine (clocks, a neighbour) falls on all
    of them rather than on whichever ran last."""
    names = list(calls)
    out: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            out[name].append(bench(calls[name], rep_ms=rep_ms / rounds, flush_l2=False).median_us)
    return out


def _timed_first_calls(fn: Callable[[], object], calls: int = 3) -> float:
    """Seconds for the first calls, synchronized: compilation, warm-up and graph recording."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def measure(args: argparse.Namespace) -> dict:
    """Time every mode at every batch size; the result as one JSON-ready dict."""
    torch.manual_seed(0)
    model = launch_bound_mlp(args.layers, args.width, DTYPES[args.dtype])
    fast = graphed(model, max_batch_size=max(args.batch_sizes))
    # Default dynamic=None: what users get; it recompiles once with a dynamic batch, then records a graph per size.
    compiled = None if args.no_compile else torch.compile(model, mode="reduce-overhead")
    # The first call captures every bucket; its warm-up compiles the model (once static, once with a dynamic batch).
    fast_compiled = None if args.no_compile else graphed(torch.compile(model), max_batch_size=max(args.batch_sizes))
    calls = {"eager": model, "graphed": fast, "compiled": compiled, "graphed_compiled": fast_compiled}
    rows = []
    with torch.no_grad():
        for batch in args.batch_sizes:
            x = torch.randn(batch, args.width, device="cuda", dtype=DTYPES[args.dtype])
            row: dict = {"batch": batch, "compile_s": None}
            if compiled is not None:
                row["compile_s"] = _timed_first_calls(lambda: compiled(x))
            fast(x)  # the first call captures every bucket: timed by fast.stats, not here
            expected = model(x)
            row["graphed_max_diff"] = _max_diff(fast(x), expected)
            row["compiled_max_diff"] = None if compiled is None else _max_diff(compiled(x).clone(), expected)
            row["graphed_compiled_max_diff"] = None if fast_compiled is None else _max_diff(fast_compiled(x), expected)
            present = [m for m in MODES if calls[m] is not None]
            rounds = interleaved_medians({m: (lambda call=calls[m]: call(x)) for m in present}, args.rounds, args.rep_ms)
            for mode in MODES:
                if mode not in present:
                    row[mode] = None
                    continue
                row[mode] = {"median_us": statistics.median(rounds[mode]), "rounds_us": rounds[mode],
                             **count_launches(lambda: calls[mode](x))}
            row["graphed_speedup"] = row["eager"]["median_us"] / row["graphed"]["median_us"]
            for mode in ("compiled", "graphed_compiled"):
                row[f"{mode}_speedup"] = None if row[mode] is None else row["eager"]["median_us"] / row[mode]["median_us"]
            rows.append(row)
            times = ", ".join(f"{m} {row[m]['median_us']:.1f} us" for m in MODES if row[m] is not None)
            print(f"batch {batch}: {times}", flush=True)  # progress: compiling can take minutes
    compile_times = [r["compile_s"] for r in rows if r["compile_s"] is not None]
    return {
        "header": {
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "device": device_info().to_dict(),
            "command": command_line(),
        },
        "config": {"layers": args.layers, "width": args.width, "dtype": args.dtype, "batch_sizes": args.batch_sizes,
                   "rep_ms": args.rep_ms, "rounds": args.rounds, "workload": f"{args.layers} x (Linear({args.width}, {args.width}) + SiLU)"},
        "graphed": {"buckets": list(fast.stats.buckets), "capture_s": fast.stats.capture_s,
                    "held_bytes": fast.stats.held_bytes, "eager_calls": fast.stats.eager_calls},
        "compiled": None if compiled is None else {"sizes_recorded": len(compile_times), "compile_s": sum(compile_times)},
        "graphed_compiled": None if fast_compiled is None else {"capture_s": fast_compiled.stats.capture_s,
                                                                "held_bytes": fast_compiled.stats.held_bytes},
        "rows": rows,
    }


def _time_cell(entry: dict | None) -> str:
    """The median round, and the fastest and slowest rounds when there were several."""
    if entry is None:
        return "—"
    rounds = entry.get("rounds_us", [])
    spread = f" ({min(rounds):.0f}–{max(rounds):.0f})" if len(rounds) > 1 else ""
    return f"{entry['median_us']:.1f}{spread}"


def _table_rows(result: dict) -> list[list[str]]:
    out = []
    for r in result["rows"]:
        times = [_time_cell(r[m]) for m in MODES]
        kernels = "/".join(fmt(r[m] and r[m]["kernels"], "d") for m in MODES)
        launches = "/".join(fmt(r[m] and r[m]["launches"], "d") for m in MODES)
        speedups = [fmt(r[f"{m}_speedup"], ".1f") for m in MODES[1:]]
        out.append([str(r["batch"]), *times, *speedups, kernels, launches, fmt(r["compile_s"], ".2f")])
    return out


# Speedups are over eager; kernels and launches per call are given per mode, eager/graphed/compiled/graphed(compile).
COLUMNS = ["batch", *(f"{LABELS[m]} us" for m in MODES), *(f"{LABELS[m]} x" for m in MODES[1:]), "kernels e/g/c/gc",
           "launches e/g/c/gc", "compile s"]


def _summary_lines(result: dict) -> list[str]:
    g, c = result["graphed"], result["compiled"]
    lines = [f"graphed: {len(g['buckets'])} buckets {g['buckets']} captured in {g['capture_s']:.2f} s, "
             f"holding {g['held_bytes'] / 2**20:.1f} MiB of GPU memory"]
    if c is not None:
        lines.append(f"torch.compile(mode='reduce-overhead'): compile + record for {c['sizes_recorded']} sizes in {c['compile_s']:.2f} s")
    gc = result.get("graphed_compiled")
    if gc is not None:
        lines.append(f"graphed(torch.compile(model)): compile + capture of every bucket in {gc['capture_s']:.2f} s, "
                     f"holding {gc['held_bytes'] / 2**20:.1f} MiB")
    return lines


def write_markdown(result: dict, path: Path) -> None:
    h, d = result["header"], result["header"]["device"]
    lines = [
        "# fuselab bench graphs",
        "",
        f"- date: {h['date']}",
        f"- GPU: {d['name']} (torch {d['torch']}, triton {d['triton']}, CUDA {d['cuda']}, Python {d['python']})",
        f"- command: `{h['command']}`",
        f"- workload: {result['config']['workload']}, {result['config']['dtype']}; time per whole Python call (median of "
        f"{result['config'].get('rounds', 1)} rounds in which the modes take turns; fastest–slowest round in brackets); "
        "speedups over eager; kernels and host launch calls per call as eager/graphed/compiled/graphed(compile); compile s: "
        "torch.compile's first three calls at that size (compilation and graph recording)",
        *[f"- {line}" for line in _summary_lines(result)],
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---:|" * len(COLUMNS),
        *["| " + " | ".join(row) + " |" for row in _table_rows(result)],
    ]
    path.write_text("\n".join(lines) + "\n")


def write_plot(result: dict, path: Path) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = [r["batch"] for r in result["rows"]]
    fig, (times, speedups) = plt.subplots(1, 2, figsize=(11, 4))
    for mode in MODES:
        if result["rows"][0][mode] is not None:
            times.plot(batches, [r[mode]["median_us"] for r in result["rows"]], marker="o", label=LABELS[mode])
    for mode in MODES[1:]:
        if result["rows"][0][f"{mode}_speedup"] is not None:
            speedups.plot(batches, [r[f"{mode}_speedup"] for r in result["rows"]], marker="o", label=LABELS[mode])
    times.set(xscale="log", yscale="log", xlabel="batch size", ylabel="us per call", title=result["config"]["workload"])
    speedups.set(xscale="log", xlabel="batch size", ylabel="speedup over eager", title=result["header"]["device"]["name"])
    speedups.axhline(1.0, color="gray", linestyle="--", linewidth=1)  # eager
    speedups.set_ylim(bottom=0)
    for ax in (times, speedups):
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"fuselab bench graphs: {result['config']['workload']}, {result['config']['dtype']}")
    for col in COLUMNS:
        table.add_column(col, justify="right")
    for row in _table_rows(result):
        table.add_row(*row)
    console = Console()
    console.width = max(console.width, 130)  # a pipe reports 80 columns, which would cut the table's cells
    console.print(table)
    for line in _summary_lines(result):
        console.print(line)


def run(args: argparse.Namespace) -> int:
    if not has_cuda():
        print("fuselab bench graphs needs a CUDA GPU: CUDA graphs and launch overhead exist only there. Nothing was measured.")
        return 0
    result = measure(args)
    print_table(result)
    out = Path(args.out)
    write_json(result, out, "graphs")
    write_markdown(result, out / "graphs.md")
    write_plot(result, out / "graphs.png")
    print(f"wrote {out / 'graphs.json'}, {out / 'graphs.md'}, {out / 'graphs.png'}")
    return 0
