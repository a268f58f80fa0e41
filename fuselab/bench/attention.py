"""`fuselab bench attention`: fuselab's attention kernels side by side with torch's, in one run.

Prefill: `flash_attention` against `F.scaled_dot_product_attention` pinned to each backend torch
offers (flash, cuDNN, memory-efficient; a backend that refuses a shape is reported as such), in
TFLOP/s of the forward and of forward+backward, for sequences of 1k/4k/16k and head dims 64/128,
causal and not. Shapes follow the baseline table: batch · seq = 32k tokens, heads · head_dim = 2048.
FLOPs are counted as 4·B·H·S²·D for the forward, halved when causal; the backward as 2.5× that.

Decode: `decode_attention` over a paged cache against SDPA over the cache gathered by block table,
in GB/s of the cache bytes a call must read (keys and values of every context token, plus q and
out) and as a share of the copy bandwidth (`fuselab.device.ceilings()`).

Prefill figures are medians of CUDA-event timings with the L2 cache flushed between calls. Decode
is timed as an engine runs it: inside a CUDA graph (one launch for the step, so the host's launch
cost is not in the figure), over enough distinct caches in a row, like the layers of a model, that
together they are 4× the L2 cache and every call reads from HBM.
"""

from __future__ import annotations

import argparse
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from fuselab.bench import command_line, error_text, int_list, markdown_table, output_dir, write_json
from fuselab.device import ceilings, device_info, has_cuda
from fuselab.kernels._common.launch import dependent_launches, pdl_allowed
from fuselab.timing import bench

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
PREFILL_TOKENS = 32768  # batch · seq of every prefill shape
PREFILL_WIDTH = 2048  # heads · head_dim
SDPA_BACKENDS = {"sdpa flash": "FLASH_ATTENTION", "sdpa cudnn": "CUDNN_ATTENTION", "sdpa efficient": "EFFICIENT_ATTENTION"}
PREFILL_IMPLS = ("fuselab", *SDPA_BACKENDS)
DECODE_IMPLS = ("fuselab", "torch sdpa (gathered)")
DECODE_HEADS, DECODE_KV_HEADS, DECODE_HEAD_DIM, DECODE_BLOCK_SIZE = 32, 8, 128, 16  # Llama-3-8B shapes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seqs", type=int_list, default=[1024, 4096, 16384], metavar="S1,S2,...",
                        help="prefill sequence lengths (default 1024,4096,16384); batch = 32768 / seq")
    parser.add_argument("--head-dims", type=int_list, default=[64, 128], metavar="D1,D2",
                        help="prefill head dims (default 64,128); heads = 2048 / head_dim")
    parser.add_argument("--batches", type=int_list, default=[1, 8, 64], metavar="B1,B2,...",
                        help="decode batch sizes (default 1,8,64)")
    parser.add_argument("--contexts", type=int_list, default=[512, 1024, 2048, 4096, 8192, 16384, 32768],
                        metavar="C1,C2,...", help="decode context lengths (default 512 ... 32768)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--no-backward", action="store_true", help="time the prefill forward only")
    parser.add_argument("--only", choices=("prefill", "decode"), default=None, help="run one half of the benchmark")
    parser.add_argument("--quick", action="store_true",
                        help="seq 4096 at head dim 128, decode batch 8 at contexts 4096 and 32768, shorter timing")
    parser.add_argument("--sweep", action="store_true",
                        help="also time candidate launch configs of the prefill forward (seq 4096) and decode "
                             "(batch 8, context 8192) kernels per head dim, and the decode split count at batch 1/8/64 "
                             "and contexts 4k-32k, and report the fastest: the figures behind FORWARD_CONFIGS, "
                             "DECODE_CONFIGS and the split rule; --only limits it to one half")
    parser.add_argument("--out", type=output_dir, default="benchmarks/results", metavar="DIR",
                        help="folder for attention.json and attention.md (default benchmarks/results)")


# --------------------------------------------------------------------------------------------
# Prefill
# --------------------------------------------------------------------------------------------


