"""The TMA forward kernel's tiles at head dim 128, seq 4096 (B8 H16), causal and not: configs the earlier sweep
did not try (64-row tiles over 32-key steps, two stages of 64 or 128 keys, 128x32), against the ones in use and
SDPA's cuDNN backend, three interleaved rounds.

    PYTHONPATH=. python3 benchmarks/results/2026-11-30-h200/ce-lanes-flash-tail/fa_tiles.py
"""
import importlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from fuselab.kernels import flash_attention
from fuselab.kernels._flash_common import ForwardConfig
from fuselab.timing import bench

fa = importlib.import_module("fuselab.kernels.flash_attention")
CONFIGS = [ForwardConfig(64, 64, 4, 3), ForwardConfig(128, 128, 8, 3), ForwardConfig(64, 32, 4, 3),
           ForwardConfig(64, 32, 4, 4), ForwardConfig(64, 64, 4, 2), ForwardConfig(64, 128, 4, 2),
           ForwardConfig(128, 32, 8, 4), ForwardConfig(64, 32, 4, 2)]


def ours(cfg, causal):
    def call(q, k, v):
        fa.tma_forward_config = lambda head_dim, c, seq_q: cfg
        return flash_attention(q, k, v, causal=causal)
    return call


def main():
    q, k, v = (torch.randn(8, 16, 4096, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for causal in (True, False):
        def cudnn(q, k, v):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        impls = {str(tuple(c)): ours(c, causal) for c in CONFIGS if not causal or c.block_m % c.block_n == 0}
        impls["cudnn"] = cudnn
        flops = 4.0 * 8 * 16 * 4096 * 4096 * 128 / (2 if causal else 1)
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal).float()
        times = {n: [] for n in impls}
        for _ in range(3):
            for n, fn in impls.items():
                try:
                    err = (fn(q, k, v).float() - ref).abs().max().item()
                    if err > 0.05:
                        print(f"  !! {n} max abs diff {err}", flush=True)
                    times[n].append(bench(lambda: fn(q, k, v)).median_us)
                except Exception as e:  # noqa: BLE001
                    times[n].append(float("inf"))
                    print(f"  {n}: {type(e).__name__} {str(e)[:120]}", flush=True)
        print(f"D128 S4096 B8 H16 causal={causal}", flush=True)
        best = {n: min(t) for n, t in times.items()}
        med = {n: sorted(t)[1] for n, t in times.items()}
        for n in impls:
            print(f"  {n:20s} best {best[n]:8.1f} us {flops / best[n] / 1e6:5.0f} TFLOP/s x{best['cudnn'] / best[n]:.3f}"
                  f"  median {med[n]:8.1f} x{med['cudnn'] / med[n]:.3f}  rounds {[round(x, 1) for x in times[n]]}", flush=True)


if __name__ == "__main__":
    main()
