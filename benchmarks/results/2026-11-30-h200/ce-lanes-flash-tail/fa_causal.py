"""Causal flash forward at head dim 128: main's 64x64 tiles against 128-row tiles, by sequence length, with SDPA's
cuDNN backend in the same rounds (four, interleaved).

    PYTHONPATH=. python3 exp/fa_causal.py
"""
import importlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from fuselab.kernels import flash_attention
from fuselab.kernels._flash_common import ForwardConfig
from fuselab.timing import bench

fa = importlib.import_module("fuselab.kernels.flash_attention")
CONFIGS = [ForwardConfig(64, 64, 4, 3), ForwardConfig(128, 128, 8, 3), ForwardConfig(128, 64, 8, 3), ForwardConfig(128, 128, 8, 2)]


def ours(cfg):
    def call(q, k, v):
        fa.tma_forward_config = lambda head_dim, causal: cfg
        return flash_attention(q, k, v, causal=True)
    return call


def cudnn(q, k, v):
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def main():
    impls = {f"{tuple(c)}": ours(c) for c in CONFIGS}
    impls["cudnn"] = cudnn
    for seq in (4096, 8192, 16384):
        batch, heads = 32768 // seq, 16
        q, k, v = (torch.randn(batch, heads, seq, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flops = 2.0 * batch * heads * seq * seq * 128
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True).float()
        times = {n: [] for n in impls}
        for _ in range(4):
            for n, fn in impls.items():
                err = (fn(q, k, v).float() - ref).abs().max().item()
                if err > 0.05:
                    print(f"  !! {n} max abs diff {err}", flush=True)
                times[n].append(bench(lambda: fn(q, k, v)).median_us)
        print(f"D128 S{seq} B{batch} H{heads} causal", flush=True)
        best = {n: min(t) for n, t in times.items()}
        med = {n: sorted(t)[len(t) // 2] for n, t in times.items()}
        for n in impls:
            print(f"  {n:22s} best {best[n]:8.1f} us {flops / best[n] / 1e6:5.0f} TFLOP/s x{best['cudnn'] / best[n]:.3f} cudnn"
                  f"  median {med[n]:8.1f} x{med['cudnn'] / med[n]:.3f}  rounds {[round(x, 1) for x in times[n]]}", flush=True)
        del q, k, v
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
