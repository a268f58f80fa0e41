"""Flash forward d=128 S4096: 256-row TMA tiles against the current tiles and cuDNN, one run."""
import json, sys, torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from fuselab.kernels import _flash_common as fc, flash_attention
from fuselab.kernels._flash_common import ForwardConfig as C
from fuselab.timing import bench

timing = dict(warmup_ms=10.0, rep_ms=40.0)
res = []
head_dim, seq = 128, 4096
batch, heads = 32768 // seq, 2048 // head_dim
q, k, v = (torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
for causal in (False, True):
    flops = 4.0 * batch * heads * seq * seq * head_dim / (2 if causal else 1)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        cudnn = bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal), **timing).median_us
    print(f"d{head_dim} S{seq} causal={causal}: cuDNN {flops / cudnn / 1e6:.0f} TFLOP/s", flush=True)
    key = (head_dim, causal)
    saved = fc.TMA_FORWARD_CONFIGS[key]
    for cfg in (saved, C(256, 64, 16, 2), C(256, 128, 16, 2), C(256, 64, 16, 3)):
        fc.TMA_FORWARD_CONFIGS[key] = cfg
        try:
            err = (flash_attention(q, k, v, causal=causal).float() - ref.float()).abs().max().item()
            us = bench(lambda: flash_attention(q, k, v, causal=causal), **timing).median_us
        except Exception as e:
            print(f"   {tuple(cfg)} failed: {type(e).__name__} {str(e)[:120]}", flush=True); continue
        r = dict(causal=causal, config=list(cfg), us=us, tflops=flops / us / 1e6, vs_cudnn=cudnn / us, max_abs_diff=err)
        res.append(r)
        print(f"   {tuple(cfg)}: {us:8.1f} us {r['tflops']:5.0f} TFLOP/s {r['vs_cudnn']:.3f}x cuDNN err {err:.3g}", flush=True)
    fc.TMA_FORWARD_CONFIGS[key] = saved
json.dump(res, open(sys.argv[1], "w"), indent=1)