def prefill_flops(batch: int, heads: int, seq: int, head_dim: int, causal: bool, backward: bool) -> float:
    forward = 4.0 * batch * heads * seq * seq * head_dim / (2 if causal else 1)
    return forward * 3.5 if backward else forward


def _sdpa(backend_name: str) -> Callable:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)

    def call(q, k, v, causal):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return call


def prefill_impls() -> dict[str, Callable]:
    from fuselab.kernels import flash_attention

    impls = {"fuselab": lambda q, k, v, causal: flash_attention(q, k, v, causal=causal)}
    impls.update({name: _sdpa(backend) for name, backend in SDPA_BACKENDS.items()})
    return impls


def _forward_backward(fn: Callable, q, k, v, causal: bool) -> Callable[[], object]:
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    dout = torch.randn_like(q)
    return lambda: torch.autograd.grad(fn(*leaves, causal), leaves, dout)


def measure_prefill(args: argparse.Namespace, timing: dict) -> list[dict]:
    dtype = DTYPES[args.dtype]
    impls = prefill_impls()
    seqs, head_dims = ([4096], [128]) if args.quick else (args.seqs, args.head_dims)
    records = []
    for head_dim in head_dims:
        for seq in seqs:
            batch, heads = max(1, PREFILL_TOKENS // seq), max(1, PREFILL_WIDTH // head_dim)
            q, k, v = (torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=dtype) for _ in range(3))
            for causal in (True, False):
                expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                for backward in (False,) if args.no_backward else (False, True):
                    flops = prefill_flops(batch, heads, seq, head_dim, causal, backward)
                    for name, fn in impls.items():
                        record = {"batch": batch, "heads": heads, "seq": seq, "head_dim": head_dim, "causal": causal,
                                  "pass": "forward+backward" if backward else "forward", "impl": name,
                                  "median_us": None, "tflops": None, "max_abs_diff": None, "error": None}
                        try:
                            step = _forward_backward(fn, q, k, v, causal) if backward else (lambda fn=fn: fn(q, k, v, causal))
                            if not backward:
                                record["max_abs_diff"] = (step().float() - expected.float()).abs().max().item()
                            us = bench(step, **timing).median_us
                            record.update(median_us=us, tflops=flops / us / 1e6)
                        except Exception as err:  # noqa: BLE001 - a backend that refuses a shape is a result
                            record["error"] = error_text(err)
                        records.append(record)
                        _progress(f"prefill B{batch} H{heads} S{seq} D{head_dim} causal={causal} "
                                  f"{record['pass']} {name}", record)
            del q, k, v
            torch.cuda.empty_cache()
    return records


# --------------------------------------------------------------------------------------------
# Decode
# --------------------------------------------------------------------------------------------


def decode_bytes(batch: int, context: int, heads: int, kv_heads: int, head_dim: int, itemsize: int) -> int:
    """What a decode step must move at the least: every cached key and value once, q in, out back."""
    return (2 * batch * context * kv_heads * head_dim + 2 * batch * heads * head_dim) * itemsize


def paged_workload(batch: int, context: int, dtype: torch.dtype) -> dict:
    """A cache holding `batch` sequences of `context` tokens in shuffled blocks, and a query each."""
    blocks_per_seq = -(-context // DECODE_BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, DECODE_BLOCK_SIZE, DECODE_KV_HEADS, DECODE_HEAD_DIM)
    return {
        "q": torch.randn(batch, DECODE_HEADS, DECODE_HEAD_DIM, device="cuda", dtype=dtype),
        "k_cache": torch.randn(shape, device="cuda", dtype=dtype),
        "v_cache": torch.randn(shape, device="cuda", dtype=dtype),
        "block_tables": torch.randperm(num_blocks, device="cuda").view(batch, blocks_per_seq).to(torch.int32),
        "seq_lens": torch.full((batch,), context, device="cuda", dtype=torch.int32),
    }


def torch_decode(q, k_cache, v_cache, block_tables, seq_lens) -> torch.Tensor:
    """What one writes without a paged kernel: gather each sequence's blocks, then SDPA (all contexts equal here)."""
    batch, context = q.shape[0], k_cache.shape[1] * block_tables.shape[1]
    k = k_cache[block_tables].view(batch, context, *k_cache.shape[2:]).transpose(1, 2)
    v = v_cache[block_tables].view(batch, context, *v_cache.shape[2:]).transpose(1, 2)
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, enable_gqa=True)
    return out.squeeze(2)


