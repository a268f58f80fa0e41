"""The `fuselab` command: parse arguments, call the library, print. No logic of its own lives here."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from fuselab.doctor.cli import add_doctor_parser, run_doctor
from fuselab.engine.cli import add_generate_parser, run_generate
from fuselab.serve.cli import add_serve_parser, run_serve

# `fuselab bench SUBJECT`: each subject is a module of fuselab.bench with add_arguments(parser) and run(args) -> int.
BENCH_SUBJECTS: dict[str, tuple[str, str]] = {
    "graphs": (
        "fuselab.bench.graphs",
        "CUDA graphs on a launch-bound MLP chain: eager vs fuselab.graphed vs torch.compile(mode='reduce-overhead'), "
        "batch 1-64: time per call, kernels and launches per call, capture vs compile time",
    ),
    "kernels": (
        "fuselab.bench.kernels",
        "fused Triton kernels (norms, activations, softmax, ...) vs torch eager, torch.compile and Liger-Kernel: "
        "us, GB/s and % of copy bandwidth at decode/batch/prefill/large sizes, forward and forward+backward, "
        "and the host cost of one call",
    ),
    "optim": (
        "fuselab.bench.optim",
        "one AdamW step: fuselab's FusedAdamW vs torch.optim.AdamW foreach and fused, on 64 x 4096^2 parameters "
        "(bandwidth-bound) and 256 small ones (launch-bound): us per step, % of copy bandwidth, host us per step",
    ),
    "attention": (
        "fuselab.bench.attention",
        "flash attention prefill TFLOP/s vs torch SDPA backends (flash, cuDNN, efficient), and paged decode "
        "attention GB/s vs SDPA over the gathered cache",
    ),
    "decode": (
        "fuselab.bench.decode",
        "LLM decode on a Llama shape: transformers eager and static cache + torch.compile vs the fuselab engine in "
        "eager, fused and graphs modes: tok/s, TTFT, inter-token latency, kernels per step, % of the bandwidth "
        "roofline, and the doctor's breakdown of each mode's decode step",
    ),
    "serve": (
        "fuselab.bench.serve",
        "the HTTP server under Poisson load at a sweep of request rates (vLLM's serving benchmark): request and "
        "token throughput, TTFT, inter-token latency and time per output token p50/p99 per rate",
    ),
}


def _output_file(text: str) -> str:
    """An argparse type: a file path that can be written, checked before the probe spends a minute measuring."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory, not a file")
    existed = path.exists()
    try:
        # Opening is the only test that holds for every user (root included) and file system.
        with open(path, "a"):
            pass
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {e.strerror}") from None
    if not existed:
        path.unlink()
    return text


def _add_probe(sub) -> None:
    p = sub.add_parser(
        "probe",
        help="measure this GPU: launch cost, sync cost, graph replay, bandwidth/FLOP ceilings, stream overlap",
        description=(
            "Measure what the GPU costs beyond its arithmetic: the per-launch overhead of tiny kernels (eager, "
            "synced after every launch, and replayed from a CUDA graph), the kernel size at which launch cost stops "
            "mattering, the cost of explicit and implicit host-device syncs, the copy-bandwidth and bf16 matmul "
            "ceilings used as the roofline by the other tools, and copy/compute overlap across streams. Prints a "
            "table and a verdict; the result is also cached for `fuselab doctor` and `fuselab bench`. Without a "
            "GPU it measures what it can on the CPU and lists what it skipped."
        ),
    )
    p.add_argument("--json", type=_output_file, metavar="PATH", help="write the full result as JSON to PATH")
    p.add_argument("--plot", type=_output_file, metavar="PATH",
                   help="write a plot (PNG) of the size sweep and the launch/sync costs to PATH")
    p.add_argument("--markdown", type=_output_file, metavar="PATH",
                   help="write the tables and the verdict as Markdown to PATH")
    p.add_argument("--quick", action="store_true", help="fewer repetitions and smaller sizes (a rough result in seconds)")
    p.add_argument("--no-cache", action="store_true", help="do not save the result as this machine's ceilings")


def _add_bench(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="side-by-side benchmarks against what you would use instead",
        description="Benchmark fuselab against torch eager, torch.compile and other libraries, side by side in one run.",
    )
    subjects = p.add_subparsers(dest="subject", metavar="SUBJECT", required=True)
    for name, (module, help_text) in BENCH_SUBJECTS.items():
        # argparse %-formats help strings (not descriptions): a literal % must be doubled there.
        sp = subjects.add_parser(name, help=help_text.replace("%", "%%"), description=help_text)
        importlib.import_module(module).add_arguments(sp)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fuselab",
        description=(
            "fuselab finds and removes the three costs that keep PyTorch inference far from what a GPU can do: "
            "kernel-launch overhead, host-device syncs and memory traffic between unfused kernels."
        ),
        epilog="Run `fuselab COMMAND --help` for the options of one command.",
    )
    parser.add_argument("--version", action="version", version=f"fuselab {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_probe(sub)
    add_doctor_parser(sub)
    add_generate_parser(sub)
    add_serve_parser(sub)
    _add_bench(sub)
    return parser


def _version() -> str:
    from fuselab import __version__

    return __version__


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "probe":
        from fuselab.probe import main as probe_main

        return probe_main(json_path=args.json, plot_path=args.plot, markdown_path=args.markdown, quick=args.quick, cache=not args.no_cache)
    if args.command == "doctor":
        return run_doctor(args)
    if args.command == "generate":
        return run_generate(args)
    if args.command == "serve":
        return run_serve(args)
    if args.command == "bench":
        return importlib.import_module(BENCH_SUBJECTS[args.subject][0]).run(args)
    raise AssertionError(f"unhandled command {args.command}")


if __name__ == "__main__":
    sys.exit(main())
