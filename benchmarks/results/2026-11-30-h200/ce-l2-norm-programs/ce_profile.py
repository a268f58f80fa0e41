"""Kernel times (torch.profiler) of cross_entropy forward+backward as `fuselab bench kernels` builds it.

    PYTHONPATH=. python3 benchmarks/results/2026-11-30-h200/ce-l2-norm-programs/ce_profile.py
"""
import torch
from torch.profiler import ProfilerActivity, profile

from fuselab.bench import kernels as bk


def kernel_times(step, iters=10):
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    return {e.key[:40]: e.self_device_time_total / iters for e in prof.key_averages() if e.self_device_time_total > 0}


def main():
    dev = torch.device("cuda")
    op = {o.name: o for o in bk.ops()}["cross_entropy"]
    for size in ("large", "prefill", "batch32", "decode"):
        w = op.sizes[size](torch.bfloat16, dev)
        step = bk.forward_backward_step(op.ours, w)
        times = kernel_times(step)
        parts = "  ".join(f"{k.strip('_')[:30]} {v:.1f}" for k, v in sorted(times.items(), key=lambda kv: -kv[1]))
        print(f"cross_entropy {size} fwd+bwd: kernels {sum(times.values()):.1f} us | {parts}", flush=True)


if __name__ == "__main__":
    main()
