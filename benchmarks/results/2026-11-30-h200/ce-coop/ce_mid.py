"""Cross-entropy loss + gradient at 1-300 rows x 128256: rows walked whole (`_cross_entropy_kernel`, one
program an SM taking rows in turn: "fused") against rows cut into parts and merged ("split"), with the
row count from which rows are walked whole at 264, 1056, 0, and what main does ("main").

    PYTHONPATH=. python3 benchmarks/results/2026-11-30-h200/ce-coop/ce_mid.py [ROWS ...]

ce_mid.txt (default rows, no "fused" column yet) and ce_small.txt (rows 1 ... 131) were recorded when main
walked rows whole from 132 rows on; it now does from 66 (half the SMs)."""
import importlib
import sys

import torch

from fuselab.timing import bench

ce = importlib.import_module("fuselab.kernels.cross_entropy")


ROWS = [int(a) for a in sys.argv[1:]] or [100, 131, 132, 160, 200, 240, 263, 264, 300]


def main():
    torch.manual_seed(0)
    V = 128256
    orig = ce._vocab_splits
    for rows in ROWS:
        logits = torch.randn(rows, V, device="cuda", dtype=torch.bfloat16)
        target = torch.randint(0, V, (rows,), device="cuda")
        nbytes = 2 * logits.numel() * 2
        res = {}
        ce._vocab_splits = orig
        res["main"] = bench(lambda: ce._cross_entropy_forward(logits, target, -100, "mean", 0.0, True), host_ahead=True).median_us
        ce._vocab_splits = lambda n, v, c, s, per_sm: orig(n, v, c, s, 2 * s)
        res["split below 264"] = bench(lambda: ce._cross_entropy_forward(logits, target, -100, "mean", 0.0, True), host_ahead=True).median_us
        ce._vocab_splits = lambda n, v, c, s, per_sm: orig(n, v, c, s, 0)
        res["fused"] = bench(lambda: ce._cross_entropy_forward(logits, target, -100, "mean", 0.0, True), host_ahead=True).median_us
        ce._vocab_splits = lambda n, v, c, s, per_sm: orig(n, v, c, s, 8 * s)
        res["split below 1056"] = bench(lambda: ce._cross_entropy_forward(logits, target, -100, "mean", 0.0, True), host_ahead=True).median_us
        ce._vocab_splits = orig
        res["clone"] = bench(lambda: logits.clone(), host_ahead=True).median_us
        print(f"rows {rows:4d} " + "  ".join(f"{k} {v:7.1f} us ({nbytes / v / 1e3:5.0f} GB/s)" for k, v in res.items()), flush=True)


if __name__ == "__main__":
    main()
