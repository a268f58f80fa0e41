"""Tiles of `sum_partials` ([groups, partials, 8192] fp32 -> bf16) against torch's sum + cast.

    PYTHONPATH=. python3 benchmarks/results/2026-11-30-h200/gelu-partials-ce-split/sweep_partials.py
"""

import itertools

import torch

from fuselab.kernels import _partials as P
from fuselab.timing import bench


def main():
    dev = torch.device("cuda")
    res = {}
    for groups, n in [(1, 261), (2, 528), (1, 1024), (1, 32)]:
        parts = torch.randn(groups, n, 8192, device=dev)
        ref = parts.double().sum(1)
        base = bench(lambda: [parts[g].sum(0).to(torch.bfloat16) for g in range(groups)]).median_us
        line = [f"{groups}x{n}x8192 torch {base:.1f}"]
        best = None
        for bp, bc, st, w in itertools.product([16, 32, 64], [32, 64, 128], [2, 3, 4], [4, 8]):
            P._BLOCK_PARTIALS, P._BLOCK_COLUMNS, P._STAGES, P._NUM_WARPS = bp, bc, st, w
            out = P.sum_partials(parts, torch.float32)
            assert torch.allclose(out.double(), ref, rtol=1e-4, atol=1e-3)
            t = bench(lambda: P.sum_partials(parts, torch.bfloat16)).median_us
            res[(groups, n, bp, bc, st, w)] = t
            if best is None or t < best[0]:
                best = (t, bp, bc, st, w)
        line.append(f"best {best}")
        for cfg in [(32, 64, 3, 4), (64, 64, 3, 4), (32, 32, 3, 4), (64, 64, 4, 8)]:
            line.append(f"{cfg}: {res[(groups, n) + cfg]:.1f}")
        print("  ".join(line))


if __name__ == "__main__":
    main()