def paged_workloads(batch: int, context: int, dtype: torch.dtype) -> list[dict]:
    """Distinct workloads, as many as it takes to fill 4× the L2 cache (at least one)."""
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    nbytes = decode_bytes(batch, context, DECODE_HEADS, DECODE_KV_HEADS, DECODE_HEAD_DIM, dtype.itemsize)
    return [paged_workload(batch, context, dtype) for _ in range(min(256, max(1, -(-4 * l2 // nbytes))))]


def decode_us(fn: Callable, workloads: list[dict], timing: dict) -> float:
    """µs per call of `fn` over each workload in turn, the chain replayed from one CUDA graph; fuselab's
    kernels launched with programmatic dependent launch, as in the engine's decode step."""
    chain = lambda: [fn(**w) for w in workloads]  # noqa: E731
    with dependent_launches():  # nothing in the chain writes what an earlier call reads
        result = bench(chain, cuda_graph=True, warmup_ms=timing["warmup_ms"], rep_ms=timing["rep_ms"])
    return result.median_us / len(workloads)


def measure_decode(args: argparse.Namespace, timing: dict, copy_gbs: float) -> list[dict]:
    from fuselab.kernels import decode_attention

    dtype = DTYPES[args.dtype]
    batches, contexts = ([8], [4096, 32768]) if args.quick else (args.batches, args.contexts)
    impls = {"fuselab": decode_attention, "torch sdpa (gathered)": torch_decode}
    records = []
    for batch in batches:
        for context in contexts:
            workloads = paged_workloads(batch, context, dtype)
            w = workloads[0]
            nbytes = decode_bytes(batch, context, DECODE_HEADS, DECODE_KV_HEADS, DECODE_HEAD_DIM, dtype.itemsize)
            expected = torch_decode(**w)
            for name, fn in impls.items():
                record = {"batch": batch, "context": context, "impl": name, "bytes": nbytes, "median_us": None,
                          "gbs": None, "pct_of_copy": None, "max_abs_diff": None, "error": None}
                try:
                    record["max_abs_diff"] = (fn(**w).float() - expected.float()).abs().max().item()
                    us = decode_us(fn, workloads, timing)
                    gbs = nbytes / us / 1e3
                    record.update(median_us=us, gbs=gbs, pct_of_copy=100 * gbs / copy_gbs)
                except Exception as err:  # noqa: BLE001 - e.g. the gathered copy running out of memory
                    record["error"] = error_text(err)
                records.append(record)
                _progress(f"decode batch {batch} context {context} {name}", record)
            del w, workloads, expected
            torch.cuda.empty_cache()
    return records


# --------------------------------------------------------------------------------------------
# Launch-config sweep
# --------------------------------------------------------------------------------------------


def forward_candidates() -> list:
    from fuselab.kernels.attention.common import ForwardConfig

    return [ForwardConfig(m, n, w, s) for m in (64, 128) for n in (32, 64, 128) for w in (4, 8) for s in (2, 3, 4)
            if m % n == 0]


def tma_forward_candidates() -> list:
    from fuselab.kernels.attention.common import ForwardConfig

    return [ForwardConfig(m, n, w, s) for m, n, w, s in ((128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3),
                                                         (128, 128, 8, 2), (64, 64, 4, 3), (64, 64, 4, 4),
                                                         (128, 64, 8, 4))]


def decode_candidates() -> list:
    from fuselab.kernels.attention.paged_attention import DecodeConfig

    return [DecodeConfig(n, w, s) for n in (32, 64, 128) for w in (4, 8) for s in (2, 3, 4)]


def _time_configs(table: dict, key: object, candidates: list, time_us: Callable[[], float]) -> list[dict]:
    """`time_us()` with each candidate in table[key]; a config that does not compile (shared memory)
    is skipped. The table is left as it was, a key it lacked left out."""
    missing = object()
    original = table.get(key, missing)
    timed = []
    try:
        for cfg in candidates:
            table[key] = cfg
            try:
                timed.append({"config": cfg._asdict(), "median_us": time_us()})
            except Exception as err:  # noqa: BLE001 - e.g. out of shared memory at this block size
                _progress(f"sweep {cfg}", {"error": error_text(err)})
    finally:
        if original is missing:
            table.pop(key, None)
        else:
            table[key] = original
    return sorted(timed, key=lambda t: t["median_us"])


SPLIT_SWEEP_WORKLOADS = ((1, 4096), (1, 32768), (8, 4096), (8, 16384), (8, 32768), (64, 4096))
SPLIT_SWEEP_COUNTS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64)


def _time_split_counts(workloads: list[dict], timing: dict) -> list[dict]:
    """Decode timed at each split count, for each pipeline depth of the current config, fastest first."""
    from fuselab.kernels.attention import paged_attention

    head_dim = workloads[0]["q"].shape[-1]
    original, timed = paged_attention.DECODE_CONFIGS[head_dim], []
    try:
        for stages in (2, 3):
            paged_attention.DECODE_CONFIGS[head_dim] = original._replace(num_stages=stages)
            for splits in SPLIT_SWEEP_COUNTS:
                def step(q, k_cache, v_cache, block_tables, seq_lens, splits=splits):
                    return paged_attention.decode_launch(q, k_cache, v_cache, block_tables, seq_lens, head_dim**-0.5,
                                                         splits)
                timed.append({"config": {"splits": splits, "num_stages": stages},
                              "median_us": decode_us(step, workloads, timing)})
    finally:
        paged_attention.DECODE_CONFIGS[head_dim] = original
    return sorted(timed, key=lambda t: t["median_us"])


def sweep_configs(args: argparse.Namespace, timing: dict) -> list[dict]:
    from fuselab.kernels import decode_attention, flash_attention
    from fuselab.kernels.attention import common as _flash_common, paged_attention

    dtype, seq, out = DTYPES[args.dtype], 4096, []
    for head_dim in args.head_dims if args.only != "decode" else ():
        batch, heads = PREFILL_TOKENS // seq, PREFILL_WIDTH // head_dim
        q, k, v = (torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=dtype) for _ in range(3))
        key = _flash_common.padded_head_dim(head_dim)  # the configs are keyed by the padded head dim
        for causal in (True, False):
            def time_us():
                return bench(lambda: flash_attention(q, k, v, causal=causal), **timing).median_us
            flops = prefill_flops(batch, heads, seq, head_dim, causal, backward=False)
            # The pointer kernel's tiles with the TMA kernel out of the way, then the TMA kernel's.
            tma_table, tma_key = _flash_common.TMA_FORWARD_CONFIGS, (key, causal)
            tma_current = tma_table.pop(tma_key, None)
            try:
                pointer = _time_configs(_flash_common.FORWARD_CONFIGS, key, forward_candidates(), time_us)
            finally:
                if tma_current is not None:
                    tma_table[tma_key] = tma_current
            tma = _time_configs(tma_table, tma_key, tma_forward_candidates(), time_us)
            for kernel, timed, current in (("flash forward", pointer, _flash_common.FORWARD_CONFIGS[key]),
                                           ("flash forward, TMA", tma, tma_current)):
                out.append({"kernel": kernel, "head_dim": head_dim, "causal": causal,
                            "current": None if current is None else current._asdict(),
                            "best": [{**t, "tflops": flops / t["median_us"] / 1e6} for t in timed[:3]]})
        del q, k, v
        torch.cuda.empty_cache()
    if args.only == "prefill":
        return out
    workloads = paged_workloads(8, 8192, dtype)
    timed = _time_configs(paged_attention.DECODE_CONFIGS, DECODE_HEAD_DIM, decode_candidates(),
                          lambda: decode_us(decode_attention, workloads, timing))
    out.append({"kernel": "decode", "head_dim": DECODE_HEAD_DIM, "causal": None,
                "current": paged_attention.DECODE_CONFIGS[DECODE_HEAD_DIM]._asdict(), "best": timed[:3]})
    for batch, context in SPLIT_SWEEP_WORKLOADS:
        workloads = paged_workloads(batch, context, dtype)
        timed = _time_split_counts(workloads, timing)
        out.append({"kernel": f"decode batch {batch} context {context}, split count", "head_dim": DECODE_HEAD_DIM,
                    "causal": None, "current": {"splits": paged_attention.num_splits(batch, DECODE_KV_HEADS, context,
                                                                                     32, workloads[0]["q"].device)},
                    "best": timed[:5], "all": timed})
        del workloads
        torch.cuda.empty_cache()
    return out


# --------------------------------------------------------------------------------------------
# Running and reporting
# --------------------------------------------------------------------------------------------


def _progress(label: str, record: dict) -> None:
    print(f"  {label}: " + (record["error"] or f"{record['median_us']:.1f} us"), file=sys.stderr)


def measure(args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    ceiling = ceilings()
    timing = dict(warmup_ms=5.0, rep_ms=20.0) if args.quick else dict(warmup_ms=25.0, rep_ms=100.0)
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command_line(),
        "device": device_info().to_dict(),
        "ceilings": {"copy_bandwidth_gbs": ceiling.copy_bandwidth_gbs, "source": ceiling.source},
        "config": {"dtype": args.dtype, "quick": args.quick,
                   "timing": f"prefill: median of CUDA-event timings, L2 flushed between calls; decode: median of "
                             f"CUDA-graph replays of a chain of distinct caches (4x L2), per call, fuselab's kernels with "
                             f"programmatic dependent launch ({'sm_90+' if pdl_allowed() else 'off: FUSELAB_PDL=0'}) as in "
                             f"the engine's decode step; {timing['rep_ms']:.0f} ms per figure",
                   "decode": f"{DECODE_HEADS} heads / {DECODE_KV_HEADS} kv heads, head dim {DECODE_HEAD_DIM}, "
                             f"block size {DECODE_BLOCK_SIZE}, shuffled block tables"},
        "prefill": [] if args.only == "decode" else measure_prefill(args, timing),
        "decode": [] if args.only == "prefill" else measure_decode(args, timing, ceiling.copy_bandwidth_gbs),
        "sweep": sweep_configs(args, timing) if args.sweep else [],
    }


PREFILL_COLUMNS = ("shape", "causal", "pass", *PREFILL_IMPLS, "vs flash", "vs cuDNN")
DECODE_COLUMNS = ("batch", "context", "MB", *DECODE_IMPLS, "speed-up")


def _ratio(ours: dict | None, other: dict | None, key: str) -> str:
    if not ours or not other or ours[key] is None or other[key] is None:
        return "–"
    return f"{ours[key] / other[key]:.2f}×"


def prefill_rows(result: dict) -> list[list[str]]:
    """TFLOP/s of each implementation; ratios are fuselab's throughput over flash's and cuDNN's."""
    groups: dict[tuple, dict[str, dict]] = {}
    for r in result["prefill"]:
        key = (f"B{r['batch']} H{r['heads']} S{r['seq']} D{r['head_dim']}", "yes" if r["causal"] else "no", r["pass"])
        groups.setdefault(key, {})[r["impl"]] = r

    def cell(r: dict | None) -> str:
        if r is None:
            return "–"
        return "unsupported" if r["error"] else f"{r['tflops']:.0f}"

    return [[*key, *(cell(impls.get(i)) for i in PREFILL_IMPLS),
             _ratio(impls.get("fuselab"), impls.get("sdpa flash"), "tflops"),
             _ratio(impls.get("fuselab"), impls.get("sdpa cudnn"), "tflops")]
            for key, impls in groups.items()]


def decode_rows(result: dict) -> list[list[str]]:
    """µs, GB/s and % of copy bandwidth per implementation; speed-up is torch's time over fuselab's."""
    groups: dict[tuple, dict[str, dict]] = {}
    for r in result["decode"]:
        groups.setdefault((r["batch"], r["context"], r["bytes"]), {})[r["impl"]] = r

    def cell(r: dict | None) -> str:
        if r is None:
            return "–"
        return "error" if r["error"] else f"{r['median_us']:.1f} µs, {r['gbs']:.0f} GB/s ({r['pct_of_copy']:.0f}%)"

    rows = []
    for (batch, context, nbytes), impls in groups.items():
        ours, torch_ref = impls.get("fuselab"), impls.get(DECODE_IMPLS[1])
        speedup = _ratio(torch_ref, ours, "median_us")
        rows.append([str(batch), str(context), f"{nbytes / 1e6:.1f}", *(cell(impls.get(i)) for i in DECODE_IMPLS), speedup])
    return rows


def sweep_lines(result: dict) -> list[str]:
    lines = []
    for entry in result.get("sweep", []):
        causal = "" if entry["causal"] is None else f" causal={entry['causal']}"
        ranked = "; ".join(f"{tuple(t['config'].values())} {t['median_us']:.1f} µs" for t in entry["best"])
        current = "none" if entry["current"] is None else tuple(entry["current"].values())
        lines.append(f"{entry['kernel']} d={entry['head_dim']}{causal}: current {current}, "
                     f"fastest {ranked or 'none compiled'}")
    return lines


def _header_lines(result: dict) -> list[str]:
    d, c = result["device"], result["config"]
    return [
        f"date: {result['date']}",
        f"GPU: {d['name']} (sm {d['compute_capability']}), torch {d['torch']}, triton {d['triton']}, CUDA {d['cuda']}",
        f"command: `{result['command']}`",
        f"dtype {c['dtype']}; {c['timing']}",
        "prefill: TFLOP/s, FLOPs 4·B·H·S²·D per forward (halved if causal), backward 2.5× the forward",
        f"decode: {c['decode']}; copy bandwidth {result['ceilings']['copy_bandwidth_gbs']:.0f} GB/s "
        f"({result['ceilings']['source']})",
    ]


def write_markdown(result: dict, path: Path) -> None:
    lines = ["# fuselab bench attention", "", *(f"- {line}" for line in _header_lines(result))]
    if result["prefill"]:
        lines += ["", "## Prefill, TFLOP/s (ratios: fuselab's throughput over the backend's)", ""]
        lines += markdown_table(PREFILL_COLUMNS, prefill_rows(result))
    if result["decode"]:
        lines += ["", "## Decode over a paged cache (speed-up: torch's time over fuselab's)", ""]
        lines += markdown_table(DECODE_COLUMNS, decode_rows(result))
    if result.get("sweep"):
        lines += ["", "## Launch-config sweep (block sizes, warps, stages; fastest first)", ""]
        lines += [f"- {line}" for line in sweep_lines(result)]
    path.write_text("\n".join(lines) + "\n")


def print_tables(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.width = max(console.width, 170)  # a pipe reports 80 columns, which would cut the cells
    for line in _header_lines(result):
        console.print(line, markup=False)
    for title, columns, rows in (
        ("prefill attention, TFLOP/s", PREFILL_COLUMNS, prefill_rows(result) if result["prefill"] else []),
        ("decode attention over a paged cache", DECODE_COLUMNS, decode_rows(result) if result["decode"] else []),
    ):
        if not rows:
            continue
        table = Table(title=title)
        for col in columns:
            table.add_column(col, justify="left" if col in ("shape", "pass") else "right")
        for row in rows:
            table.add_row(*row)
        console.print(table)
    for line in sweep_lines(result):
        console.print(line, markup=False)


def run(args: argparse.Namespace) -> int:
    if not has_cuda():
        print("fuselab bench attention needs a CUDA GPU: it times Triton kernels against torch's attention "
              "backends. Nothing was measured.")
        return 0
    result = measure(args)
    print_tables(result)
    out = Path(args.out)
    write_json(result, out, "attention")
    write_markdown(result, out / "attention.md")
    print(f"wrote {out / 'attention.json'}, {out / 'attention.md'}")
    return 0
