"""Times MODULE.run over MODULE.CONFIGS (a kernel experiment in this folder) against the package's kernel and a
clone of the logits, after checking loss and gradient against torch's float32 cross-entropy.

    PYTHONPATH=. python3 benchmarks/results/2026-11-30-h200/ce-hopper/drive.py MODULE [ROWS ...]
"""
import importlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main():
    from fuselab.timing import bench
    mod = importlib.import_module(sys.argv[1])
    ce = importlib.import_module("fuselab.kernels.cross_entropy")
    torch.manual_seed(0)
    for rows in [int(a) for a in sys.argv[2:]] or [8192, 1024]:
        x = torch.randn(rows, 128256, device="cuda", dtype=torch.bfloat16)
        t = torch.randint(0, 128256, (rows,), device="cuda")
        ref_loss = torch.nn.functional.cross_entropy(x.float(), t, reduction="none")
        xr = x.float().requires_grad_()
        torch.nn.functional.cross_entropy(xr, t).backward()
        ref_grad = xr.grad
        del xr
        nbytes = 2 * x.numel() * x.element_size()
        line = lambda name, us: print(f"rows {rows} {name:52s} {us:8.1f} us {nbytes / us / 1e3:6.0f} GB/s", flush=True)
        line("package kernel", bench(lambda: ce._cross_entropy_forward(x, t, -100, "mean", 0.0, True), host_ahead=True).median_us)
        line("clone", bench(lambda: x.clone(), host_ahead=True).median_us)
        for cfg in mod.CONFIGS:
            try:
                loss, grad = mod.run(x, t, *cfg)
                err_l = (loss - ref_loss).abs().max().item()
                err_g = (grad.float() - ref_grad).abs().max().item()
                del loss, grad
                us = bench(lambda: mod.run(x, t, *cfg), host_ahead=True).median_us
                line(f"{cfg} l{err_l:.1e} g{err_g:.1e}", us)
            except Exception as e:  # noqa: BLE001
                print(f"rows {rows} {cfg} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
        line("package kernel again", bench(lambda: ce._cross_entropy_forward(x, t, -100, "mean", 0.0, True), host_ahead=True).median_us)
        line("clone again", bench(lambda: x.clone(), host_ahead=True).median_us)


if __name__ == "__main__":
    main()
