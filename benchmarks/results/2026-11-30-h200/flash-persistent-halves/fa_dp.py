"""Flash forward with each program's query rows in two halves (data partitioning): per key block, K
and V are loaded once and each half runs its own dot -> softmax -> dot chain, so one half's softmax can
overlap the other's tensor-core work; optionally with the compiler's warp specialization.

    PYTHONPATH=. python3 benchmarks/results/2026-11-30-h200/flash-persistent-halves/fa_dp.py 4096   (fa_dp-1.txt)
"""
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from fuselab.kernels import flash_attention
from fuselab.kernels._launch import resident_programs
from fuselab.timing import bench


@triton.jit
def _half_step(q, k, v, acc, l_i, m_i, offs_m, keys, qk_scale, MASK: tl.constexpr):
    qk = tl.dot(q, tl.trans(k))
    if MASK:
        qk = tl.where(offs_m[:, None] >= keys[None, :], qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        qk = qk - m_new[:, None]
    else:
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        qk = qk * qk_scale - m_new[:, None]
    p = tl.math.exp2(qk)
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, l_i, m_new


@triton.jit
def _keys(acc0, l0, m0, acc1, l1, m1, q0, q1, k_desc, v_desc, kv_bh, offs_m0, offs_m1, lo, hi, qk_scale,
          HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr, WS: tl.constexpr):
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WS):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        keys = start_n + offs_n
        k = k_desc.load([kv_bh, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        v = v_desc.load([kv_bh, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        acc0, l0, m0 = _half_step(q0, k, v, acc0, l0, m0, offs_m0, keys, qk_scale, MASK)
        acc1, l1, m1 = _half_step(q1, k, v, acc1, l1, m1, offs_m1, keys, qk_scale, MASK)
    return acc0, l0, m0, acc1, l1, m1


@triton.jit
def _dp_kernel(q_desc, k_desc, v_desc, o_desc, LSE, stride_lb, stride_lh, num_heads, group_size,
               seq_q, seq_k, qk_scale, m_blocks,
               HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
               WS: tl.constexpr):
    HALF: tl.constexpr = BLOCK_M // 2
    tile = tl.program_id(0)
    pid_m = tile % m_blocks
    if CAUSAL:
        pid_m = m_blocks - 1 - pid_m
    pid_bh = tile // m_blocks
    batch = pid_bh // num_heads
    head = pid_bh % num_heads
    kv_bh = batch * (num_heads // group_size) + head // group_size
    start_m = pid_m * BLOCK_M
    offs_m0 = start_m + tl.arange(0, HALF)
    offs_m1 = start_m + HALF + tl.arange(0, HALF)
    q0 = q_desc.load([pid_bh, start_m, 0]).reshape(HALF, HEAD_DIM)
    q1 = q_desc.load([pid_bh, start_m + HALF, 0]).reshape(HALF, HEAD_DIM)
    m0 = tl.full([HALF], float("-inf"), dtype=tl.float32)
    l0 = tl.zeros([HALF], dtype=tl.float32)
    acc0 = tl.zeros([HALF, HEAD_DIM], dtype=tl.float32)
    m1 = tl.full([HALF], float("-inf"), dtype=tl.float32)
    l1 = tl.zeros([HALF], dtype=tl.float32)
    acc1 = tl.zeros([HALF, HEAD_DIM], dtype=tl.float32)
    if CAUSAL:
        acc0, l0, m0, acc1, l1, m1 = _keys(acc0, l0, m0, acc1, l1, m1, q0, q1, k_desc, v_desc, kv_bh, offs_m0, offs_m1,
                                           0, start_m, qk_scale, HEAD_DIM, BLOCK_N, False, WS)
        acc0, l0, m0, acc1, l1, m1 = _keys(acc0, l0, m0, acc1, l1, m1, q0, q1, k_desc, v_desc, kv_bh, offs_m0, offs_m1,
                                           start_m, start_m + BLOCK_M, qk_scale, HEAD_DIM, BLOCK_N, True, WS)
    else:
        acc0, l0, m0, acc1, l1, m1 = _keys(acc0, l0, m0, acc1, l1, m1, q0, q1, k_desc, v_desc, kv_bh, offs_m0, offs_m1,
                                           0, seq_k, qk_scale, HEAD_DIM, BLOCK_N, False, WS)
    lse_base = LSE + batch.to(tl.int64) * stride_lb + head.to(tl.int64) * stride_lh
    tl.store(lse_base + offs_m0, m0 + tl.math.log2(l0))
    tl.store(lse_base + offs_m1, m1 + tl.math.log2(l1))
    o_desc.store([pid_bh, start_m, 0], (acc0 / l0[:, None]).to(o_desc.dtype).reshape(1, HALF, HEAD_DIM))
    o_desc.store([pid_bh, start_m + HALF, 0], (acc1 / l1[:, None]).to(o_desc.dtype).reshape(1, HALF, HEAD_DIM))


def dp(q, k, v, causal, bm, bn, warps, stages, ws, maxnreg=None):
    batch, heads, seq, d = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(batch, heads, seq, device=q.device, dtype=torch.float32)

    def desc(t, rows):
        return TensorDescriptor.from_tensor(t.view(-1, t.shape[2], d), [1, rows, d])
    m_blocks = triton.cdiv(seq, bm)
    kw = dict(HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal, WS=ws, num_warps=warps, num_stages=stages)
    if maxnreg:
        kw["maxnreg"] = maxnreg
    _dp_kernel[(m_blocks * batch * heads,)](
        desc(q, bm // 2), desc(k, bn), desc(v, bn), desc(out, bm // 2), lse, lse.stride(0), lse.stride(1), heads,
        heads // k.shape[1], seq, k.shape[2], d ** -0.5 * 1.4426950408889634, m_blocks, **kw)
    return out


def tflops(b, h, s, d, causal, us):
    return 4 * b * h * s * s * d * (0.5 if causal else 1.0) / us / 1e6


CONFIGS = [(128, 128, 8, 3, False), (128, 128, 4, 3, True), (128, 128, 8, 3, True), (256, 128, 8, 2, False),
           (256, 64, 8, 3, False), (256, 128, 4, 3, True), (256, 64, 4, 3, True), (128, 64, 4, 3, True),
           (256, 128, 8, 3, True), (128, 64, 8, 3, False)]


def main():
    torch.manual_seed(0)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    heads, d = 16, 128
    seqs = [int(a) for a in sys.argv[1:]] or [4096]
    for seq in seqs:
        batch = 32768 // seq
        q, k, v = (torch.randn(batch, heads, seq, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for causal in (False, True):
            ref = flash_attention(q, k, v, causal=causal)
            res = {}
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                res["cudnn"] = bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)).median_us
            res["main"] = bench(lambda: flash_attention(q, k, v, causal=causal)).median_us
            for cfg in CONFIGS:
                try:
                    out = dp(q, k, v, causal, *cfg)
                    err = (out.float() - ref.float()).abs().max().item()
                    res["dp " + str(cfg)] = bench(lambda: dp(q, k, v, causal, *cfg)).median_us
                    print(f"    {cfg} err {err:.2e}", flush=True)
                except Exception as e:
                    print(f"    {cfg} failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                res["cudnn again"] = bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)).median_us
            res["main again"] = bench(lambda: flash_attention(q, k, v, causal=causal)).median_us
            cud = min(res["cudnn"], res["cudnn again"])
            for name, us in res.items():
                print(f"S{seq} causal={causal} {name:34s} {us:8.1f} us {tflops(batch, heads, seq, d, causal, us):6.1f} TFLOP/s "
                      f"{cud / us:.3f}x cudnn", flush=True)


if __name__ == "__main__":
    main()
