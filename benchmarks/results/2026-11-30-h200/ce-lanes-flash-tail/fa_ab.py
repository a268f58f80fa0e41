"""A/B of the last-wave split: the kernels as committed before it, one kernel holding whole tiles and parts
(main), whole tiles and parts as two kernels (exp/fa_two.py), and SDPA's cuDNN backend; four interleaved rounds.

    PYTHONPATH=. python3 exp/fa_ab.py
"""
import importlib
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from fuselab.timing import bench

sys.path.insert(0, "exp")
MODULES = {"before": importlib.import_module("fa_head"), "one kernel": importlib.import_module("fuselab.kernels.flash_attention"),
           "two kernels": importlib.import_module("fa_two")}


def cudnn(q, k, v, causal):
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


IMPLS = {name: (lambda m: lambda q, k, v, causal: m.flash_attention(q, k, v, causal=causal))(m) for name, m in MODULES.items()}
IMPLS["cudnn"] = cudnn


def main():
    for head_dim, seq, causal in [(128, 4096, False), (128, 16384, False), (64, 4096, False), (64, 16384, False)]:
        batch, heads = 32768 // seq, 2048 // head_dim
        q, k, v = (torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flops = 4.0 * batch * heads * seq * seq * head_dim / (2 if causal else 1)
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal).float()
        times = {name: [] for name in IMPLS}
        for _ in range(4):
            for name, fn in IMPLS.items():
                err = (fn(q, k, v, causal).float() - ref).abs().max().item()
                if err > 0.05:
                    print(f"  !! {name} max abs diff {err}", flush=True)
                times[name].append(bench(lambda: fn(q, k, v, causal)).median_us)
        best = {n: min(t) for n, t in times.items()}
        med = {n: sorted(t)[len(t) // 2] for n, t in times.items()}
        print(f"D{head_dim} S{seq} B{batch} H{heads} causal={causal}", flush=True)
        for n in IMPLS:
            print(f"  {n:12s} best {best[n]:8.1f} us {flops / best[n] / 1e6:5.0f} TFLOP/s  x{best['cudnn'] / best[n]:.3f} cudnn"
                  f"  median-of-rounds {med[n]:8.1f} us x{med['cudnn'] / med[n]:.3f}  rounds {[round(x, 1) for x in times[n]]}",
                  flush=True)
        del q, k, v
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
