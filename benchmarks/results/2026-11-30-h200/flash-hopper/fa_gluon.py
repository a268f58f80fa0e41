"""Flash forward for Hopper in Gluon: a loader warp streams K/V through TMA into a ring of shared-memory
stages; two consumer warpgroups each own 64 of a program's 128 query rows and take turns at the tensor
cores (one's softmax runs while the other's matrix products do), each issuing this block's q·kᵀ together
with the previous block's p·v.

fa_gluon-1.txt was recorded with this kernel in a prototype file; it now lives, unchanged but for names, in
fuselab/kernels/_flash_forward_hopper.py, and this script launches it from there with 2 or 3 stages: checks
against SDPA in fp32 at small sizes, then times both against the Triton kernel and SDPA's cuDNN backend at head
dim 128, B·S = 32k tokens, 16 heads:

    PYTHONPATH=. python3 benchmarks/results/2026-11-30-h200/flash-hopper/fa_gluon.py 4096     (fa_gluon-1.txt)
"""

import importlib
import sys

import torch

hopper = importlib.import_module("fuselab.kernels._flash_forward_hopper")


def flash_gluon(q, k, v, causal, stages=3):
    batch, heads, seq, d = q.shape
    assert hopper.layout_fits(q, k, v, causal)
    out = torch.empty_like(q)
    lse = torch.empty(batch, heads, seq, device=q.device, dtype=torch.float32)
    m_blocks = seq // hopper._ROWS
    hopper._flash_forward_hopper_kernel[(m_blocks * batch * heads,)](
        hopper._descriptor(q, hopper._ROWS // 2), hopper._descriptor(k, hopper._KEYS), hopper._descriptor(v, hopper._KEYS),
        hopper._descriptor(out, hopper._ROWS // 2), lse, heads, heads // k.shape[1], seq, k.shape[2],
        d ** -0.5 * 1.4426950408889634, m_blocks, BLOCK_M=hopper._ROWS, BLOCK_N=hopper._KEYS, HEAD_DIM=d,
        STAGES=stages, CAUSAL=causal, COMPUTE_REGS=hopper._COMPUTE_REGS, LOAD_REGS=hopper._LOAD_REGS, num_warps=4)
    return out, lse


def _tflops(b, h, s, d, causal, us):
    return 4 * b * h * s * s * d * (0.5 if causal else 1.0) / us / 1e6


def main():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fuselab.kernels import flash_attention
    from fuselab.timing import bench

    torch.manual_seed(0)
    for (b, h, hk, s) in ((1, 2, 2, 256), (2, 4, 1, 384)):
        q = torch.randn(b, h, s, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b, hk, s, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        for causal in (False, True):
            for stages in (2, 3):
                out, lse = flash_gluon(q, k, v, causal, stages=stages)
                torch.cuda.synchronize()
                ref = torch.nn.functional.scaled_dot_product_attention(
                    q.float(), k.float().repeat_interleave(h // hk, 1), v.float().repeat_interleave(h // hk, 1),
                    is_causal=causal)
                print(f"check b{b} h{h}/{hk} s{s} causal={causal} stages={stages}: max err "
                      f"{(out.float() - ref).abs().max().item():.2e}", flush=True)
    heads, d = 16, 128
    for seq in [int(a) for a in sys.argv[1:]] or [4096, 16384]:
        batch = 32768 // seq
        q, k, v = (torch.randn(batch, heads, seq, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for causal in (False, True):
            ref = flash_attention(q, k, v, causal=causal)
            res = {}
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                res["cudnn"] = bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)).median_us
            res["main"] = bench(lambda: flash_attention(q, k, v, causal=causal)).median_us
            for stages in (2, 3):
                out, _ = flash_gluon(q, k, v, causal, stages=stages)
                err = (out.float() - ref.float()).abs().max().item()
                res[f"gluon stages {stages} (err {err:.1e})"] = bench(lambda: flash_gluon(q, k, v, causal, stages=stages)).median_us
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                res["cudnn again"] = bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)).median_us
            res["main again"] = bench(lambda: flash_attention(q, k, v, causal=causal)).median_us
            cud = min(res["cudnn"], res["cudnn again"])
            for name, us in res.items():
                print(f"S{seq} causal={causal} {name:36s} {us:8.1f} us {_tflops(batch, heads, seq, d, causal, us):6.1f} "
                      f"TFLOP/s {cud / us:.3f}x cudnn", flush=True)


if __name__ == "__main__":
    main()
