"""Persistent flash forward (TMA): each program loops over tiles p, p + G, ...; with flatten=True the
tile loop and the key loop become one pipelined loop, so the next tile's first K/V loads overlap this
tile's last blocks and epilogue. Run 1 (fa_persist-1.txt): that kernel (`persist`), causal and not;
run 2 (fa_persist-2.txt): the tile and key loops flattened by hand (`flat`), non-causal.

    PYTHONPATH=. python3 benchmarks/results/2026-11-30-h200/flash-persistent-halves/fa_persist.py RUN
"""
import importlib
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from fuselab.kernels import flash_attention
from fuselab.kernels._launch import resident_programs, sm_count
from fuselab.timing import bench

fa = importlib.import_module("fuselab.kernels.flash_attention")


@triton.jit
def _persist_kernel(q_desc, k_desc, v_desc, o_desc, LSE, stride_lb, stride_lh, num_heads, group_size,
                    seq_q, seq_k, qk_scale, m_blocks, tiles,
                    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                    FLATTEN: tl.constexpr, WS: tl.constexpr):
    offs_n = tl.arange(0, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tiles, tl.num_programs(0), flatten=FLATTEN, warp_specialize=WS):
        pid_m = tile % m_blocks
        if CAUSAL:
            pid_m = m_blocks - 1 - pid_m
        pid_bh = tile // m_blocks
        batch = pid_bh // num_heads
        head = pid_bh % num_heads
        kv_bh = batch * (num_heads // group_size) + head // group_size
        start_m = pid_m * BLOCK_M
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = q_desc.load([pid_bh, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        if CAUSAL:
            hi = tl.minimum(start_m + BLOCK_M, seq_k)
        else:
            hi = seq_k
        for start_n in range(0, hi, BLOCK_N):
            start_n = tl.multiple_of(start_n, BLOCK_N)
            k = k_desc.load([kv_bh, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
            qk = tl.dot(q, tl.trans(k))
            if CAUSAL:
                keys = start_n + offs_n
                qk = tl.where(offs_m[:, None] >= keys[None, :], qk * qk_scale, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(qk, 1))
                qk = qk - m_new[:, None]
            else:
                m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
                qk = qk * qk_scale - m_new[:, None]
            p = tl.math.exp2(qk)
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = v_desc.load([kv_bh, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
            m_i = m_new
        tl.store(LSE + batch.to(tl.int64) * stride_lb + head.to(tl.int64) * stride_lh + offs_m,
                 m_i + tl.math.log2(l_i), mask=offs_m < seq_q)
        o_desc.store([pid_bh, start_m, 0], (acc / l_i[:, None]).to(q.dtype).reshape(1, BLOCK_M, HEAD_DIM))


@triton.jit
def _flat_kernel(q_desc, k_desc, v_desc, o_desc, LSE, stride_lb, stride_lh, num_heads, group_size,
                 seq_q, seq_k, qk_scale, m_blocks, tiles,
                 HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, QMODE: tl.constexpr):
    """Non-causal, seq_k a multiple of BLOCK_N: one loop over (this program's tiles x key blocks), so
    the pipeliner prefetches across tile boundaries."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    n_kb = seq_k // BLOCK_N
    total = tl.cdiv(tiles - pid, programs) * n_kb
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    q = tl.zeros([BLOCK_M, HEAD_DIM], dtype=q_desc.dtype)
    for it in range(0, total):
        j = it // n_kb
        kb = it - j * n_kb
        tile = pid + j * programs
        pid_m = tile % m_blocks
        pid_bh = tile // m_blocks
        batch = pid_bh // num_heads
        head = pid_bh % num_heads
        kv_bh = batch * (num_heads // group_size) + head // group_size
        start_m = pid_m * BLOCK_M
        if QMODE == 0:
            q = q_desc.load([pid_bh, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)
        else:
            if kb == 0:
                q = q_desc.load([pid_bh, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)
        first = kb == 0
        m_i = tl.where(first, float("-inf"), m_i)
        l_i = tl.where(first, 0.0, l_i)
        start_n = kb * BLOCK_N
        k = k_desc.load([kv_bh, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        qk = tl.dot(q, tl.trans(k))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        qk = qk * qk_scale - m_new[:, None]
        p = tl.math.exp2(qk)
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = v_desc.load([kv_bh, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
        if kb == n_kb - 1:
            offs_m = start_m + tl.arange(0, BLOCK_M)
            tl.store(LSE + batch.to(tl.int64) * stride_lb + head.to(tl.int64) * stride_lh + offs_m,
                     m_i + tl.math.log2(l_i), mask=offs_m < seq_q)
            o_desc.store([pid_bh, start_m, 0], (acc / l_i[:, None]).to(o_desc.dtype).reshape(1, BLOCK_M, HEAD_DIM))


def flat(q, k, v, causal, bm, bn, warps, stages, qmode, per_sm=None):
    assert not causal
    batch, heads, seq, d = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(batch, heads, seq, device=q.device, dtype=torch.float32)

    def desc(t, rows):
        return TensorDescriptor.from_tensor(t.view(-1, t.shape[2], d), [1, rows, d])
    m_blocks = triton.cdiv(seq, bm)
    tiles = m_blocks * batch * heads
    args = (desc(q, bm), desc(k, bn), desc(v, bn), desc(out, bm), lse, lse.stride(0), lse.stride(1), heads,
            heads // k.shape[1], seq, k.shape[2], d ** -0.5 * 1.4426950408889634, m_blocks, tiles)
    kw = dict(HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn, QMODE=qmode, num_warps=warps, num_stages=stages)
    key = ("flat", bm, bn, warps, stages, qmode)
    if key not in _cap:
        c = _flat_kernel.warmup(*args, grid=(1,), **kw)
        _cap[key] = resident_programs(c, q.device)
        print(f"  {key}: regs {c.n_regs} spills {c.n_spills} smem {c.metadata.shared} resident {_cap[key]}", flush=True)
    grid = _cap[key] if per_sm is None else per_sm * sm_count(q.device)
    _flat_kernel[(min(grid, tiles),)](*args, **kw)
    return out


_cap = {}


def persist(q, k, v, causal, bm, bn, warps, stages, flatten, ws, per_sm=None):
    batch, heads, seq, d = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(batch, heads, seq, device=q.device, dtype=torch.float32)

    def desc(t, rows):
        return TensorDescriptor.from_tensor(t.view(-1, t.shape[2], d), [1, rows, d])
    m_blocks = triton.cdiv(seq, bm)
    tiles = m_blocks * batch * heads
    args = (desc(q, bm), desc(k, bn), desc(v, bn), desc(out, bm), lse, lse.stride(0), lse.stride(1), heads,
            heads // k.shape[1], seq, k.shape[2], d ** -0.5 * 1.4426950408889634, m_blocks, tiles)
    kw = dict(HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal, FLATTEN=flatten, WS=ws, num_warps=warps,
              num_stages=stages)
    key = (causal, bm, bn, warps, stages, flatten, ws)
    if key not in _cap:
        c = _persist_kernel.warmup(*args, grid=(1,), **kw)
        _cap[key] = resident_programs(c, q.device)
        print(f"  {key}: regs {c.n_regs} spills {c.n_spills} smem {c.metadata.shared} resident {_cap[key]}", flush=True)
    grid = _cap[key] if per_sm is None else per_sm * sm_count(q.device)
    _persist_kernel[(min(grid, tiles),)](*args, **kw)
    return out


def tflops(b, h, s, d, causal, us):
    f = 4 * b * h * s * s * d * (0.5 if causal else 1.0)
    return f / us / 1e6


CONFIGS = {
    False: [(128, 128, 8, 3, True, False), (128, 128, 8, 3, False, False), (128, 128, 8, 2, True, False),
            (128, 128, 8, 3, False, True), (128, 64, 8, 3, True, False), (128, 128, 8, 4, True, False)],
    True: [(64, 64, 4, 3, True, False), (64, 64, 4, 3, False, False), (128, 128, 8, 3, True, False),
           (128, 128, 8, 3, False, False), (128, 64, 8, 3, True, False), (64, 64, 4, 4, True, False)],
}


FLAT = [(128, 128, 8, 2, 0), (128, 128, 8, 2, 1), (128, 128, 8, 3, 1), (128, 64, 8, 3, 1), (128, 64, 8, 3, 0),
        (128, 64, 8, 4, 1), (128, 128, 8, 3, 0)]


def main(run):
    torch.manual_seed(0)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    heads, d = 16, 128
    for seq in (4096, 16384):
        batch = 32768 // seq
        q, k, v = (torch.randn(batch, heads, seq, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for causal in ((False, True) if run == 1 else (False,)):
            ref = flash_attention(q, k, v, causal=causal)
            res = {}
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                res["cudnn"] = bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)).median_us
            res["main"] = bench(lambda: flash_attention(q, k, v, causal=causal)).median_us
            variant, configs = (persist, CONFIGS[causal]) if run == 1 else (flat, FLAT)
            for cfg in configs:
                try:
                    out = variant(q, k, v, causal, *cfg)
                    err = (out.float() - ref.float()).abs().max().item()
                    res[("flat " if run == 2 else "") + str(cfg)] = bench(lambda: variant(q, k, v, causal, *cfg)).median_us
                    print(f"    {cfg} err {err:.2e}", flush=True)
                except Exception as e:
                    print(f"    {cfg} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                res["cudnn again"] = bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)).median_us
            res["main again"] = bench(lambda: flash_attention(q, k, v, causal=causal)).median_us
            cud = min(res["cudnn"], res["cudnn again"])
            for name, us in res.items():
                print(f"S{seq} causal={causal} {name:40s} {us:8.1f} us {tflops(batch, heads, seq, d, causal, us):6.1f} TFLOP/s "
                      f"{cud / us:.3f}x cudnn", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
