"""Flash forward with the last wave's tiles split along the keys, against the same kernel unsplit and SDPA's
cuDNN and flash backends, interleaved over three rounds (non-causal; causal shapes for reference).

    PYTHONPATH=. python3 exp/fa_split.py
"""
import importlib
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from fuselab.kernels import flash_attention
from fuselab.timing import bench

fa = importlib.import_module("fuselab.kernels.flash_attention")
sys.path.insert(0, "exp")
fa_head = importlib.import_module("fa_head")  # the kernels before the split, as committed
SPLIT = fa.tail_split


def no_split(tiles, slots, key_blocks):
    return tiles, 1, key_blocks


def sdpa(backend):
    def call(q, k, v, causal):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return call


def ours(split):
    def call(q, k, v, causal):
        fa.tail_split = split
        return flash_attention(q, k, v, causal=causal)
    return call


IMPLS = {"split": ours(SPLIT), "unsplit": ours(no_split),
         "before": lambda q, k, v, causal: fa_head.flash_attention(q, k, v, causal=causal), "cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
         "sdpa flash": sdpa(SDPBackend.FLASH_ATTENTION)}


def main():
    shapes = [(128, 4096, False), (128, 16384, False), (64, 4096, False), (64, 16384, False), (128, 1024, False),
              (128, 4096, True), (128, 16384, True)]
    for head_dim, seq, causal in shapes:
        batch, heads = 32768 // seq, 2048 // head_dim
        q, k, v = (torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flops = 4.0 * batch * heads * seq * seq * head_dim / (2 if causal else 1)
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal).float()
        tiles = -(-seq // 128) * batch * heads
        info = fa._slots_cache
        times = {name: [] for name in IMPLS}
        for _ in range(3):
            for name, fn in IMPLS.items():
                err = (fn(q, k, v, causal).float() - ref).abs().max().item()
                times[name].append(bench(lambda: fn(q, k, v, causal)).median_us)
                if err > 0.05:
                    print(f"  !! {name} max abs diff {err}", flush=True)
        best = {n: min(t) for n, t in times.items()}
        line = " ".join(f"{n} {best[n]:8.1f}us {flops / best[n] / 1e6:5.0f}TF" for n in IMPLS)
        print(f"D{head_dim} S{seq} B{batch} H{heads} causal={causal}: {line} | split/cudnn "
              f"{best['cudnn'] / best['split']:.3f} unsplit/cudnn {best['cudnn'] / best['unsplit']:.3f} "
              f"before/cudnn {best['cudnn'] / best['before']:.3f} "
              f"all rounds {dict((n, [round(x, 1) for x in t]) for n, t in times.items())}", flush=True)
        print(f"  slots cache {info}", flush=True)
        del q, k, v
        torch.cuda.empty_cache()
    fa.tail_split = SPLIT


if __name__ == "__main__":
    sys.exit(main())
