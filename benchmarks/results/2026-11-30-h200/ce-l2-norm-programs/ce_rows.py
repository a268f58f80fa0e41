"""cross_entropy forward with its gradient at row counts between one and four programs an SM: which grid?

    PYTHONPATH=. python3 benchmarks/results/2026-11-30-h200/ce-l2-norm-programs/ce_rows.py
"""
import importlib

import torch

from fuselab.timing import bench

ce = importlib.import_module("fuselab.kernels.cross_entropy")


def main():
    dev = torch.device("cuda")
    print("rows: us of the forward with its gradient for _GRAD_PROGRAMS_PER_SM = 2 / 4 / 8 (splits, programs)", flush=True)
    for rows in (132, 200, 264, 300, 400, 528, 700, 800, 1024, 1100, 1600, 2048):
        logits = torch.randn(rows, 128256, device=dev, dtype=torch.bfloat16)
        target = torch.randint(0, 128256, (rows,), device=dev)
        line = f"{rows:5d}:"
        for per_sm in (2, 4, 8):
            ce._GRAD_PROGRAMS_PER_SM = per_sm
            splits, _ = ce._vocab_splits(rows, 128256, ce.SPLIT_CHUNK, 132, per_sm)
            t = bench(lambda: ce._cross_entropy_forward(logits, target, -100, "mean", 0.0, write_grad=True)).median_us
            line += f"  {t:7.1f} ({splits}, {min(rows, per_sm * 132) if splits == 1 else splits * rows})"
        ideal = 3 * logits.numel() * 2 / 4.242e6
        print(line, f" (two reads and a write at copy speed: {ideal:.1f})", flush=True)


if __name__ == "__main__":
    main()
