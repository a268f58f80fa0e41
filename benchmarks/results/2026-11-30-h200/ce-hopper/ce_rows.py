"""Loss + gradient (what forward + backward costs when the incoming gradient is 1) at several row counts,
the Hopper kernel (_cross_entropy_hopper, forced on) against the Triton kernel, with a clone of the logits
as the floor. 128256 classes, bf16.

    PYTHONPATH=. python3 benchmarks/results/2026-11-30-h200/ce-hopper/ce_rows.py [ROWS ...]
"""
import importlib
import sys

import torch

from fuselab.timing import bench

ce = importlib.import_module("fuselab.kernels.cross_entropy")
hopper = ce.hopper


def main():
    torch.manual_seed(0)
    for rows in [int(a) for a in sys.argv[1:]] or [528, 792, 1024, 1320, 2048, 8192]:
        x = torch.randn(rows, 128256, device="cuda", dtype=torch.bfloat16)
        t = torch.randint(0, 128256, (rows,), device="cuda")
        nbytes = 2 * x.numel() * x.element_size()
        res = {}
        for round_ in (1, 2):
            for name, on in (("hopper", True), ("triton", False)):
                ce.hopper = hopper if on else None
                hopper.ROWS_PER_SM = 0
                res[f"{name} ({round_})"] = bench(
                    lambda: ce._cross_entropy_forward(x, t, -100, "mean", 0.0, True), host_ahead=True).median_us
            res[f"clone ({round_})"] = bench(lambda: x.clone(), host_ahead=True).median_us
        ce.hopper = hopper
        for name, us in res.items():
            print(f"rows {rows:5d} x 128256 {name:12s} {us:8.1f} us {nbytes / us / 1e3:6.0f} GB/s", flush=True)


if __name__ == "__main__":
    main()
