"""`fuselab bench optim`: one AdamW step of fuselab's FusedAdamW next to torch.optim.AdamW's
foreach and fused implementations, in one run.

Two cases: "large", 64 parameters of 4096×4096 (1.07 B values, bandwidth-bound: a float32 step
must move at least 28 bytes per parameter, 16 read and 12 written), and "many-small", 256
parameters of 4096 values, where the cost is launches and host work. For each: the median step
time (CUDA events, L2 flushed between steps), the GB/s that 28 bytes per parameter make and their
share of the copy bandwidth, and the host time to issue one step without a sync.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import datetime, timezone
from typing import Callable

import torch

from fuselab.bench import command_line, error_text, non_negative_float, output_dir, positive_float, write_json
from fuselab.device import ceilings, device_info, has_cuda
from fuselab.timing import bench

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
CASES = {"large": (64, (4096, 4096)), "many-small": (256, (4096,))}
BYTES_PER_PARAM = 28  # fp32 params: read param, grad, exp_avg, exp_avg_sq; write param, exp_avg, exp_avg_sq


def _optimizers(params: list[torch.Tensor]) -> dict[str, torch.optim.Optimizer]:
    from fuselab.optim import FusedAdamW

    hyper = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    return {
        "fuselab FusedAdamW": FusedAdamW(params, **hyper),
        "torch AdamW foreach": torch.optim.AdamW(params, foreach=True, **hyper),
        "torch AdamW fused": torch.optim.AdamW(params, fused=True, **hyper),
    }


def _host_us_per_step(step: Callable[[], object], calls: int = 20) -> float:
    """Wall time of issuing one step with no sync: what the host pays per step."""
    torch.cuda.synchronize()
    samples = []
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls):
            step()
        samples.append((time.perf_counter() - start) * 1e6 / calls)
        torch.cuda.synchronize()
    return statistics.median(samples)


def measure(args: argparse.Namespace) -> dict:
    dtype, copy_gbs = DTYPES[args.dtype], ceilings().copy_bandwidth_gbs
    results = []
    for case in args.cases:
        count, shape = CASES[case]
        # The optimizers share parameters and gradients (each keeps its own state): the values drift
        # from step to step, which changes nothing in the time a step takes.
        params = [torch.randn(shape, dtype=dtype, device="cuda", requires_grad=True) for _ in range(count)]
        for p in params:
            p.grad = torch.randn_like(p)
        n_values = count * params[0].numel()
        optimizers = _optimizers(params)
        for name in list(optimizers):
            opt = optimizers.pop(name)  # dropped after its turn, with its state: one optimizer's state at a time
            record = {"case": case, "params": count, "values": n_values, "impl": name,
                      "median_us": None, "gbs": None, "pct_of_copy": None, "host_us": None, "error": None}
            try:
                us = bench(opt.step, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms).median_us
                gbs = n_values * BYTES_PER_PARAM / us / 1e3
                record.update(median_us=us, gbs=gbs, pct_of_copy=100 * gbs / copy_gbs, host_us=_host_us_per_step(opt.step))
            except Exception as err:  # noqa: BLE001 - one failing implementation must not end the run
                record["error"] = error_text(err)
            results.append(record)
            print(f"  {case} {name}: " + (record["error"] or f"{record['median_us']:.1f} us"), file=sys.stderr)
            del opt
            torch.cuda.empty_cache()
        del params
        torch.cuda.empty_cache()
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "command": command_line(),
            "device": device_info().to_dict(), "copy_bandwidth_gbs": copy_gbs, "dtype": args.dtype,
            "bytes_per_param": BYTES_PER_PARAM, "results": results}


def print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"AdamW step, {result['dtype']} params ({result['bytes_per_param']} B/param counted)")
    for col in ("case", "implementation", "µs per step", "GB/s", "% of copy", "host µs per step"):
        table.add_column(col, justify="left" if col in ("case", "implementation") else "right")
    for r in result["results"]:
        if r["error"]:
            table.add_row(r["case"], r["impl"], r["error"], "", "", "")
        else:
            table.add_row(r["case"], r["impl"], f"{r['median_us']:.1f}", f"{r['gbs']:.0f}", f"{r['pct_of_copy']:.0f}%", f"{r['host_us']:.1f}")
    Console().print(table)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="parameter dtype (default float32)")
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES), help="which parameter sets to time")
    parser.add_argument("--warmup-ms", type=non_negative_float, default=100.0)
    parser.add_argument("--rep-ms", type=positive_float, default=500.0)
    parser.add_argument("--out", type=output_dir, default="benchmarks/results", metavar="DIR", help="folder for optim.json (default benchmarks/results)")


def run(args: argparse.Namespace) -> int:
    if not has_cuda():
        print("fuselab bench optim needs a CUDA GPU: it times optimizer steps on the GPU. Nothing was measured.")
        return 0
    result = measure(args)
    print_table(result)
    print(f"wrote {write_json(result, args.out, 'optim')}")
    return 0
