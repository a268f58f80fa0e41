"""`fuselab bench kernels`: each fused kernel side by side with what one would run instead.

For every op and size, forward and forward+backward: the median time (CUDA events, L2 flushed
between calls; forward+backward also with the host running ahead, the kernels' time alone), the bytes the op must move at the least, the GB/s that makes and its share of the
copy bandwidth (`fuselab.device.ceilings()`), for fuselab, torch eager (the reference in
`fuselab.kernels.reference`, written as Hugging Face writes it), torch.compile of that reference,
and Liger-Kernel where it has the op and is installed. At decode size it also reports the host
cost of one call (wall time of the Python call, no sync), which is what a launcher costs there.

Adding an op: add an `OpBench` to the list `ops()` returns. `sizes` maps a size label to a builder
`(dtype, device) -> Workload`; `row_sizes(width, build)` makes the four standard ones (1, 32 and
4096 rows of `width`, and a large shape) from `build(rows, cols, dtype, device)`. A `Workload`
holds the positional arguments every implementation is called with, the indices of those that get
gradients in the forward+backward pass (`()` times the forward only, e.g. for an optimizer step),
and the fewest bytes the forward and the backward must move. `ours` and `eager` take those
arguments; `liger` is a loader that returns a callable taking them, or None. For example:

    OpBench(
        name="rope",
        sizes=row_sizes(4096, build_rope),
        ours=lambda q, k, pos, cs: apply_rope(q, k, pos, cs),
        eager=reference.apply_rope,
        liger=liger_loader("liger_kernel.ops.rope", "LigerRopeFunction", adapt=lambda f: ...),
    )
"""

from __future__ import annotations

import argparse
import functools
import importlib
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import torch

from fuselab.bench import command_line, error_text, markdown_table, output_dir, write_json
from fuselab.device import ceilings, device_info, has_cuda
from fuselab.timing import bench

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
SIZES = ("decode", "batch32", "prefill", "large")
QUICK_SIZES = ("decode", "prefill")
IMPLEMENTATIONS = ("fuselab", "torch eager", "torch.compile", "liger")


@dataclass(frozen=True)
class Workload:
    shape: str  # as the table shows it, e.g. "4096×4096"
    args: tuple  # positional arguments of every implementation
    grad_args: tuple[int, ...]  # indices of args that get gradients; () to time the forward only
    bytes_forward: int  # the fewest bytes the forward must read and write
    bytes_backward: int = 0  # the same for the backward alone


@dataclass(frozen=True)
class OpBench:
    name: str
    sizes: dict[str, Callable[[torch.dtype, torch.device], Workload]]
    ours: Callable
    eager: Callable
    liger: Callable[[], Callable | None] = lambda: None


def liger_loader(module: str, attr: str, adapt: Callable[[Callable], Callable]) -> Callable[[], Callable | None]:
    """A loader for Liger-Kernel's `module.attr.apply`, wrapped by `adapt` to take the workload's
    arguments; it returns None when Liger (or that op in the installed version) is missing."""

    def load() -> Callable | None:
        try:
            return adapt(getattr(importlib.import_module(module), attr).apply)
        except (ImportError, AttributeError):
            return None

    return load


def row_sizes(
    width: int, build: Callable[..., Workload], large: tuple[int, int] = (16384, 8192)
) -> dict[str, Callable[[torch.dtype, torch.device], Workload]]:
    """Builders for decode (1 row), batch32 (32 rows) and prefill (4096 rows) of `width`, and `large`."""
    shapes = {"decode": (1, width), "batch32": (32, width), "prefill": (4096, width), "large": large}
    return {size: functools.partial(build, rows, cols) for size, (rows, cols) in shapes.items()}


# --------------------------------------------------------------------------------------------
# The ops
# --------------------------------------------------------------------------------------------


