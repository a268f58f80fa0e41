"""Per-kernel GPU time (torch.profiler) of fuselab's forward and forward+backward, as `fuselab bench kernels`
builds them, then the sum of a backward's partials by torch (sum + cast) against `sum_partials`.

    PYTHONPATH=. python3 benchmarks/results/2026-11-30-h200/gelu-partials-ce-split/profile_kernels.py
"""

import torch
from torch.profiler import ProfilerActivity, profile

from fuselab.bench import kernels as bk
from fuselab.kernels._partials import sum_partials
from fuselab.timing import bench

CASES = [("layer_norm", "large"), ("rms_norm", "large"), ("rms_norm+residual", "large"), ("bias_act", "large"),
         ("layer_norm", "decode"), ("rms_norm", "decode"), ("bias_act", "decode"), ("layer_norm", "batch32"),
         ("cross_entropy", "decode"), ("cross_entropy", "batch32"), ("cross_entropy", "large"), ("bias_act", "batch32")]


def kernel_times(label, step, iters=20):
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    rows = sorted(((e.self_device_time_total / iters, e.count / iters, e.key[:90]) for e in prof.key_averages()
                   if e.self_device_time_total > 0), reverse=True)
    print(f"== {label}: {sum(r[0] for r in rows):.1f} us of kernels per step")
    for t, count, name in rows:
        print(f"   {t:8.1f} us  x{count:.0f}  {name}")


def main():
    dev = torch.device("cuda")
    ops = {op.name: op for op in bk.ops()}
    for name, size in CASES:
        op = ops[name]
        workload = op.sizes[size](torch.bfloat16, dev)
        kernel_times(f"{name} {size} fwd", bk.forward_step(op.ours, workload))
        kernel_times(f"{name} {size} fwd+bwd", bk.forward_backward_step(op.ours, workload))
    for n in (261, 528, 1024):
        parts = torch.randn(2, n, 8192, device=dev)
        ours = bench(lambda: sum_partials(parts, torch.bfloat16)).median_us
        theirs = bench(lambda: (parts[0].sum(0).to(torch.bfloat16), parts[1].sum(0).to(torch.bfloat16))).median_us
        print(f"partials 2x{n}x8192: torch sum+cast x2 {theirs}  ours {ours}")


if __name__ == "__main__":
    main()
