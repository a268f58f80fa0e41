"""`fuselab doctor`: argument wiring for the command line; the work is done by the rest of the package."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

DESCRIPTION = (
    "Profile a GPU workload and say why it is slow: launch-bound (the GPU waits for the host to launch "
    "kernels), sync-bound (.item(), .cpu(), printing or branching on GPU tensors drains the GPU), copy-bound "
    "(host-device copies, e.g. from pageable memory), memory-bound or compute-bound. Reads a trace that torch.profiler exported (--trace FILE, .json or .json.gz; works on "
    "any machine), or runs SCRIPT under the profiler (needs CUDA), with its steps marked by calls to "
    "fuselab.doctor.step() (a script that marks none is profiled whole, as one step). Prints the verdict, the "
    "evidence (GPU busy time, idle gaps split into launch gaps, sync stalls and other idle, syncs with their "
    "source lines (exact in SCRIPT mode), copies, roofline position against the `fuselab probe` ceilings (float32 "
    "GEMMs against the float32/TF32 rate), known kernel chains) and ranked fixes: removing a sync at file:line, "
    "pinned copies, TF32/bf16, a fused optimizer, fuselab fused kernels, SDPA, CUDA-graph capture. SCRIPT mode also "
    "times the steps after the profiled ones without the profiler and judges the step at that speed. Then the detail "
    "tables: the top kernels (calls and us per step, share of the step, achieved TFLOP/s or GB/s against the "
    "ceiling, grid size against the SM count, under-filled grids flagged), GPU time by phase (forward, backward, "
    "optimizer), by nn.Module (per layer) and by record_function range, and, with several streams, busy time "
    "per stream, copy/compute overlap and NCCL communication. --compare BEFORE AFTER sets two runs side by side "
    "(each a trace or a --json output) to confirm a fix: the step's parts, the verdict change, and the kernels, "
    "ops and syncs that went away."
)


def add_doctor_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "doctor", help="profile a workload (or read a trace) and say why it is slow, with the fix",
        description=DESCRIPTION,
        epilog="examples:  fuselab doctor --trace trace.json.gz --html report.html\n"
               "           fuselab doctor --steps 10 decode.py --max-tokens 32\n"
               "           fuselab doctor --compare before.json.gz after.json.gz --json change.json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--trace", metavar="FILE", help="analyze this torch.profiler trace instead of running a script")
    p.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"),
                   help="compare two runs, each a torch.profiler trace or a --json output, instead of diagnosing one")
    p.add_argument("--json", metavar="PATH",
                   help="write the diagnosis (with --compare: the comparison) as JSON to PATH")
    p.add_argument("--html", metavar="PATH",
                   help="write a self-contained HTML report to PATH: a timeline of the median step that zooms "
                        "(wheel) and pans (drag) with kernel names on hover, and the tables")
    p.add_argument("--perfetto", metavar="PATH",
                   help="write the trace with the doctor's findings added as tracks (steps, idle gaps by cause, "
                        "syncs) to PATH (.json or .json.gz), to open at ui.perfetto.dev or in chrome://tracing")
    p.add_argument("--probe", metavar="PROBE_JSON",
                   help="ceilings from this `fuselab probe --json` result (default: the cached probe, else stated H200 figures)")
    p.add_argument("--steps", type=int, default=5, help="SCRIPT mode: steps to profile after the warm-up (default 5)")
    p.add_argument("--warmup", type=int, default=None,
                   help="steps to leave out at the start: in SCRIPT mode the first marked steps, with --trace the "
                        "first ProfilerStep ranges, also of traces given to --compare (default 1 for SCRIPT, "
                        "0 with --trace)")
    p.add_argument("--save-trace", metavar="PATH", help="SCRIPT mode: keep the recorded trace at PATH (.json or .json.gz)")
    p.add_argument("script", nargs="?", metavar="SCRIPT", help="a Python script to run under the profiler")
    p.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS", help="arguments passed to SCRIPT")
    return p


def run_doctor(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress

    from fuselab.device import has_cuda
    from fuselab.doctor.analyze import analyze_file
    from fuselab.doctor.html import write_html
    from fuselab.doctor.report import render, write_json
    from fuselab.doctor.trace import gc_paused
    from fuselab.doctor.verdict import verdict_for

    console = Console()
    if args.compare:
        return _run_compare(args, console)
    if bool(args.trace) == bool(args.script):
        console.print("[red]error:[/] give either --trace FILE or SCRIPT (see `fuselab doctor --help`)")
        return 2
    warmup = args.warmup if args.warmup is not None else (0 if args.trace else 1)
    if args.steps < 1 or warmup < 0:
        console.print(f"[red]error:[/] --steps must be >= 1 and --warmup >= 0 (got {args.steps}, {warmup})")
        return 2
    unprofiled_us = None
    with tempfile.TemporaryDirectory() as tmp:
        if args.trace:
            trace_path, skip = Path(args.trace), warmup
        else:
            if not has_cuda():
                console.print("[red]error:[/] profiling GPU work needs CUDA, and this machine has no CUDA GPU. "
                              "Record the trace on a GPU machine (`fuselab doctor --save-trace trace.json.gz SCRIPT`) "
                              "and read it anywhere with `fuselab doctor --trace trace.json.gz`.")
                return 2
            from fuselab.doctor.profile import record_script

            trace_path = Path(args.save_trace or Path(tmp) / "trace.json")
            console.print(f"running {args.script} under the profiler ({warmup} warm-up + {args.steps} steps)")
            try:
                run = record_script(args.script, args.script_args, trace_path, steps=args.steps, warmup=warmup)
            except ValueError as err:
                console.print(f"[red]error:[/] {err}")
                return 2
            except SystemExit as stop:
                console.print(f"[red]error:[/] {args.script} exited with status {stop.code}")
                return 1
            skip = warmup if run.recorded > warmup else 0  # a script that marked no steps is one step
            unprofiled_us = run.unprofiled_us
            console.print(f"timed {len(run.unprofiled_step_us)} more steps without the profiler" if unprofiled_us else
                          "no steps ran after the profiled ones, so none was timed without the profiler "
                          "(a script that runs more steps than --warmup + --steps gets its unprofiled step time)")
        with Progress(console=console, transient=True) as bar:
            task = bar.add_task("analyzing", total=None)
            try:
                analysis = analyze_file(trace_path, probe=args.probe, skip_steps=skip,
                                        on_stage=lambda s: bar.update(task, description=f"analyzing: {s}"))
            except (ValueError, FileNotFoundError) as err:
                bar.stop()
                console.print(f"[red]error:[/] {err}")
                return 2
        if args.perfetto:
            from fuselab.doctor.perfetto import write_perfetto

            write_perfetto(analysis, args.perfetto)  # here, while a SCRIPT's trace still exists
    with gc_paused():  # the diagnosis makes many small objects and no cycles: see trace.gc_paused
        diagnosis = verdict_for(analysis, unprofiled_us=unprofiled_us)
        render(diagnosis, console)
        if args.json:
            write_json(diagnosis, args.json)
            console.print(f"wrote {args.json}")
        if args.html:
            write_html(diagnosis, args.html)
            console.print(f"wrote {args.html}")
    if args.perfetto:
        console.print(f"wrote {args.perfetto}")
    return 0



def _run_compare(args: argparse.Namespace, console) -> int:
    import json

    from fuselab.device import ceilings
    from fuselab.doctor.compare import compare, render_comparison

    if args.trace or args.script:
        console.print("[red]error:[/] --compare takes its two runs by itself: give no --trace or SCRIPT with it")
        return 2
    if args.html or args.perfetto:
        console.print("[red]error:[/] --html and --perfetto describe one run: diagnose each run for them, "
                      "not --compare")
        return 2
    try:
        comparison = compare(*args.compare, ceilings=ceilings(args.probe) if args.probe else None,
                             skip_steps=args.warmup or 0)
    except (ValueError, FileNotFoundError) as err:
        console.print(f"[red]error:[/] {err}")
        return 2
    render_comparison(comparison, console)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(comparison.to_dict(), f, indent=2)
            f.write("\n")
        console.print(f"wrote {args.json}")
    return 0
