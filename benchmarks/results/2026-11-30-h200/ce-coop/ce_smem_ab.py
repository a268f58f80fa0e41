"""Cross-entropy loss + gradient: rows kept in shared memory (Gluon, ce_smem_kernel.py) against main's
Triton kernel, side by side, with a plain copy of the logits (one read, one write) as the floor.

    PYTHONPATH=.:benchmarks/results/2026-11-30-h200/ce-coop python3 benchmarks/results/2026-11-30-h200/ce-coop/ce_smem_ab.py [ROWS ...]

ce_smem_ab.txt was recorded with the kernel wired into `cross_entropy` (which then took it for these calls);
this script calls it directly, with the same arguments.
"""
import importlib
import sys

import torch

import ce_smem_kernel
from fuselab.timing import bench

ce = importlib.import_module("fuselab.kernels.cross_entropy")


def shared_memory(x, t):
    n_rows = x.shape[0]
    row_loss = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    grad = torch.empty_like(x)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    ce_smem_kernel.cross_entropy_smem(x, t, row_loss, grad, -100, True, sms)
    return row_loss, grad


def main():
    torch.manual_seed(0)
    for rows in [int(a) for a in sys.argv[1:]] or [8192, 1024, 132]:
        x = torch.randn(rows, 128256, device="cuda", dtype=torch.bfloat16)
        t = torch.randint(0, 128256, (rows,), device="cuda")
        nbytes = 2 * x.numel() * x.element_size()
        res = {}
        for round_ in (1, 2):
            res[f"shared memory ({round_})"] = bench(lambda: shared_memory(x, t), host_ahead=True).median_us
            res[f"triton ({round_})"] = bench(lambda: ce._cross_entropy_forward(x, t, -100, "mean", 0.0, True),
                                              host_ahead=True).median_us
            res[f"clone ({round_})"] = bench(lambda: x.clone(), host_ahead=True).median_us
        for name, us in res.items():
            print(f"rows {rows} x 128256 {name:20s} {us:8.1f} us {nbytes / us / 1e3:6.0f} GB/s", flush=True)


if __name__ == "__main__":
    main()
