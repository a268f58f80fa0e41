"""Flash forward: conditional rescaling (lazy_rescale) on/off over a few tile configs, against cuDNN, one run."""
import json, sys, torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from fuselab.kernels import _flash_common as fc, flash_attention
from fuselab.kernels._flash_common import ForwardConfig as C
from fuselab.timing import bench

timing = dict(warmup_ms=25.0, rep_ms=100.0)
TMA = [C(64, 64, 4, 3), C(128, 128, 8, 3), C(128, 64, 8, 3), C(64, 64, 4, 4), C(64, 64, 4, 2), C(128, 64, 4, 3)]
PTR64 = [C(128, 64, 8, 4), C(128, 128, 8, 3), C(128, 64, 4, 3)]
res = []
for head_dim, seq in ((128, 4096), (128, 16384), (64, 4096)):
    batch, heads = 32768 // seq, 2048 // head_dim
    q, k, v = (torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for causal in (True, False):
        flops = 4.0 * batch * heads * seq * seq * head_dim / (2 if causal else 1)
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            cudnn = bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal), **timing).median_us
        line = f"d{head_dim} S{seq} causal={causal}: cuDNN {flops / cudnn / 1e6:.0f} TFLOP/s"
        print(line, flush=True)
        key = (head_dim, causal)
        saved_tma, saved_ptr = fc.TMA_FORWARD_CONFIGS.get(key), fc.FORWARD_CONFIGS[head_dim]
        cands = [("tma", c) for c in TMA] + ([("ptr", c) for c in PTR64] if head_dim == 64 else [])
        for kind, base in cands:
            for lazy in (False, True):
                cfg = base._replace(lazy_rescale=lazy)
                if kind == "tma":
                    fc.TMA_FORWARD_CONFIGS[key] = cfg
                else:
                    fc.TMA_FORWARD_CONFIGS.pop(key, None); fc.FORWARD_CONFIGS[head_dim] = cfg
                try:
                    err = (flash_attention(q, k, v, causal=causal).float() - ref.float()).abs().max().item()
                    us = bench(lambda: flash_attention(q, k, v, causal=causal), **timing).median_us
                except Exception as e:
                    print(f"   {kind} {tuple(cfg)} failed: {type(e).__name__} {str(e)[:100]}", flush=True); continue
                r = dict(head_dim=head_dim, seq=seq, causal=causal, kind=kind, config=list(cfg), us=us,
                         tflops=flops / us / 1e6, vs_cudnn=cudnn / us, max_abs_diff=err, cudnn_us=cudnn)
                res.append(r)
                print(f"   {kind} {tuple(cfg)}: {us:8.1f} us {r['tflops']:5.0f} TFLOP/s {r['vs_cudnn']:.3f}x cuDNN err {err:.3g}", flush=True)
        if saved_tma is None:
            fc.TMA_FORWARD_CONFIGS.pop(key, None)
        else:
            fc.TMA_FORWARD_CONFIGS[key] = saved_tma
        fc.FORWARD_CONFIGS[head_dim] = saved_ptr
    del q, k, v
    torch.cuda.empty_cache()
json.dump(res, open(sys.argv[1], "w"), indent=1)