def _randn(rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.randn(rows, cols, dtype=dtype, device=device)


def _weight(cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return 1 + 0.1 * torch.randn(cols, dtype=dtype, device=device)


def _build_add(rows, cols, dtype, device) -> Workload:
    n = rows * cols * dtype.itemsize
    return Workload(f"{rows}×{cols}", (_randn(rows, cols, dtype, device), _randn(rows, cols, dtype, device)), (), 3 * n)


def _build_bias_act(rows, cols, dtype, device) -> Workload:
    n = rows * cols * dtype.itemsize
    args = (_randn(rows, cols, dtype, device), 0.1 * _randn(1, cols, dtype, device)[0])
    return Workload(f"{rows}×{cols}", args, (0, 1), 2 * n, 3 * n)


def _build_rms_norm(rows, cols, dtype, device) -> Workload:
    n = rows * cols * dtype.itemsize
    return Workload(f"{rows}×{cols}", (_randn(rows, cols, dtype, device), _weight(cols, dtype, device)), (0, 1), 2 * n, 3 * n)


def _build_rms_norm_residual(rows, cols, dtype, device) -> Workload:
    # Forward reads x and the residual, writes y and the sum; backward reads dy, dsum and the sum, writes dx.
    n = rows * cols * dtype.itemsize
    args = (_randn(rows, cols, dtype, device), _randn(rows, cols, dtype, device), _weight(cols, dtype, device))
    return Workload(f"{rows}×{cols}", args, (0, 1, 2), 4 * n, 4 * n)


def _build_layer_norm(rows, cols, dtype, device) -> Workload:
    n = rows * cols * dtype.itemsize
    args = (_randn(rows, cols, dtype, device), _weight(cols, dtype, device), 0.1 * _randn(1, cols, dtype, device)[0])
    return Workload(f"{rows}×{cols}", args, (0, 1, 2), 2 * n, 3 * n)


def _build_swiglu(rows, cols, dtype, device) -> Workload:
    n = rows * cols * dtype.itemsize
    args = (_randn(rows, cols, dtype, device), _randn(rows, cols, dtype, device))
    return Workload(f"{rows}×{cols}", args, (0, 1), 3 * n, 5 * n)


def _build_silu_and_mul(rows, cols, dtype, device) -> Workload:
    n = rows * cols * dtype.itemsize  # cols is the output width; the input is twice as wide
    return Workload(f"{rows}×{2 * cols}", (_randn(rows, 2 * cols, dtype, device),), (0,), 3 * n, 5 * n)


def _build_softmax(rows, cols, dtype, device) -> Workload:
    n = rows * cols * dtype.itemsize
    return Workload(f"{rows}×{cols}", (_randn(rows, cols, dtype, device),), (0,), 2 * n, 3 * n)


def _build_cross_entropy(rows, vocab, dtype, device) -> Workload:
    # The least traffic: forward reads the logits once; backward writes their gradient once.
    n = rows * vocab * dtype.itemsize
    args = (_randn(rows, vocab, dtype, device), torch.randint(0, vocab, (rows,), device=device))
    return Workload(f"{rows}×{vocab}", args, (0,), n, n)


def _cross_entropy_sizes(vocab: int = 128256) -> dict[str, Callable[[torch.dtype, torch.device], Workload]]:
    rows = {"decode": 1, "batch32": 32, "prefill": 1024, "large": 8192}
    return {size: functools.partial(_build_cross_entropy, n, vocab) for size, n in rows.items()}


def _liger_cross_entropy() -> Callable | None:
    try:
        from liger_kernel.transformers.functional import liger_cross_entropy
    except ImportError:
        return None

    def loss(logits, target):
        out = liger_cross_entropy(logits, target)
        return out[0] if isinstance(out, tuple) else out  # some versions also return the z-loss

    return loss


def _build_rope(tokens, dtype, device, q_heads=32, kv_heads=8, head_dim=128, max_pos=8192) -> Workload:
    """Llama-3-8B attention shapes; positions scattered over the cache, as in batched decoding."""
    from fuselab.kernels import rope_cos_sin

    q = torch.randn(tokens, q_heads, head_dim, dtype=dtype, device=device)
    k = torch.randn(tokens, kv_heads, head_dim, dtype=dtype, device=device)
    positions = torch.randint(0, max_pos, (tokens,), device=device)
    cos_sin = rope_cos_sin(max_pos, head_dim, base=500000.0, device=device)
    # q and k read and written once, plus one position and one cos/sin row per token.
    n = 2 * (q.numel() + k.numel()) * dtype.itemsize + tokens * (positions.itemsize + head_dim * cos_sin.itemsize)
    return Workload(f"{tokens}×({q_heads}+{kv_heads})×{head_dim}", (q, k, positions, cos_sin), (0, 1), n, n)


def _rope_sizes() -> dict[str, Callable[[torch.dtype, torch.device], Workload]]:
    tokens = {"decode": 1, "batch32": 32, "prefill": 4096, "large": 16384}
    return {size: functools.partial(_build_rope, n) for size, n in tokens.items()}


def ops() -> list[OpBench]:
    """Every benchmarked op, in table order. Built on call so that `fuselab --help` does not import Triton."""
    from fuselab import kernels
    from fuselab.kernels import reference

    return [
        OpBench("add", row_sizes(4096, _build_add), kernels.add, reference.add),
        OpBench(
            "bias_act", row_sizes(4096, _build_bias_act),
            lambda x, b: kernels.bias_act(x, b, "gelu"), lambda x, b: reference.bias_act(x, b, "gelu"),
        ),
        OpBench(
            "rms_norm", row_sizes(4096, _build_rms_norm), kernels.rms_norm, reference.rms_norm,
            liger_loader("liger_kernel.ops.rms_norm", "LigerRMSNormFunction", lambda f: lambda x, w: f(x, w, 1e-6)),
        ),
        OpBench(
            "rms_norm+residual", row_sizes(4096, _build_rms_norm_residual),
            lambda x, r, w: kernels.rms_norm(x, w, residual=r), lambda x, r, w: reference.rms_norm(x, w, residual=r),
        ),
        OpBench(
            "layer_norm", row_sizes(4096, _build_layer_norm), kernels.layer_norm, reference.layer_norm,
            liger_loader("liger_kernel.ops.layer_norm", "LigerLayerNormFunction", lambda f: lambda x, w, b: f(x, w, b, 1e-5)),
        ),
        OpBench(
            "swiglu", row_sizes(14336, _build_swiglu, large=(16384, 14336)), kernels.swiglu, reference.swiglu,
            liger_loader("liger_kernel.ops.swiglu", "LigerSiLUMulFunction", lambda f: f),
        ),
        OpBench(
            "silu_and_mul", row_sizes(14336, _build_silu_and_mul, large=(16384, 14336)),
            kernels.silu_and_mul, reference.silu_and_mul,
        ),
        OpBench(
            "softmax", row_sizes(4096, _build_softmax), kernels.softmax, reference.softmax,
            liger_loader("liger_kernel.ops.softmax", "LigerSoftmaxFunction", lambda f: f),
        ),
        OpBench("rope", _rope_sizes(), kernels.apply_rope, reference.apply_rope),
        OpBench(
            "cross_entropy", _cross_entropy_sizes(), kernels.cross_entropy, reference.cross_entropy, _liger_cross_entropy,
        ),
    ]

# --------------------------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------------------------


def forward_step(fn: Callable, workload: Workload) -> Callable[[], object]:
    return lambda: fn(*workload.args)


def forward_backward_step(fn: Callable, workload: Workload) -> Callable[[], object]:
    """One forward and the gradients of the `grad_args` (returned, not accumulated into .grad)."""
    leaves = [
        a.detach().requires_grad_(True) if i in workload.grad_args else a for i, a in enumerate(workload.args)
    ]
    inputs = [leaves[i] for i in workload.grad_args]
    first = fn(*leaves)
    # A scalar (a loss) gets the gradient 1, as loss.backward() gives it; other outputs random ones.
    grads = tuple(
        torch.ones_like(o) if o.dim() == 0 else torch.randn_like(o) for o in (first if isinstance(first, tuple) else (first,))
    )

    def step():
        out = fn(*leaves)
        return torch.autograd.grad(out if isinstance(out, tuple) else (out,), inputs, grads)

    return step


def host_us_per_call(fn: Callable[[], object], calls: int = 100, trials: int = 5) -> float:
    """Wall time of issuing one call, with no sync: the Python and launch cost the host pays."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(trials):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) * 1e6 / calls)
        torch.cuda.synchronize()
    return statistics.median(samples)


def _implementations(op: OpBench, use_compile: bool) -> dict[str, Callable]:
    impls = {"fuselab": op.ours, "torch eager": op.eager}
    if use_compile:
        # dynamic=False: one specialized graph per shape, as a model with fixed shapes gets.
        impls["torch.compile"] = torch.compile(op.eager, dynamic=False)
    liger = op.liger()
    if liger is not None:
        impls["liger"] = liger
    return impls


def measure(args: argparse.Namespace) -> dict:
    """Time every implementation of every selected op and size; the result as one JSON-ready dict."""
    torch.manual_seed(0)
    dtype, device = DTYPES[args.dtype], torch.device("cuda")
    ceiling = ceilings()
    copy_gbs = ceiling.copy_bandwidth_gbs
    warmup_ms, rep_ms = (5.0, 20.0) if args.quick else (25.0, 100.0)
    selected = [op for op in ops() if args.ops is None or op.name in args.ops]
    results, host = [], []
    for op in selected:
        impls = _implementations(op, use_compile=not args.no_compile)
        for size in QUICK_SIZES if args.quick else SIZES:
            workload = op.sizes[size](dtype, device)
            passes = {"forward": (forward_step, workload.bytes_forward)}
            if workload.grad_args:
                passes["forward+backward"] = (forward_backward_step, workload.bytes_forward + workload.bytes_backward)
            for pass_name, (make_step, nbytes) in passes.items():
                for impl, fn in impls.items():
                    record = {"op": op.name, "size": size, "shape": workload.shape, "pass": pass_name, "impl": impl,
                              "bytes": nbytes, "median_us": None, "gbs": None, "pct_of_copy": None, "error": None}
                    try:
                        step = make_step(fn, workload)
                        us = bench(step, warmup_ms=warmup_ms, rep_ms=rep_ms).median_us
                        gbs = nbytes / us / 1e3
                        record.update(median_us=us, gbs=gbs, pct_of_copy=100 * gbs / copy_gbs)
                        if pass_name == "forward+backward":
                            # The autograd engine's host path can take longer than the kernels it issues;
                            # this figure leaves it out, as a training step whose host runs ahead does.
                            gpu_us = bench(step, warmup_ms=warmup_ms, rep_ms=rep_ms, host_ahead=True).median_us
                            record.update(gpu_us=gpu_us, gpu_pct_of_copy=100 * nbytes / gpu_us / 1e3 / copy_gbs)
                        if size == "decode" and pass_name == "forward":
                            host.append({"op": op.name, "impl": impl, "host_us": host_us_per_call(make_step(fn, workload))})
                    except Exception as err:  # noqa: BLE001 - one failing implementation must not end the run
                        record["error"] = error_text(err)
                    results.append(record)
                    print(f"  {op.name} {size} {pass_name} {impl}: "
                          + (record["error"] or f"{record['median_us']:.1f} us"), file=sys.stderr)
            del workload, passes
            torch.cuda.empty_cache()
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command_line(),
        "device": device_info().to_dict(),
        "ceilings": {"copy_bandwidth_gbs": copy_gbs, "source": ceiling.source},
        "config": {"dtype": args.dtype, "quick": args.quick, "compile": not args.no_compile,
                   "timing": f"median of CUDA-event timings, L2 flushed between calls, {rep_ms:.0f} ms per figure; "
                             "forward+backward also with the host running ahead"},
        "results": results,
        "host_us_per_call": host,
    }


# --------------------------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------------------------

TABLE_COLUMNS = ("op", "size", "shape", "pass", "MB", *IMPLEMENTATIONS, "speed-up vs best other")


def _cell(record: dict | None, field: str) -> str:
    if record is None:
        return "–"
    if record["error"] or record.get(field) is None:
        return "error"
    pct = record["pct_of_copy" if field == "median_us" else "gpu_pct_of_copy"]
    return f"{record[field]:.1f} µs ({pct:.0f}%)"


def table_rows(result: dict, field: str = "median_us") -> list[list[str]]:
    """One row per (op, size, pass) that has `field`: each implementation's time and % of copy
    bandwidth. `field` "median_us" is the time as the host issues the call; "gpu_us" (forward+backward
    only) the time of its kernels with the host running ahead."""
    by_key: dict[tuple, dict[str, dict]] = {}
    for r in result["results"]:
        if field == "median_us" or r["pass"] == "forward+backward":
            by_key.setdefault((r["op"], r["size"], r["shape"], r["pass"], r["bytes"]), {})[r["impl"]] = r
    rows = []
    for (op, size, shape, pass_name, nbytes), impls in by_key.items():
        ours = impls.get("fuselab")
        others = [r[field] for name, r in impls.items() if name != "fuselab" and r.get(field)]
        # Above 1: fuselab is faster than every other implementation measured.
        ratio = f"{min(others) / ours[field]:.2f}×" if ours and ours.get(field) and others else "–"
        rows.append([op, size, shape, pass_name, f"{nbytes / 1e6:.1f}",
                     *(_cell(impls.get(i), field) for i in IMPLEMENTATIONS), ratio])
    return rows


def host_rows(result: dict) -> list[list[str]]:
    by_op: dict[str, dict[str, float]] = {}
    for h in result["host_us_per_call"]:
        by_op.setdefault(h["op"], {})[h["impl"]] = h["host_us"]
    return [[op, *(f"{v[i]:.1f}" if i in v else "–" for i in IMPLEMENTATIONS)] for op, v in by_op.items()]


def _header_lines(result: dict) -> list[str]:
    d = result["device"]
    return [
        f"date: {result['date']}",
        f"GPU: {d['name']} (sm {d['compute_capability']}), torch {d['torch']}, triton {d['triton']}, CUDA {d['cuda']}",
        f"command: `{result['command']}`",
        f"copy bandwidth: {result['ceilings']['copy_bandwidth_gbs']:.0f} GB/s ({result['ceilings']['source']}); "
        f"dtype {result['config']['dtype']}; {result['config']['timing']}",
    ]


def write_markdown(result: dict, path: Path) -> None:
    lines = ["# fuselab bench kernels", "", *(f"- {line}" for line in _header_lines(result)), ""]
    lines += ["Time per call (% of the copy bandwidth reached, counting the fewest bytes the op must move); "
              "speed-up: the best other implementation's time over fuselab's.", ""]
    lines += markdown_table(TABLE_COLUMNS, table_rows(result))
    gpu_rows = table_rows(result, "gpu_us")
    if gpu_rows:
        lines += ["", "## Forward+backward with the host running ahead (µs of GPU time)", "",
                  "The same calls, each timed after a spin kernel that keeps the GPU busy while the host issues it: "
                  "the time of the kernels alone, which a training step sees when its host runs ahead. Where the table "
                  "above is slower, the difference is the host's autograd path.", ""]
        lines += markdown_table(TABLE_COLUMNS, gpu_rows)
    lines += ["", "## Host cost per call at decode size (µs, wall time of the Python call, no sync)", ""]
    lines += markdown_table(("op", *IMPLEMENTATIONS), host_rows(result))
    path.write_text("\n".join(lines) + "\n")


def print_tables(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.width = max(console.width, 170)  # a pipe reports 80 columns, which would cut the table's cells
    for line in _header_lines(result):
        console.print(line, markup=False)
    table = Table(title="fuselab bench kernels: µs per call (% of copy bandwidth)")
    for col in TABLE_COLUMNS:
        table.add_column(col, justify="left" if col in ("op", "size", "pass") else "right")
    for row in table_rows(result):
        table.add_row(*row)
    console.print(table)
    gpu = Table(title="forward+backward, µs of GPU time with the host running ahead (% of copy bandwidth)")
    for col in TABLE_COLUMNS:
        gpu.add_column(col, justify="left" if col in ("op", "size", "pass") else "right")
    for row in table_rows(result, "gpu_us"):
        gpu.add_row(*row)
    if gpu.row_count:
        console.print(gpu)
    host = Table(title="host cost per call at decode size, µs (no sync)")
    for col in ("op", *IMPLEMENTATIONS):
        host.add_column(col, justify="left" if col == "op" else "right")
    for row in host_rows(result):
        host.add_row(*row)
    console.print(host)


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def _op_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"--ops needs comma-separated op names, got {text!r}")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ops", type=_op_list, default=None, metavar="OP1,OP2,...",
                        help="ops to time, comma-separated (default all: add, bias_act, rms_norm, rms_norm+residual, "
                             "layer_norm, swiglu, silu_and_mul, softmax, rope, cross_entropy, and any added since)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--quick", action="store_true",
                        help="decode and prefill sizes only, shorter timing (a rough result in a minute or two)")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile (its compilation takes the longest)")
    parser.add_argument("--out", type=output_dir, default="benchmarks/results", metavar="DIR",
                        help="folder for kernels.json and kernels.md (default benchmarks/results)")


def run(args: argparse.Namespace) -> int:
    if not has_cuda():
        print("fuselab bench kernels needs a CUDA GPU: it times compiled Triton kernels against torch and "
              "Liger-Kernel on the GPU. Nothing was measured.")
        return 0
    known = [op.name for op in ops()]
    unknown = [name for name in args.ops or () if name not in known]
    if unknown:
        print(f"fuselab bench kernels: error: argument --ops: unknown op(s) {', '.join(unknown)}; "
              f"choose from {', '.join(known)}", file=sys.stderr)
        return 2
    result = measure(args)
    print_tables(result)
    out = Path(args.out)
    write_json(result, out, "kernels")
    write_markdown(result, out / "kernels.md")
    print(f"wrote {out / 'kernels.json'}, {out / 'kernels.md'}")
    return 0
