"""Backward programs vs the partial sums they leave: layer_norm / rms_norm programs per SM, bias_act band rows.

    PYTHONPATH=. python3 benchmarks/results/2026-11-30-h200/ce-l2-norm-programs/sweep_bwd.py
"""
import importlib

import torch
from torch.profiler import ProfilerActivity, profile

from fuselab.bench import kernels as bk
ba = importlib.import_module("fuselab.kernels.bias_act")
ln = importlib.import_module("fuselab.kernels.layer_norm")
rn = importlib.import_module("fuselab.kernels.rms_norm")
from fuselab.kernels._launch import cdiv, sm_count
from fuselab.timing import bench


def kernel_times(step, iters=20):
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    return {e.key[:40]: e.self_device_time_total / iters for e in prof.key_averages() if e.self_device_time_total > 0}


def groups(per_sm):
    def row_groups(n_rows, num_warps, device):
        target = sm_count(device) * per_sm
        rpp = cdiv(n_rows, min(n_rows, target))
        return cdiv(n_rows, rpp), rpp
    return row_groups


def show(label, step):
    times = kernel_times(step)
    total = sum(times.values())
    wall = bench(step).median_us
    parts = "  ".join(f"{k.strip('_')[:28]} {v:.1f}" for k, v in sorted(times.items(), key=lambda kv: -kv[1]))
    print(f"{label:40s} kernels {total:7.1f} us  bench {wall:7.1f} us | {parts}", flush=True)


def main():
    dev = torch.device("cuda")
    ops = {op.name: op for op in bk.ops()}
    original = ln.row_groups
    for size in ("large", "prefill"):
        for name, module in (("layer_norm", ln), ("rms_norm", rn), ("rms_norm+residual", rn)):
            op = ops[name]
            w = op.sizes[size](torch.bfloat16, dev)
            step = bk.forward_backward_step(op.ours, w)
            show(f"{name} {size} current", step)
            for per_sm in (1, 2, 3, 4, 8):
                module.row_groups = groups(per_sm)
                show(f"{name} {size} {per_sm}/SM", step)
            module.row_groups = original
        op = ops["bias_act"]
        w = op.sizes[size](torch.bfloat16, dev)
        step = bk.forward_backward_step(op.ours, w)
        for rows in (16, 32, 64, 128, 256):
            ba._BACKWARD_ROWS = rows
            ba._band_rows.cache_clear()
            show(f"bias_act {size} band {rows}", step)
        ba._BACKWARD_ROWS = 16
        ba._band_rows.cache_clear()


if __name__ == "__main__":
    main()
